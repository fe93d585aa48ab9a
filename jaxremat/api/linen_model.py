"""``remat_chain(budget)``: a Flax linen sequence that trains under a memory budget."""

from __future__ import annotations

from typing import Any, Callable, Sequence, TypeVar, overload

from jaxremat.api.planner import Planner, plan_options
from jaxremat.api.plans import Plan
from jaxremat.api.scanned_chains import ScannedChain
from jaxremat.core.budgets import Budget, check_budget
from jaxremat.model.chain import Chain
from jaxremat.model.stage import Rngs
from jaxremat.run.executor import execute


class RematChain:
    """A linen ``nn.Sequential`` (or list of modules) whose gradient follows a planned schedule.

    ``init`` and ``apply`` behave as on the plain model (same variable tree), so optax training
    loops need no change. The model is profiled and planned on the first ``apply`` with concrete
    shapes (also under ``jax.jit``: profiling needs only shapes), re-planned without profiling
    when the budget changes (:meth:`with_budget`), and re-profiled when input shapes change.

    Options (keyword-only): ``algorithm``, ``method`` (``"measure"`` or ``"xla"``), ``slots``,
    ``calibrate``, ``max_period``, ``policies`` (see :class:`~jaxremat.api.plans.PlanOptions`), ``mutable`` and
    ``rng_streams`` (collections the stages update and RNG streams they draw from), ``plan`` (a
    :class:`~jaxremat.Plan` to use, e.g. from :func:`~jaxremat.load_plan`).
    """

    def __init__(
        self,
        model: Any,
        budget: Budget,
        *,
        mutable: Sequence[str] = (),
        rng_streams: Sequence[str] = (),
        plan: Plan | None = None,
        **options: Any,
    ):
        self.model = model
        self.chain = Chain.from_linen(model, mutable=tuple(mutable), rng_streams=tuple(rng_streams))
        self.planner = Planner(budget, plan_options(**options))
        self.scanned = ScannedChain(self.chain, budget, self.planner.options)
        if plan is not None:
            self.planner.add(plan)

    @property
    def budget(self) -> Budget:
        return self.planner.budget

    def with_budget(self, budget: Budget) -> "RematChain":
        """The same model under another budget; profiles already made are reused."""
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        other.planner = self.planner.with_budget(budget)
        other.scanned = self.scanned.with_budget(budget)
        return other

    def init(self, rng: Any, x: Any, **kwargs: Any) -> Any:
        """The plain model's variables (``model.init``)."""
        if self.chain.sequential:
            return self.model.init(rng, x, **kwargs)
        return self.chain.init(rng, x)

    def plan(self, variables: Any, sample: Any, rngs: Rngs = None) -> Plan:
        """The plan ``apply`` uses for these variables and input shape (made on first use). Where
        a module runs a scan over stacked layers (``nn.scan``), the chain is planned from its
        jaxpr as :func:`jaxremat.remat` plans it, the scan's layers stages of their own
        (:mod:`jaxremat.api.scanned_chains`); ``rngs`` as ``apply`` gets them."""
        if self.scanned.holds_stack(variables, sample, rngs):
            return self.scanned.plan(variables, sample, rngs)
        return self.planner.plan(self.chain, variables, sample)

    def apply(self, variables: Any, x: Any, rngs: Rngs = None, mutable: Any = False) -> Any:
        """As ``model.apply``: the output, or ``(output, updated collections)`` when ``mutable``."""
        if self.scanned.holds_stack(variables, x, rngs):
            out, updates = self.scanned(variables, x, rngs)
        else:
            p = self.planner.plan(self.chain, variables, x)
            run = execute(self.chain, p.schedule, policies=self.planner.options.named_policies)
            out, updates = run(variables, x, rngs)
        if not mutable:
            return out
        per_stage = [updates.get(i, {}) for i in range(len(self.chain))]
        return out, self.chain.merge(per_stage) if self.chain.sequential else per_stage

    __call__ = apply


M = TypeVar("M")


@overload
def remat_chain(budget: Budget, **options: Any) -> Callable[[type], type[RematChain]]: ...
@overload
def remat_chain(budget: Budget, **options: Any) -> Callable[[Any], RematChain]: ...


def remat_chain(budget: Budget, **options: Any) -> Callable[[Any], Any]:
    """Wrap a linen ``nn.Sequential`` (or a list of modules) to train under ``budget``.

    On an instance, ``remat_chain("40%")(model)`` returns a :class:`RematChain`. As a class
    decorator on an ``nn.Sequential`` subclass (``@remat_chain("40%") class Net(nn.Sequential)``)
    it returns a class: a subclass of :class:`RematChain` whose constructor takes the decorated
    class's arguments (``Net(layers=[...])``) and wraps the module they make; the module class
    itself is ``Net.__wrapped__``. Options as for :class:`RematChain`.
    """
    plan_options(**{k: v for k, v in options.items() if k not in ("mutable", "rng_streams", "plan")})  # fail now
    check_budget(budget)

    def wrap(model: Any) -> Any:
        if isinstance(model, type):
            cls = model

            def __init__(self: RematChain, *args: Any, **kwargs: Any) -> None:
                RematChain.__init__(self, cls(*args, **kwargs), budget, **options)

            return type(
                cls.__name__,
                (RematChain,),
                {
                    "__init__": __init__,
                    "__doc__": cls.__doc__,
                    "__module__": cls.__module__,
                    "__qualname__": cls.__qualname__,
                    "__wrapped__": cls,
                },
            )
        return RematChain(model, budget, **options)

    return wrap


__all__ = ["RematChain", "remat_chain"]
