"""``remat_nnx(budget)``: the NNX counterpart of :func:`jaxremat.remat_chain`."""

from __future__ import annotations

from typing import Any, Callable

from flax import nnx

from jaxremat.api.planner import Planner, plan_options
from jaxremat.api.plans import Plan
from jaxremat.api.scanned_chains import ScannedChain
from jaxremat.core.budgets import Budget, check_budget
from jaxremat.model.chain import Chain
from jaxremat.model.nnx import layer_list, nnx_state
from jaxremat.run.executor import execute


class RematSequential(nnx.Module):
    """An ``nnx.Sequential`` (or an ``nnx.List`` or list of NNX modules) whose gradient follows a planned schedule.

    Call it like the wrapped model; ``nnx.grad`` / ``nnx.value_and_grad`` and ``nnx.Optimizer``
    see the same parameters (``model.layers``). Batch statistics and RNG counters are updated
    once per call, as without remat. Profiled and planned on the first call with concrete shapes
    (also under ``nnx.jit``), re-profiled when input shapes change. Options as for
    :class:`~jaxremat.RematChain` (:class:`~jaxremat.api.plans.PlanOptions`: ``algorithm``,
    ``method``, ``slots``, ``calibrate``, ``max_period``, ``policies``, ``bandwidth``, ``loss``,
    ``verify``), and ``plan``.
    """

    def __init__(self, model: Any, budget: Budget, *, plan: Plan | None = None, **options: Any):
        layers = layer_list(model)
        if not layers:
            what = "an empty one" if layers is not None else type(model).__name__
            raise ValueError(
                f"remat_nnx expects an nnx.Sequential, an nnx.List or a non-empty list of NNX modules, got {what}; "
                "for a model whose __call__ runs its layers itself, plan its loss with jaxremat.remat"
            )
        self.layers = nnx.List(layers)
        # built once: a stage keeps its layer's graph definition and reads its state per call
        self.chain = Chain.from_nnx(layers)
        self.planner = Planner(budget, plan_options(**options))
        self.scanned = ScannedChain(self.chain, budget, self.planner.options)
        if plan is not None:
            self.planner.add(plan)

    def variables(self) -> list:
        """Each layer's state as it is now, as the chain's per-stage variables."""
        return [nnx_state(layer) for layer in self.layers]

    def plan(self, sample: Any) -> Plan:
        """The plan used for inputs shaped like ``sample`` (made on first use). Where a layer
        runs a scan over stacked layers (``nnx.scan``), the chain is planned from its jaxpr as
        :func:`jaxremat.remat` plans it (:mod:`jaxremat.api.scanned_chains`)."""
        variables = self.variables()
        if self.scanned.holds_stack(variables, sample):
            return self.scanned.plan(variables, sample)
        return self.planner.plan(self.chain, variables, sample)

    def __call__(self, x: Any) -> Any:
        variables = self.variables()
        if self.scanned.holds_stack(variables, x, None):
            out, updates = self.scanned(variables, x, None)
        else:
            p = self.planner.plan(self.chain, variables, x)
            out, updates = execute(self.chain, p.schedule, policies=self.planner.options.named_policies)(variables, x)
        for i, new in updates.items():
            layer = self.layers[i]
            if isinstance(layer, nnx.Module) and "rest" in new:
                nnx.update(layer, new["rest"])
        return out


def remat_nnx(budget: Budget, **options: Any) -> Callable[[Any], RematSequential]:
    """Wrap an ``nnx.Sequential`` (or an ``nnx.List`` or list of NNX modules) to train under
    ``budget``: ``model = jaxremat.remat_nnx("40%")(nnx.Sequential(...))``. Options as for
    :func:`jaxremat.remat_chain` (:class:`~jaxremat.api.plans.PlanOptions`: ``algorithm``,
    ``method``, ``slots``, ``calibrate``, ``max_period``, ``policies``, ``bandwidth``, ``loss``,
    ``verify``), and ``plan``."""
    plan_options(**{k: v for k, v in options.items() if k != "plan"})  # fail now on a bad option
    check_budget(budget)  # and on a budget that cannot be read

    def wrap(model: Any) -> RematSequential:
        return RematSequential(model, budget, **options)

    return wrap


__all__ = ["RematSequential", "remat_nnx"]
