"""``remat_chain(budget)``: a Flax linen sequence that trains under a memory budget."""

from __future__ import annotations

from typing import Any

import jax

from jaxremat.chain import Chain
from jaxremat.costs import ChainCosts
from jaxremat.executor import execute
from jaxremat.plans import Plan, plan, signature
from jaxremat.profiler import profile
from jaxremat.solvers.periodic import MAX_PERIOD


class RematChain:
    """A linen ``nn.Sequential`` (or list of modules) whose gradient follows a planned schedule.

    ``init`` and ``apply`` behave as on the plain model (same variable tree), so optax training
    loops need no change. The model is profiled and planned on the first ``apply`` with concrete
    shapes (also under ``jax.jit``: profiling needs only shapes), re-planned without profiling
    when the budget changes (:meth:`with_budget`), and re-profiled when input shapes change.
    """

    def __init__(
        self,
        model: Any,
        budget: Any,
        *,
        algorithm: str = "optimal",
        profile: str = "measure",
        slots: int = 500,
        calibrate: bool = False,
        mutable: tuple[str, ...] = (),
        rng_streams: tuple[str, ...] = (),
        plan: Plan | None = None,
        max_period: int = MAX_PERIOD,
    ):
        self.model = model
        self.chain = Chain.from_linen(model, mutable=mutable, rng_streams=rng_streams)
        self.budget, self.algorithm, self.method, self.slots = budget, algorithm, profile, slots
        self.calibrate, self.max_period = calibrate, max_period
        self._costs: dict[str, ChainCosts] = {}  # by signature
        self._plans: dict[str, Plan] = {}
        if plan is not None:
            self._plans[plan.signature] = plan

    def with_budget(self, budget: Any) -> "RematChain":
        """The same model under another budget; profiles already made are reused."""
        other = RematChain.__new__(RematChain)
        other.__dict__.update(self.__dict__)
        other.budget, other._plans = budget, {}
        return other

    def init(self, rng: Any, x: Any, **kwargs: Any) -> Any:
        if self.chain.sequential:
            return self.model.init(rng, x, **kwargs)
        return self.chain.init(rng, x)

    def plan(self, variables: Any, x: Any) -> Plan:
        """The plan ``apply`` uses for these variables and input shape (made on first use)."""
        key = signature(self.chain, variables, x)
        if key not in self._plans:
            with jax.ensure_compile_time_eval():  # may run while the caller's step is traced
                self._make_plan(key, variables, x)
        return self._plans[key]

    def _make_plan(self, key: str, variables: Any, x: Any) -> None:
        if key not in self._costs:  # same shapes, new budget: solve again, no profiling
            self._costs[key] = profile(self.chain, variables, x, method=self.method, quiet=True)
        self._plans[key] = plan(
            self.chain, variables, x, self.budget, algorithm=self.algorithm, slots=self.slots,
            costs=self._costs[key], calibrate=self.calibrate, max_period=self.max_period,
        )

    def apply(self, variables: Any, x: Any, rngs: dict | None = None, mutable: Any = False) -> Any:
        """As ``model.apply``: the output, or ``(output, updated collections)`` when ``mutable``."""
        p = self.plan(variables, x)
        out, updates = execute(self.chain, p.schedule)(variables, x, rngs)
        if not mutable:
            return out
        per_stage = [updates.get(i, {}) for i in range(len(self.chain))]
        merged = self.chain.merge(per_stage)
        return out, merged if self.chain.sequential else per_stage

    __call__ = apply


def remat_chain(budget: Any, **options: Any):
    """Wrap a linen ``nn.Sequential`` (or a list of modules) to train under ``budget``.

    Use on an instance, ``remat_chain("40%")(model)``, or as a class decorator on a module class
    whose instances are ``nn.Sequential`` (``@remat_chain("40%") class Net(nn.Sequential): ...``),
    in which case calling the class returns the wrapped instance. Options: ``algorithm``,
    ``profile`` ("measure" or "xla"), ``slots``, ``calibrate`` (correct the plan with XLA's
    measured memory, see :func:`jaxremat.plan`), ``mutable``, ``rng_streams``, ``plan``,
    ``max_period`` (the longest pattern repeated over a :class:`~jaxremat.Repeat` layer; 1 keeps
    to loops that compile one block body, see :func:`jaxremat.plan`).
    """

    def wrap(model: Any) -> Any:
        if isinstance(model, type):
            cls = model

            def make(*args: Any, **kwargs: Any) -> RematChain:
                return RematChain(cls(*args, **kwargs), budget, **options)

            make.__name__ = cls.__name__
            make.__doc__ = cls.__doc__
            return make
        return RematChain(model, budget, **options)

    return wrap
