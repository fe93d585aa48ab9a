"""Calibrated planning: solve, let XLA measure the compiled step, correct the budget, repeat.

The cost model predicts XLA's memory closely but not exactly (fusion keeps a little less than a
stage's profiled residuals, some blocks keep a little more). :func:`calibrated_solve` closes the
gap with XLA in the loop: it solves for a working budget, compiles the training step under the
schedule, and moves the working budget by the measured error (down by any excess, up by any
slack) until the measured peak is within a hair of the budget. It returns the fastest schedule
(by predicted time) whose *measured* peak fits, so the memory promised is the memory XLA uses.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxremat.core.budgets import Budget, parse_budget, store_all_peak
from jaxremat.core.compile import as_planned, compiler_options
from jaxremat.core.costs import ChainCosts
from jaxremat.core.schedule import InfeasibleBudget, Schedule
from jaxremat.model.chain import Chain
from jaxremat.run.executor import execute
from jaxremat.solvers import min_budget, solve


def measured_loss(out: Any) -> jax.Array:
    """The loss of the step jaxremat measures (:func:`training_step`): the mean square of every
    leaf of the chain's output. Profile with ``loss=measured_loss`` to plan for that step."""
    return sum(jnp.mean(jnp.square(leaf.astype(jnp.float32))) for leaf in jax.tree.leaves(out))


def training_step(
    forward: Callable[[list, Any], Any], per_stage: list
) -> Callable[[list, Any], tuple[jax.Array, list]]:
    """``step(params, x) -> (loss, grads)`` for a forward over per-stage variables; the loss is the
    mean square of the output (memory and time depend on what is kept, not on the loss)."""
    rest = [{k: v for k, v in u.items() if k != "params"} for u in per_stage]

    def step(params: list, x: Any) -> tuple[jax.Array, list]:
        def loss(params: list) -> jax.Array:
            return measured_loss(forward([{**r, "params": p} for r, p in zip(rest, params)], x))

        return jax.value_and_grad(loss)(params)

    return step


def measured_optimizer() -> optax.GradientTransformation:
    """The optimizer of the step jaxremat measures: Adam (its state is two copies of the parameters)."""
    return optax.adam(1e-3)


def update_step(
    forward: Callable[[list, Any], Any], per_stage: list, optimizer: optax.GradientTransformation | None = None
) -> Callable[[list, Any, Any], tuple[jax.Array, list, Any]]:
    """``step(params, opt_state, x) -> (loss, params, opt_state)``: the step users run, the
    gradients of :func:`training_step` consumed by an optimizer update (Adam by default).

    This is the step whose memory a plan promises. Compiled with the parameters and the optimizer
    state donated (:func:`compile_step`), the gradients are not outputs, so XLA cannot park
    activations in their buffers as it does in a step that returns them (a 12-block GPT's
    gradient-returning step measured 0.80-0.93x its plan, this step 1.01-1.03x).
    """
    opt = optimizer or measured_optimizer()
    grads_of = training_step(forward, per_stage)

    def step(params: list, state: Any, x: Any) -> tuple[jax.Array, list, Any]:
        loss, grads = grads_of(params, x)
        updates, state = opt.update(grads, state, params)
        return loss, optax.apply_updates(params, updates), state

    return step


def compile_step(
    forward: Callable[[list, Any], Any],
    per_stage: list,
    params: list,
    x: Any,
    optimizer: optax.GradientTransformation | None = None,
) -> Any:
    """The :func:`update_step` of ``forward``, compiled from shapes with the parameters and
    optimizer state donated and with :func:`~jaxremat.compiler_options` (real remat on the CPU).
    Call it as ``loss, params, state = compiled(params, state, x)`` with ``state`` from
    ``optimizer.init(params)`` (:func:`measured_optimizer` by default)."""
    opt = optimizer or measured_optimizer()
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), (params, x))
    state = jax.eval_shape(opt.init, shapes[0])
    step = as_planned(update_step(forward, per_stage, opt))
    return jax.jit(step, donate_argnums=(0, 1)).lower(shapes[0], state, shapes[1]).compile(compiler_options() or None)


def step_temp(chain: Chain, variables: Any, x: Any, schedule: Schedule, policies: Any = None) -> int:
    """XLA's ``temp_size_in_bytes`` of the update step of ``chain`` that follows ``schedule``
    (:func:`update_step`; compiled from shapes alone, so ``variables`` and ``x`` may be tracers)."""
    return int(compile_schedule_step(chain, variables, x, schedule, policies).memory_analysis().temp_size_in_bytes)


def compile_schedule_step(chain: Chain, variables: Any, x: Any, schedule: Schedule, policies: Any = None) -> Any:
    """The compiled update step of ``chain`` following ``schedule`` (:func:`compile_step`, from
    shapes alone), over the model's own variables (a Repeat's stacked, as the model keeps them)."""
    f = execute(chain, schedule, policies=policies)
    per_layer = chain.layer_variables(variables)
    rest = [{k: v for k, v in u.items() if k != "params"} for u in per_layer]

    def forward(params: list, rest_and_x: tuple[list, Any]) -> Any:
        # the other collections (batch statistics) travel with the input, so that nothing of
        # ``variables`` (maybe tracers) is closed over; the keys are made inside the step
        rest, a = rest_and_x
        rngs = {s: jax.random.key(1) for st in chain.stages for s in st.rng_streams} or None
        return f(chain.from_layer_variables([{**r, **p} for r, p in zip(rest, params)]), a, rngs)[0]

    return compile_step(forward, [{} for _ in per_layer], [u.get("params", {}) for u in per_layer], (rest, x))


@dataclass(frozen=True)
class Calibrated:
    """The result of :func:`calibrated_solve`: the schedule, its XLA-measured peak (input
    included, like the plan's), and every (working budget, predicted, measured) tried."""

    schedule: Schedule
    measured_peak: int
    tries: tuple[tuple[int, int, int], ...]


def calibrated_solve(
    costs: ChainCosts,
    budget: Budget,
    measure: Callable[[Schedule], int],
    *,
    algorithm: str = "optimal",
    slots: int = 500,
    tries: int = 6,
    tolerance: float = 0.01,
    tie: float = 0.0,
    start: Schedule | None = None,
) -> Calibrated:
    """The fastest schedule whose measured peak fits ``budget``.

    ``measure(schedule)`` returns XLA's temp bytes of the step under the schedule (e.g.
    ``functools.partial(step_temp, chain, variables, x)``); the input ``a_0`` is added, as the plan
    counts it. ``start``: the schedule to measure first, as solved for ``budget`` (the plan, the
    leanest within the tie of the fastest: solved again, the budget gives the fastest, which keeps
    more and was one more compile). At most ``tries`` compilations; stops early once a schedule's
    measured peak is within ``tolerance`` of the budget, or once the fastest that fits is within
    ``tie`` (verification's: :data:`~jaxremat.solvers.lean.LEAN_TIE`) of the predicted time of the
    schedule measured over it at the least working budget: a schedule solved between the two is no
    faster than that one, so it could not win by more than the tie (a linen CNN at 75%, fitting at
    0.97 of the budget within 0.8% of the flops of the plan over it, compiled two more schedules
    that both measured over, 2026-12-06); and once a schedule at the least predicted peak measures
    over by more than that peak's distance to the budget (no schedule is predicted less, so none
    corrected by the same excess fits). Raises :class:`InfeasibleBudget` when no schedule tried
    fits.
    """
    target = parse_budget(budget, costs)
    x0 = int(costs.x[0])
    least = min_budget(costs, algorithm=algorithm, slots=slots)
    ceiling = max(store_all_peak(costs), target) * 4  # no schedule changes above the store-all peak
    seen: set[tuple] = set()  # op lists already measured
    log: list[tuple[int, int, int]] = []
    best: tuple[Schedule, int] | None = None
    fits, over = least - 1, ceiling + 1  # working budgets known to fit (measured) and to be over
    over_time = 0.0  # the predicted time of the schedule solved at ``over``
    work = max(target, least)
    sched = start if start is not None and work == target else solve(costs, work, algorithm=algorithm, slots=slots)
    for _ in range(tries):
        seen.add(tuple(sched.ops))
        got = measure(sched) + x0
        log.append((work, sched.peak, got))
        if got <= target:
            if best is None or sched.time < best[0].time:
                best = (sched, got)
            if got >= target * (1 - tolerance):
                break
            fits = max(fits, work)
        elif work < over:
            over, over_time = work, sched.time
        if best is not None and best[0].time <= over_time * (1 + tie):
            break
        # measured = predicted + XLA's excess: the next working budget is the schedule's predicted
        # peak corrected by it, not the working budget it was solved for (a plan kept lean peaks
        # well below its budget: a linen CNN's at 11.07 of 12.43 MiB measured 13.09, and the budget
        # corrected, 11.77, gave a schedule of 11.57 that measured over again, 2026-12-06)
        proposal = sched.peak + (target - got)
        if proposal < least and sched.peak <= least:
            # the least-memory schedule measured over by more than any schedule's prediction can
            # give back: every schedule left is predicted at least as much, so corrected by the same
            # excess none fits (a linen CNN at 50%, its plan at the least 9.07 MiB measured 11.09
            # over 9.29; another schedule of 9.07 compiled at 13.63, 2.6 s for nothing, 2026-12-06)
            break
        step = _next_budget(costs, work, proposal, fits, over, seen, algorithm, slots)
        if step is None:
            break
        work, sched = step
    if best is None:
        raise InfeasibleBudget(
            algorithm,
            target,
            min(g for _, _, g in log) if log else least,
            note="measured by XLA: the least-memory schedule tried compiles to this much",
        )
    return Calibrated(best[0], best[1], tuple(log))


def _next_budget(
    costs: ChainCosts, base: int, proposal: int, fits: int, over: int, seen: set, algorithm: str, slots: int
) -> tuple[int, Schedule] | None:
    """A working budget strictly between ``fits`` and ``over`` whose schedule was not measured
    yet, with that schedule: ``proposal`` (the last budget ``base`` corrected by the measured
    error) if it qualifies, else stepping on in the same direction by doubling steps, else
    the midpoints between ``fits`` and ``over`` (the upper halves first); ``None`` when there
    is none.

    The midpoints: a 12-layer loop MLP at the measured memory of ``dots_saveable`` on every
    layer planned every stage under it, which XLA packed one activation over (1 MiB of 25);
    the correction, a budget 1 MiB lower, gave a schedule 2 MiB under, and the step up from it
    met the first schedule again. The schedule 1 MiB under, between the two, measured within
    the budget with 2.6% fewer flops than the correction's."""
    lo, hi = fits + 1, over - 1
    if lo > hi:
        return None
    up = proposal >= base
    step = max(abs(proposal - base), 1)
    work = proposal
    for _ in range(40):  # solving is cheap next to compiling
        work = min(max(work, lo), hi)
        sched = solve(costs, work, algorithm=algorithm, slots=slots)
        if tuple(sched.ops) not in seen:
            return work, sched
        if (up and work == hi) or (not up and work == lo):
            break
        work, step = work + step if up else work - step, step * 2
    spans = [(lo, hi)]
    for _ in range(31):
        if not spans:
            break
        a, b = spans.pop(0)
        if a > b:
            continue
        mid = (a + b) // 2
        sched = solve(costs, mid, algorithm=algorithm, slots=slots)
        if tuple(sched.ops) not in seen:
            return mid, sched
        spans += [(mid + 1, b), (a, mid - 1)]
    return None


#: How far below its prediction a loop schedule was seen to measure: candidates predicted above
#: the budget by more are not compiled (:func:`calibrated_pick`'s ``optimistic``).
LOOP_OPTIMISM = 0.85


def calibrated_pick(
    candidates: Sequence[Schedule],
    budget: int,
    measure: Callable[[Schedule], int],
    *,
    optimistic: Callable[[Schedule], int],
    tries: int = 6,
) -> Calibrated | None:
    """The fastest of ``candidates`` (sorted fastest first) whose measured peak fits ``budget``.

    Candidates whose ``optimistic(schedule)`` peak is above the budget are skipped unmeasured;
    at most ``tries`` are compiled (``measure`` as in :func:`calibrated_solve`, ``a_0`` added).
    ``None`` when none of those tried fits.
    """
    log: list[tuple[int, int, int]] = []
    for sched in candidates:
        if len(log) >= tries:
            break
        if optimistic(sched) > budget:
            continue
        got = measure(sched) + int(sched.costs.x[0])
        log.append((budget, sched.peak, got))
        if got <= budget:
            chosen = dataclasses.replace(sched, budget=budget)
            return Calibrated(chosen, got, tuple(log))
    return None
