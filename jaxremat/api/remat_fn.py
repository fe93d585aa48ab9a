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
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxremat.api import _loop_plans, device_budget, plan_cache
from jaxremat.api.planner import UNSET, plan_options, warn_if_global
from jaxremat.api.plans import Plan, PlanOptions, SetupTime, make_plan, option_names, signature
from jaxremat.api._cut_report import describe_cuts
from jaxremat.api.user_blocks import user_blocks
from jaxremat.api.verify import Measured, verify
from jaxremat.api.verify_step import step_measure
from jaxremat.core.budgets import Budget, check_budget
from jaxremat.core.costs import ChainCosts, Shared
from jaxremat.core.device import Device
from jaxremat.core.schedule import InfeasibleBudget, Schedule
from jaxremat.solvers import OFFLOAD_ALGORITHMS, canonical
from jaxremat.solvers.lean import leanest
from jaxremat.model.identity import leaf_signature
from jaxremat.model.jaxpr_chain import MAX_STAGES, USER_REMAT, JaxprChain, trace
from jaxremat.model.trees import abstract, is_sharded, sharding_key, sharding_of
from jaxremat.profiling.profiler import profile
from jaxremat.profiling.progress import progress
from jaxremat.run.executor import execute

#: Keywords of :func:`jaxremat.profile` that ``remat`` passes on.
PROFILE_KEYWORDS = ("rates", "repeats", "cache", "quiet")


def is_dynamic(leaf: Any) -> bool:
    """Whether an input leaf is traced into the jaxpr (an array, a NumPy scalar or a traced
    value); anything else (a Python number, a bool, a callable, a string) is static and passed
    to the function as it is, as ``equinox.filter_jit`` does."""
    return hasattr(leaf, "shape") and hasattr(leaf, "dtype")


@dataclasses.dataclass
class _Prepared:
    """One input signature's traced chain, its plan, and the trees to rebuild outputs."""

    traced: JaxprChain
    plan: Plan
    in_tree: Any
    out_tree: Any
    dynamic: tuple[int, ...]  # positions of the leaves traced into the jaxpr


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
    fit = {
        i: min(1.0, min(costs.option(i, k).xbar for k in range(costs.option_count(i))) / b)
        for i, b in made.items()
        if b
    }
    shared = [Shared(f, last, int(b * fit.get(f - 1, 1.0)), name) for f, last, b, name in sized]
    return dataclasses.replace(costs, shared=tuple(v for v in shared if v.nbytes))


class RematFunction:
    """``fun`` whose gradient follows an optimal schedule within ``budget`` (see :func:`remat`)."""

    def __init__(
        self,
        fun: Callable,
        budget: Budget,
        stages: Any,
        max_stages: int,
        options: PlanOptions,
        costs: dict[str, ChainCosts] | None = None,
        measured: dict[str, dict] | None = None,
        user_remat: str = "replace",
    ):
        if not callable(fun):
            raise TypeError(f"jaxremat.remat needs a function, got {type(fun).__name__}")
        self.fun, self.stages, self.max_stages, self.options = fun, stages, max_stages, options
        self.user_remat = user_remat
        self.budget = budget if isinstance(budget, Device) else check_budget(budget)
        self._costs: dict[str, ChainCosts] = {} if costs is None else costs  # shared with with_budget
        # the schedules verification compiled, by signature: shared with with_budget too, so that a
        # budget is met by a schedule measured for another (verify's ``earlier``)
        self._measured: dict[str, dict] = {} if measured is None else measured
        self._prepared: dict[str, _Prepared] = {}
        functools.update_wrapper(self, fun)

    def with_budget(self, budget: Budget) -> "RematFunction":
        """The same function planned for ``budget``, sharing this one's profiles."""
        return RematFunction(
            self.fun, budget, self.stages, self.max_stages, self.options, self._costs, self._measured, self.user_remat
        )

    def _prepare(self, args: tuple) -> _Prepared:
        leaves, tree = jax.tree.flatten(args)
        dynamic = tuple(n for n, leaf in enumerate(leaves) if is_dynamic(leaf))
        static = {n: leaf for n, leaf in enumerate(leaves) if n not in dynamic}
        # per device or global: the layout is part of what is planned
        layout = [sharding_key(sharding_of(leaves[n])) for n in dynamic]
        key = json.dumps(
            [
                leaf_signature([leaves[n] for n in dynamic]),
                dynamic,
                str(tree),
                str(self.stages),
                repr(sorted(static.items())),
                layout,
            ]
        )
        if key in self._prepared:
            return self._prepared[key]
        warn_if_global(args, budget=self.budget)

        def fun(*dyn: Any) -> Any:  # the function of the traced leaves, the static ones fixed
            full = [static[n] if n in static else None for n in range(len(leaves))]
            for n, v in zip(dynamic, dyn):
                full[n] = v
            return self.fun(*jax.tree.unflatten(tree, full))

        t0 = time.perf_counter()
        # traced as the user's step traces it, not under ensure_compile_time_eval: its eager
        # evaluation turns every array made from constants alone (a dropout's zeros_like, a causal
        # mask) into a concrete constant of the jaxpr, an input of the step held from its start to
        # its end instead of a broadcast XLA fuses into its reader (a linen CNN's four dropout
        # zeros kept 1.5 MiB more than the user's step, CPU, 2026-12-05). Nor the verification:
        # it changed the compiled program too (an NNX step, 16 KiB). The profile's timing runs
        # programs on concrete arrays, so it runs in that context.
        dyn = tuple(leaves[n] for n in dynamic)
        closed, in_tree, out_tree = trace(fun, dyn)
        flat = [abstract(x) for x in dyn]
        if not any(jnp.issubdtype(s.dtype, jnp.inexact) for s in flat):
            raise TypeError(
                "jaxremat.remat: the function has no input that can carry a gradient (no float arrays); "
                "remat plans what a gradient keeps, so give it the parameters or data to differentiate"
            )
        # the first argument's traced leaves: what the training step (and the verification)
        # differentiates; the profile leaves the other inputs' gradients out, as the step does
        first = sum(1 for n in dynamic if n < len(jax.tree.leaves(args[0]))) if args else 0
        traced = JaxprChain.of(closed, self.stages, self.max_stages, differentiated=first, user_remat=self.user_remat)
        variables = traced.variable_shapes(flat)
        t1 = time.perf_counter()
        cut = (self.stages, self.max_stages, self.user_remat)
        kept = plan_cache.plan_key(closed, key, self.budget, self.options, cut)
        use_disk = plan_cache.enabled(self.options)
        cached = plan_cache.load(kept) if use_disk else None
        sig = signature(traced.chain, variables, ()) if use_disk else None  # what a kept entry is checked by
        if isinstance(cached, plan_cache.Refusal) and cached.signature == sig:
            raise cached.error
        if isinstance(cached, Plan) and cached.signature == sig:
            setup = SetupTime(t1 - t0, 0.0, 0.0, 0.0, cached=True)
            found = _Prepared(traced, dataclasses.replace(cached, setup=setup), in_tree, out_tree, dynamic)
            self._prepared[key] = found
            return found
        costs = self._costs.get(key)
        if costs is None:
            with jax.ensure_compile_time_eval():
                costs = profile(
                    traced.chain,
                    variables,
                    (),
                    method=self.options.method,
                    policies=self.options.policies,
                    **self.options.profile_options,
                )
            x = np.array(costs.x)
            x[0] = traced.context_bytes  # held for the whole step, as a_0 is
            costs = with_shared(dataclasses.replace(costs, x=x), traced)
            self._costs[key] = costs
        t2 = time.perf_counter()
        device = self.budget if isinstance(self.budget, Device) else None
        # a device budget: the temporaries get what the step's arguments and outputs leave, as the
        # shapes say, then as XLA's analysis of the verified step says where it holds more
        held = device_budget.held_bytes(flat, first, device.optimizer) if device else 0
        # the schedules compiled for other budgets were measured with this optimizer's state
        earlier = self._measured.setdefault(key, {}) if not device or device.optimizer is None else {}
        for _ in range(2 if device else 1):
            budget = device_budget.temp_budget(device, held) if device else self.budget
            measured_held: list[int] = []
            try:
                plan, t3 = self._solved(traced, costs, variables, budget), time.perf_counter()
                plan = self._verified(plan, traced, costs, variables, flat, first, earlier, measured_held)
            except InfeasibleBudget as e:
                if device:
                    raise device_budget.refusal(e, device, held) from None
                if use_disk:
                    plan_cache.store(kept, plan_cache.Refusal(sig, e))
                raise
            if not device or max(measured_held, default=0) <= held:
                break
            held = max(measured_held)
        if device:
            asked = device_budget.describe(device, held)
            plan = dataclasses.replace(plan, schedule=dataclasses.replace(plan.schedule, asked=asked))
        setup = SetupTime(t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3)
        note = describe_cuts(traced, len(static))
        sched = plan.schedule
        plan = dataclasses.replace(
            plan, schedule=dataclasses.replace(sched, note=f"{sched.note}; {note}" if sched.note else note), setup=setup
        )
        if use_disk:
            plan_cache.store(kept, plan)
        found = _Prepared(traced, plan, in_tree, out_tree, dynamic)
        self._prepared[key] = found
        return found

    def _solved(self, traced: JaxprChain, costs: ChainCosts, variables: list, budget: Any) -> Plan:
        """The plan for ``budget`` (bytes, or as the user wrote it), not yet verified: of the
        schedules within :data:`~jaxremat.solvers.lean.LEAN_TIE` of the fastest, the leanest
        (verification ranks what it compiles alike)."""
        try:
            plan = make_plan(traced.chain, variables, (), budget, self.options, costs, verified=False)
            if budget is None or traced.chain.stacked or canonical(self.options.algorithm) != "optimal":
                return plan
            lean = leanest(plan.costs, plan.schedule, slots=self.options.slots)
            return dataclasses.replace(plan, schedule=lean)
        except InfeasibleBudget:
            if not traced.chain.stacked or self.options.verify is False:
                raise
            # a layer stack's loop memory is predicted pessimistically: below the predicted least,
            # its least loop schedule is compiled, and verification decides (a 24-layer decoder's
            # least was predicted at 37.1 MiB, measured at 34.5, below the hand "full" policy's 35.1)
            least = _loop_plans.least_loop_plan(traced.chain, variables, costs, budget, self.options.max_period)
            return Plan(least, signature(traced.chain, variables, ()))

    def _verified(
        self,
        plan: Plan,
        traced: JaxprChain,
        profiled: ChainCosts,
        variables: list,
        flat: list,
        first: int,
        earlier: dict,
        held: list[int],
    ) -> Plan:
        """``plan`` checked by XLA (:func:`~jaxremat.api.verify.verify`), corrected if over;
        ``earlier``: the schedules compiled for this signature at other budgets; ``held`` gets
        what each compiled step holds in arguments and outputs."""
        o = self.options
        if o.verify is False or canonical(o.algorithm) in OFFLOAD_ALGORITHMS:
            return plan
        if jax.device_count() > 1 and not is_sharded(flat):
            # a plan for global shapes on several devices (shardings not visible): nothing to
            # compile that is the step's per-device program
            return plan
        costs = plan.costs
        target = None if self.budget is None else plan.schedule.budget
        chain = traced.chain
        # a chain with layer stacks: corrections among the schedules that run each as a loop, no
        # hand strategy (the per-layer ones are among them; compiled flops count a loop's body once)
        # (from the profile's costs: a loop plan's own hold its loops' transients already)
        loops = _loop_plans.loop_candidates(chain, variables, profiled, o.max_period) if chain.stacked else None
        optimizer = self.budget.optimizer if isinstance(self.budget, Device) else None
        compile_step = step_measure(traced, flat, first, o.named_policies, optimizer)
        with progress(None, "verifying the plan", bool(o.profile_options.get("quiet"))) as advance:
            count = iter(range(1, 1000))

            def measure(schedule: Schedule) -> Measured:
                measured = compile_step(schedule)
                held.append(measured.held)
                advance(f"the step compiled under {next(count)} schedule(s)")
                return measured

            sched, found = verify(
                costs,
                target,
                plan.schedule,
                measure,
                algorithm=o.algorithm,
                slots=o.slots,
                compare_hand=loops is None,
                blocks=user_blocks(chain, traced.cuts, costs),
                earlier=earlier,
                candidates=loops,
            )
        return Plan(sched, plan.signature, found)

    def plan(self, *args: Any) -> Plan:
        """The plan for inputs shaped like ``args`` (made now if needed)."""
        return self._prepare(args).plan

    def __call__(self, *args: Any) -> Any:
        prepared = self._prepare(args)
        leaves = jax.tree.leaves(args)
        variables = prepared.traced.variables([leaves[n] for n in prepared.dynamic])
        forward = execute(prepared.traced.chain, prepared.plan.schedule, policies=self.options.named_policies)
        out, _ = forward(variables, ())
        return jax.tree.unflatten(prepared.out_tree, list(out))


def remat(
    fun: Any = None,
    budget: Budget = UNSET,
    *,
    stages: Any = "auto",
    max_stages: int = MAX_STAGES,
    user_remat: str = "replace",
    **options: Any,
) -> Any:
    """``fun`` with an optimal rematerialisation schedule within ``budget``.

    Args:
      fun: any JAX function (``loss(params, batch)``, a model's apply, ...). With the budget as
        the only argument (``@jaxremat.remat("50%")``) or ``fun`` left out, a decorator.
      budget: bytes, ``"512MiB"``, a share of the store-all peak (``"40%"``), or ``None`` for
        the store-all peak: what the step's temporaries (activations, gradients) may use. Or
        :class:`jaxremat.Device` (``Device("16GiB")``, ``Device("device")`` on a GPU): the whole
        step, its parameters, optimizer state and inputs included, on that device.
      stages: how ``fun``'s equations are cut into stages: ``"auto"`` (the Flax module-scope
        depth with the most stages up to ``max_stages``, else ``checkpoint_name`` markers, else
        cuts before matmuls and convolutions where the fewest bytes cross), an int (a module
        depth), ``"names"``, ``"bytes"`` or a regex over module paths (``r"blocks_\\d+"``). A
        scan over stacked layers (``nn.scan``, ``nnx.scan``, ``lax.scan``) is a stage per layer
        whatever it says; its layers are named ``Decoder/layers[3]``, and a pattern may name them.
      user_remat: ``"replace"`` (default): a ``jax.checkpoint`` / ``nn.remat`` around a scanned
        layer is replaced by the plan; ``"keep"``: kept as written, the scan one stage.
      options: ``algorithm``, ``method`` (default ``"flops"``: each program's compiled flops at
        the device's flop rate, no timing runs, as verification ranks schedules; ``"xla"``: the
        roofline; ``"measure"``: wall clock), ``slots``, ``policies``, ``bandwidth``, ``verify`` as for
        :func:`jaxremat.remat_chain`; ``rates``, ``repeats``, ``cache``, ``quiet`` go to
        :func:`jaxremat.profile`. Any other keyword is an error now, not at the first call.

    Verified plans (``verify=True``, the default): before a plan is used, the training step
    under it (the gradient of ``fun``'s first output with respect to the float leaves of its
    first argument, consumed by an optimizer update) is compiled and XLA's temp memory read;
    over the budget, the plan is corrected and solved again until it fits, and the hand
    strategies in the schedule space (every stage checkpointed, every stage under each store
    option, ``sqrt(L)`` segments) that the cost model says may be faster are compiled too, the
    one with the fewest flops that fits kept. :class:`~jaxremat.InfeasibleBudget` names the
    least memory XLA measured when nothing fits. The plan's report gives both peaks, the
    corrections and the seconds it took (usually one to three compiles of the step).

    Input leaves that are not arrays (Python numbers, bools, callables: an equinox module's
    static fields) are passed to ``fun`` as they are, as ``equinox.filter_jit`` does, so
    ``eqx.filter_jit(eqx.filter_grad(jaxremat.remat(loss, b)))`` works. A ``jax.checkpoint`` or
    ``nn.remat`` inside ``fun`` is kept as written, its block a stage of its own (the report
    names it).

    Returns:
      A function with ``fun``'s signature and outputs, planned on its first call for those input
      shapes; ``.plan(*args)`` gives the :class:`~jaxremat.Plan` (its report says how ``fun``
      was cut), ``.with_budget(b)`` plans again without profiling. On the CPU, compile steps
      with :func:`jaxremat.jit`.
    """
    if fun is not None and not callable(fun):  # remat("50%") or remat(None): the budget first
        if budget is not UNSET:
            raise TypeError("jaxremat.remat(fun, budget): the first argument is the function")
        fun, budget = None, fun
    if user_remat not in USER_REMAT:
        kinds = ", ".join(map(repr, USER_REMAT))
        raise ValueError(f"jaxremat.remat: user_remat must be one of {kinds}; got {user_remat!r}")
    if budget is UNSET:
        raise TypeError("jaxremat.remat needs a budget: bytes, '512MiB', '40%', or None for the store-all peak")
    # the loss is the function's own output; it verifies instead of calibrating, and has no
    # Repeat loops whose period to bound
    known = set(option_names()) - {"loss", "calibrate", "max_period"}
    unknown = sorted(set(options) - known - set(PROFILE_KEYWORDS))
    if unknown:
        raise TypeError(
            f"jaxremat.remat: unknown option(s) {', '.join(unknown)}; the options are "
            f"{', '.join(sorted(known))}, "
            f"and for the profiler {', '.join(PROFILE_KEYWORDS)}"
        )
    # the flops time model by default: no timing runs in the first call, the same plan in every
    # process, and the plan ranked as verification ranks what fits, by compiled flops (so that no
    # hand strategy needs compiling only because another time model ranked it below the plan)
    opts = plan_options(
        **{"method": "flops", **{k: v for k, v in options.items() if k in known}},
        profile_options={k: v for k, v in options.items() if k not in known},
    )
    if fun is None:
        return lambda f: RematFunction(f, budget, stages, max_stages, opts, user_remat=user_remat)
    return RematFunction(fun, budget, stages, max_stages, opts, user_remat=user_remat)


__all__ = ["RematFunction", "remat"]
