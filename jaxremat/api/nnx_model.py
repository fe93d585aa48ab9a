"""``remat_nnx(budget)``: the NNX counterpart of :func:`jaxremat.remat_chain`."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from jaxremat.chain import Chain
from jaxremat.costs import ChainCosts
from jaxremat.executor import execute
from jaxremat.plans import Plan, plan, signature


class _Planner:
    """Plans by input signature, kept outside the module's state (a static attribute)."""

    def __init__(self, budget: Any, algorithm: str, method: str, slots: int, calibrate: bool):
        self.budget, self.algorithm, self.method, self.slots, self.calibrate = budget, algorithm, method, slots, calibrate
        self.costs: dict[str, ChainCosts] = {}
        self.plans: dict[str, Plan] = {}

    def get(self, chain: Chain, variables: list, x: Any) -> Plan:
        key = signature(chain, variables, x)
        if key not in self.plans:
            with jax.ensure_compile_time_eval():  # may run while the caller's step is traced
                p = plan(chain, variables, x, self.budget, algorithm=self.algorithm, method=self.method,
                         slots=self.slots, costs=self.costs.get(key), calibrate=self.calibrate, quiet=True)
            self.costs[key], self.plans[key] = p.costs, p
        return self.plans[key]


class RematSequential(nnx.Module):
    """An ``nnx.Sequential`` (or list of NNX modules) whose gradient follows a planned schedule.

    Call it like the wrapped model; ``nnx.grad`` / ``nnx.value_and_grad`` and ``nnx.Optimizer``
    see the same parameters (``model.layers``). Batch statistics and RNG counters are updated
    once per call, as without remat. Profiled and planned on the first call with concrete shapes
    (also under ``nnx.jit``), re-profiled when input shapes change.
    """

    def __init__(self, model: Any, budget: Any, *, algorithm: str = "optimal", profile: str = "measure",
                 slots: int = 500, calibrate: bool = False):
        if isinstance(model, nnx.Sequential):
            layers = list(model.layers)
        elif isinstance(model, (list, tuple)) and model:
            layers = list(model)
        else:
            raise ValueError(
                f"remat_nnx expects an nnx.Sequential or a non-empty list of NNX modules, got {type(model).__name__}"
            )
        Chain.from_nnx(layers)  # checks the layers now
        self.layers = nnx.List(layers)
        self.planner = _Planner(budget, algorithm, profile, slots, calibrate)

    def chain(self) -> tuple[Chain, list]:
        """The chain of the layers as they are now, with their per-stage variables."""
        chain = Chain.from_nnx(list(self.layers))
        return chain, [st.init(None, None) if st.init is not None else {} for st in chain.stages]

    def plan(self, x: Any) -> Plan:
        """The plan used for inputs shaped like ``x`` (made on first use)."""
        chain, variables = self.chain()
        return self.planner.get(chain, variables, x)

    def __call__(self, x: Any) -> Any:
        chain, variables = self.chain()
        p = self.planner.get(chain, variables, x)
        out, updates = execute(chain, p.schedule)(variables, x)
        for i, new in updates.items():
            layer = self.layers[i]
            if isinstance(layer, nnx.Module) and "rest" in new:
                nnx.update(layer, new["rest"])
        return out


def remat_nnx(budget: Any, **options: Any):
    """Wrap an ``nnx.Sequential`` (or a list of NNX modules) to train under ``budget``:
    ``model = jaxremat.remat_nnx("40%")(nnx.Sequential(...))``. Options as for
    :func:`jaxremat.remat_chain`: ``algorithm``, ``profile``, ``slots``, ``calibrate``."""

    def wrap(model: Any) -> RematSequential:
        return RematSequential(model, budget, **options)

    return wrap
