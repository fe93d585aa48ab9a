"""``jaxremat.remat(fun, budget)``: optimal rematerialisation for any JAX function.

The function is traced to a jaxpr on its first call for given input shapes (also under
``jax.jit``: only shapes are needed), cut into stages (:mod:`jaxremat.model.jaxpr_chain`),
profiled and planned once; later calls with those shapes reuse the plan. The returned function
has ``fun``'s signature and outputs; its gradient, with respect to any of its inputs, follows the
plan. :meth:`RematFunction.with_budget` plans again for another budget without profiling again.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Callable

import jax
import numpy as np

from jaxremat.api.planner import plan_options, warn_if_global
from jaxremat.api.plans import Plan, PlanOptions, make_plan
from jaxremat.core.budgets import Budget
from jaxremat.core.costs import ChainCosts, Shared
from jaxremat.core.units import format_bytes
from jaxremat.model.identity import leaf_signature
from jaxremat.model.jaxpr_chain import MAX_STAGES, JaxprChain, find_cuts, trace
from jaxremat.model.trees import abstract
from jaxremat.profiling.profiler import profile
from jaxremat.run.executor import execute

_UNSET: Any = object()


@dataclasses.dataclass
class _Prepared:
    """One input signature's traced chain, its plan, and the trees to rebuild outputs."""

    traced: JaxprChain
    plan: Plan
    in_tree: Any
    out_tree: Any


def with_shared(costs: ChainCosts, traced: JaxprChain) -> ChainCosts:
    """``costs`` with the traced chain's shared values (``ChainCosts.shared``), sized as the
    profile sizes activations: scaled by the least ratio of profiled to global bytes over the
    activations that hold each (per device on a mesh), and no larger than the bundle of the
    stage that makes them keeps."""
    found = traced.shared_values()
    if not found:
        return costs
    ratio = [min(1.0, int(costs.x[k]) / max(traced.activation_bytes(k), 1)) for k in range(costs.length + 1)]
    sized = [(f, last, int(b * min(ratio[f : last + 1])), name) for f, last, b, name in found]
    made: dict[int, int] = {}
    for f, _, b, _ in sized:
        made[f - 1] = made.get(f - 1, 0) + b
    fit = {i: min(1.0, min(costs.option(i, k).xbar for k in range(costs.option_count(i))) / b) for i, b in made.items() if b}
    shared = [Shared(f, last, int(b * fit.get(f - 1, 1.0)), name) for f, last, b, name in sized]
    return dataclasses.replace(costs, shared=tuple(v for v in shared if v.nbytes))


class RematFunction:
    """``fun`` whose gradient follows an optimal schedule within ``budget`` (see :func:`remat`)."""

    def __init__(self, fun: Callable, budget: Budget, stages: Any, max_stages: int, options: PlanOptions,
                 costs: dict[str, ChainCosts] | None = None):
        if not callable(fun):
            raise TypeError(f"jaxremat.remat needs a function, got {type(fun).__name__}")
        self.fun, self.budget, self.stages, self.max_stages, self.options = fun, budget, stages, max_stages, options
        self._costs: dict[str, ChainCosts] = {} if costs is None else costs  # shared with with_budget
        self._prepared: dict[str, _Prepared] = {}
        functools.update_wrapper(self, fun)

    def with_budget(self, budget: Budget) -> "RematFunction":
        """The same function planned for ``budget``, sharing this one's profiles."""
        return RematFunction(self.fun, budget, self.stages, self.max_stages, self.options, self._costs)

    def _prepare(self, args: tuple) -> _Prepared:
        key = json.dumps([leaf_signature(args), str(jax.tree.structure(args)), str(self.stages)])
        if key in self._prepared:
            return self._prepared[key]
        warn_if_global(args)
        with jax.ensure_compile_time_eval():  # may run while the caller's step is traced
            closed, in_tree, out_tree = trace(self.fun, args)
            flat = [abstract(x) if hasattr(x, "dtype") else jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x))
                    for x in jax.tree.leaves(args)]
            if not any(jax.numpy.issubdtype(s.dtype, jax.numpy.inexact) for s in flat):
                raise TypeError(
                    "jaxremat.remat: the function has no input that can carry a gradient (no float arrays); "
                    "remat plans what a gradient keeps, so give it the parameters or data to differentiate"
                )
            traced = JaxprChain(closed, find_cuts(closed.jaxpr, self.stages, self.max_stages))
            variables = traced.variable_shapes(flat)
            costs = self._costs.get(key)
            if costs is None:
                costs = profile(traced.chain, variables, (), method=self.options.method, policies=self.options.policies,
                                **self.options.profile_options)
                x = np.array(costs.x)
                x[0] = traced.context_bytes  # held for the whole step, as a_0 is
                costs = with_shared(dataclasses.replace(costs, x=x), traced)
                self._costs[key] = costs
            plan = make_plan(traced.chain, variables, (), self.budget, self.options, costs)
        note = (
            f"{traced.cuts.count} stages cut by {traced.cuts.how}; held for the whole step: "
            f"{format_bytes(traced.context_bytes)} of values without a gradient (masks, positions)"
        )
        sched = plan.schedule
        plan = Plan(dataclasses.replace(sched, note=f"{sched.note}; {note}" if sched.note else note), plan.signature)
        found = _Prepared(traced, plan, in_tree, out_tree)
        self._prepared[key] = found
        return found

    def plan(self, *args: Any) -> Plan:
        """The plan for inputs shaped like ``args`` (made now if needed)."""
        return self._prepare(args).plan

    def __call__(self, *args: Any) -> Any:
        prepared = self._prepare(args)
        variables = prepared.traced.variables(jax.tree.leaves(args))
        forward = execute(prepared.traced.chain, prepared.plan.schedule, policies=self.options.named_policies)
        out, _ = forward(variables, ())
        return jax.tree.unflatten(prepared.out_tree, list(out))


def remat(fun: Any = None, budget: Budget = _UNSET, *, stages: Any = "auto", max_stages: int = MAX_STAGES,
          **options: Any) -> Any:
    """``fun`` with an optimal rematerialisation schedule within ``budget``.

    Args:
      fun: any JAX function (``loss(params, batch)``, a model's apply, ...). With the budget as
        the only argument (``@jaxremat.remat("50%")``) or ``fun`` left out, a decorator.
      budget: bytes, ``"512MiB"``, a share of the store-all peak (``"40%"``), or ``None`` for
        the store-all peak.
      stages: how ``fun``'s equations are cut into stages: ``"auto"`` (the Flax module-scope
        depth with the most stages up to ``max_stages``, else ``checkpoint_name`` markers, else
        cuts before matmuls and convolutions where the fewest bytes cross), an int (a module
        depth), ``"names"``, ``"bytes"`` or a regex over module paths (``r"blocks_\\d+"``).
      options: ``algorithm``, ``method``, ``slots``, ``policies``, ``bandwidth`` as for
        :func:`jaxremat.remat_chain`; other keywords go to :func:`jaxremat.profile`.

    Returns:
      A function with ``fun``'s signature and outputs, planned on its first call for those input
      shapes; ``.plan(*args)`` gives the :class:`~jaxremat.Plan` (its report says how ``fun``
      was cut), ``.with_budget(b)`` plans again without profiling. On the CPU, compile steps
      with :func:`jaxremat.jit`.
    """
    if fun is not None and not callable(fun):  # remat("50%") or remat(None): the budget first
        if budget is not _UNSET:
            raise TypeError("jaxremat.remat(fun, budget): the first argument is the function")
        fun, budget = None, fun
    if budget is _UNSET:
        raise TypeError("jaxremat.remat needs a budget: bytes, '512MiB', '40%', or None for the store-all peak")
    known = {"algorithm", "method", "slots", "calibrate", "max_period", "policies", "bandwidth", "profile"}
    opts = plan_options(**{k: v for k, v in options.items() if k in known},
                        profile_options={k: v for k, v in options.items() if k not in known})
    if opts.calibrate:
        raise ValueError("jaxremat.remat does not calibrate yet; plan from the cost model, or use remat_chain")
    if fun is None:
        return lambda f: RematFunction(f, budget, stages, max_stages, opts)
    return RematFunction(fun, budget, stages, max_stages, opts)


__all__ = ["RematFunction", "remat"]
