"""The planner behind :func:`~jaxremat.remat_chain` and :func:`~jaxremat.remat_nnx`, and
:func:`jaxremat.plan`."""

from __future__ import annotations

import warnings
from typing import Any

import jax

from jaxremat.api.plans import Plan, PlanOptions, make_plan, option_names, signature
from jaxremat.core.budgets import Budget, check_budget, is_share
from jaxremat.core.costs import ChainCosts
from jaxremat.model.chain import Chain
from jaxremat.model.trees import is_sharded, is_traced


class Planner:
    """Plans for one budget, by signature (stage structure, variable and input shapes).

    A plan is made on first use for a signature (also while the caller's step is traced: only
    shapes are needed), profiles are kept per signature, so another budget
    (:meth:`with_budget`) solves again without profiling.
    """

    def __init__(self, budget: Budget, options: PlanOptions, costs: dict[str, ChainCosts] | None = None):
        self.budget, self.options = check_budget(budget), options
        self.costs: dict[str, ChainCosts] = {} if costs is None else costs  # shared across budgets
        self.plans: dict[str, Plan] = {}

    def with_budget(self, budget: Budget) -> "Planner":
        """A planner for ``budget`` that shares this one's profiles."""
        return Planner(budget, self.options, self.costs)

    def add(self, plan: Plan) -> None:
        """Use ``plan`` for its signature (a plan loaded from a file)."""
        self.plans[plan.signature] = plan

    def plan(self, chain: Chain, variables: Any, sample: Any) -> Plan:
        key = signature(chain, variables, sample)
        if key not in self.plans:
            warn_if_global(variables, sample, budget=self.budget)
            with jax.ensure_compile_time_eval():  # may run while the caller's step is traced
                p = make_plan(chain, variables, sample, self.budget, self.options, self.costs.get(key))
            self.costs[key], self.plans[key] = p.costs, p
        return self.plans[key]


def warn_if_global(*trees: Any, budget: Budget = None) -> None:
    """Warn when a plan is made from traced values on a machine with several devices whose
    shardings are not visible (inside ``jax.jit`` under ``Auto`` mesh axes): the plan is for
    global shapes. A share of the store-all peak still means the same share per device; a byte
    budget does not, so it is refused (:class:`ValueError`) with the ways that work."""
    leaves = jax.tree.leaves(trees)
    traced = any(is_traced(leaf) for leaf in leaves)
    if not (traced and jax.device_count() > 1 and not is_sharded(trees)):
        return
    ways = (
        "call the step through jaxremat.jit(step) (it reads the shardings of the arrays you pass), "
        "make the plan first from your sharded arrays outside jit (jaxremat.plan(model, params, x), "
        "or fun.plan(*args) for jaxremat.remat), or use a mesh with Explicit axes (jax.set_mesh), "
        "whose shardings jit's traced values carry"
    )
    if budget is not None and not is_share(budget):
        raise ValueError(
            f"jaxremat: a byte budget ({budget!r}) is per device, and inside jax.jit on {jax.device_count()} devices "
            f"the arrays' shardings are not visible, so the plan would be for global shapes; {ways}; or give a share "
            "of the store-all peak ('50%'), which is the same per device"
        )
    warnings.warn(
        "jaxremat: planning inside jit, where the arrays' shardings are not visible, so the plan is "
        f"made for global shapes, not per device; {ways}",
        stacklevel=4,
    )


def plan_options(method: str | None = None, **options: Any) -> PlanOptions:
    """:class:`PlanOptions` from keyword arguments; an unknown one is a :class:`TypeError` naming those known."""
    unknown = sorted(set(options) - set(option_names()) - {"profile_options"})
    if unknown:
        raise TypeError(f"unknown option(s) {', '.join(unknown)}; the options are {', '.join(option_names())}")
    return PlanOptions(method=method or "measure", **options)


#: The default of a decorator's ``budget`` when it was not given (``None`` means store-all).
UNSET: Any = object()


def plan(
    model: Any,
    variables: Any,
    sample: Any,
    budget: Budget = UNSET,
    *,
    costs: ChainCosts | None = None,
    **options: Any,
) -> Plan:
    """The plan for ``model`` on inputs shaped like ``sample``.

    Args:
      model: a :class:`~jaxremat.Chain`, a linen ``nn.Sequential`` or list of modules, or a
        model from :func:`~jaxremat.remat_chain` (whose own budget and options are used unless
        ``budget`` is given).
      variables: the model's variables (``model.init(...)``).
      sample: an input (or ``jax.ShapeDtypeStruct``) of the shape the step will see.
      budget: bytes, ``"512MiB"``, a share of the store-all peak (``"40%"``), or ``None`` for
        the store-all peak; required unless ``model`` has its own.
      costs: the chain's costs, when already profiled (no profiling then).
      options: ``algorithm``, ``method``, ``slots``, ``calibrate``, ``max_period``, ``policies``,
        ``bandwidth``, ``loss`` (:class:`~jaxremat.api.plans.PlanOptions`); other keywords go to
        :func:`jaxremat.profile` (``cache``, ``repeats``, ``quiet``, ``rates``).

    With ``calibrate=True``, XLA measures the compiled step of each candidate schedule and the
    budget is corrected until the measured peak fits, so the plan's memory is what XLA uses.
    A chain with :class:`~jaxremat.Repeat` layers gets, for ``algorithm="optimal"``, the
    fastest schedule that runs each of them as one loop over its stacked parameters: each copy
    stored or checkpointed alone, in any mix (a selective loop: one block body to compile), or a
    pattern of up to ``max_period`` stages repeated; of those within 0.5% of the fastest, the one
    that compiles least.
    """
    planner = getattr(model, "planner", None)
    if isinstance(planner, Planner) and isinstance(getattr(model, "chain", None), Chain):  # a wrapped model
        if options:
            raise TypeError(f"a wrapped model plans with its own options; got {', '.join(sorted(options))}")
        scanned = getattr(model, "scanned", None)  # a module of it scans over layers: planned from its jaxpr
        if scanned is not None and costs is None and scanned.holds_stack(variables, sample):
            return (scanned if budget is UNSET else scanned.with_budget(budget)).plan(variables, sample)
        planner = planner if budget is UNSET else planner.with_budget(budget)
        if costs is not None:
            planner.costs[signature(model.chain, variables, sample)] = costs
        return planner.plan(model.chain, variables, sample)
    if budget is UNSET:
        raise TypeError(
            "jaxremat.plan needs a budget for this model (bytes, '512MiB', '40%', or None for the store-all "
            "peak); only a model from jaxremat.remat_chain(budget) has its own"
        )
    chain = model if isinstance(model, Chain) else Chain.from_linen(model)
    known = {
        "algorithm",
        "method",
        "slots",
        "calibrate",
        "max_period",
        "policies",
        "bandwidth",
        "loss",
        "verify",
        "profile",
    }
    profile_options = {k: v for k, v in options.items() if k not in known}
    return make_plan(
        chain,
        variables,
        sample,
        budget,
        plan_options(**{k: v for k, v in options.items() if k in known}, profile_options=profile_options),
        costs,
    )


__all__ = ["UNSET", "Planner", "plan", "plan_options"]
