"""Verified plans: the memory asked is the memory XLA uses, by construction.

A plan is solved on costs assembled from per-stage measurements, and a whole program can meet
what no stage showed alone (XLA schedules nested recomputations side by side, fuses across
stage boundaries). So before a plan is used, :func:`verify` compiles the step under it and
reads XLA's temp memory. Over the budget, the plan is corrected: the working budget moves by the
measured excess and the chain is solved again (:func:`~jaxremat.api.calibrate.calibrated_solve`)
until a schedule measures within the budget, or :class:`~jaxremat.InfeasibleBudget` names the
least memory any schedule tried measured. Then the hand strategies that lie in the same
schedule space (every stage under each store option, every stage or every ``k`` stages
checkpointed, ``sqrt(L)`` segments, the user's blocks checkpointed or under each policy:
:mod:`~jaxremat.api.user_blocks`) and that the profile predicts the plan might be kept for are
compiled too: fewer flops beyond :data:`~jaxremat.solvers.lean.LEAN_TIE`, or as many and less
memory (:func:`~jaxremat.solvers.lean.preferred`, as the plan was chosen); one that measures
within the budget and is preferred so replaces the plan. The plan is never worse than a hand
strategy it could have been, by more than the tie.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, MutableMapping, Sequence


from jaxremat.api.calibrate import LOOP_OPTIMISM, calibrated_pick, calibrated_solve
from jaxremat.core.costs import ChainCosts
from jaxremat.core.ops import Op, OpKind
from jaxremat.core.schedule import Block, InfeasibleBudget, Schedule
from jaxremat.core.simulator import predicted_flops
from jaxremat.core.units import format_bytes
from jaxremat.profiling.parallel import side_by_side, threads
from jaxremat.solvers import baselines
from jaxremat.solvers.lean import LEAN_TIE, preferred

#: Corrections stop at a schedule measured within this share of the budget: each further one is
#: a compile of the step, for a schedule that can use at most this much more memory (a linen
#: CNN's 75% plan fitted at 0.97 of the budget after two corrections, and the two compiles after it
#: found nothing faster that fits, 2026-12-06).
CORRECTED_WITHIN = 0.03
#: At most this many hand strategies are compiled per plan (those predicted to run the fewest flops).
HAND_COMPILES = 2
#: A hand strategy predicted above the budget by more than this factor is not compiled: the
#: cost model overestimates XLA by a few percent, not by more.
HAND_SLACK = 1.25
#: A hand strategy measured at most this many bytes over the budget fits. The user's blocks run
#: by the executor keep a few scalars more than the same blocks in the user's step (an NNX
#: transformer's blocks under ``dots_saveable``: 328-392 bytes of 44.2 MiB, 2026-12-05), so the
#: user's own strategy, asked for at its own measured memory, would otherwise never fit.
HAND_BYTES = 1024


@dataclass(frozen=True)
class Measured:
    """XLA's figures for the step under one schedule: its peak as the plan counts it (XLA's temp
    bytes, plus ``a_0`` where that is an argument of the step) and its compiled flops."""

    peak: int
    flops: float
    # what the step's arguments and outputs hold beyond what donation writes over (parameters,
    # optimizer state, the batch): XLA's argument + output - alias bytes; 0 where not read
    held: int = 0


@dataclass(frozen=True)
class HandCheck:
    """A hand strategy compiled beside the plan."""

    name: str
    predicted_peak: int
    measured_peak: int
    flops: float
    fits: bool


@dataclass(frozen=True)
class Verification:
    """What :func:`verify` found: the chosen schedule's measured peak, how it got there."""

    budget: int
    predicted_peak: int
    measured_peak: int
    flops: float
    corrections: int  # schedules tried after the first measured over the budget
    compiles: int
    seconds: float
    chosen: str  # "plan", "corrected plan" or a hand strategy's name
    hand: tuple[HandCheck, ...] = ()

    def lines(self) -> list[str]:
        ratio = self.measured_peak / max(self.budget, 1)
        out = [
            f"  verified: XLA temp {format_bytes(self.measured_peak)} ({ratio:.2f} of the budget), predicted "
            f"{format_bytes(self.predicted_peak)}; {self.corrections} correction(s), {self.compiles} compile(s), "
            f"{self.seconds:.1f} s; chosen: {self.chosen}"
        ]
        for h in self.hand:
            verdict = "fits" if h.fits else "over the budget"
            out.append(
                f"    hand strategy {h.name}: XLA temp {format_bytes(h.measured_peak)} ({verdict}), "
                f"flops {h.flops / max(self.flops, 1):.3f}x the chosen schedule's"
            )
        return out


@dataclass(frozen=True)
class HandStrategy:
    """A strategy people write by hand, as a schedule of the chain: its ops, and the blocks it
    runs as one checkpoint under a policy (:class:`~jaxremat.core.schedule.Block`)."""

    ops: tuple[Op, ...]
    blocks: tuple[Block, ...] = ()


def _phase(costs: ChainCosts, k: int) -> int:
    """Where blocks of ``k`` stages start: the phase whose boundaries keep the fewest bytes (a
    chain repeating a ``k``-stage block after a prologue, a layer norm cut off the first)."""
    L = costs.length
    return min(range(k), key=lambda p: (sum(int(costs.x[s]) for s in range(p, L, k)), p))


def hand_strategies(costs: ChainCosts, blocks: Sequence[tuple[int, int]] = ()) -> dict[str, HandStrategy]:
    """The strategies people write by hand that are schedules of this chain: every stage stored
    under each store option (``jax.checkpoint(block, policy)`` on every block), every stage
    checkpointed (``jax.checkpoint`` on every block), every ``k`` stages checkpointed for ``k`` of
    2-4 (``jax.checkpoint`` on a block that is several stages: a transformer block cut before
    each contraction) and ``sqrt(L)`` segments. Given the user's ``blocks`` (spans of stages,
    :mod:`~jaxremat.api.user_blocks`), also every block checkpointed and every block under each
    store option's policy, as the user writes them (:class:`Block`); the stages outside the
    blocks stored whole."""
    L = costs.length
    found = {"every stage checkpointed": HandStrategy(tuple(baselines.every_stage(L)))}
    for k in range(2, min(4, L - 1) + 1):
        found[f"every {k} stages checkpointed"] = HandStrategy(
            tuple(baselines.segments(L, list(range(_phase(costs, k), L, k))))
        )
    if blocks:
        starts = sorted({b for b, _ in blocks} | {e for _, e in blocks if e < L})
        found["every block checkpointed"] = HandStrategy(tuple(baselines.segments(L, starts)))
    found["sqrt segments"] = HandStrategy(tuple(baselines.sqrt_segments(L)))
    names = sorted({costs.option(i, k).name for i in range(L) for k in range(1, costs.option_count(i))})
    tail = [Op(OpKind.LOSS, L)] + [Op(OpKind.B, i) for i in reversed(range(L))]
    for name in names:
        picks = []
        for i in range(L):
            ks = [k for k in range(costs.option_count(i)) if costs.option(i, k).name == name]
            # an option dropped as dominated: the one that beat it keeps no more
            picks.append(ks[0] if ks else min(range(costs.option_count(i)), key=lambda k: costs.option(i, k).xbar))
        found[f"every stage under {name}"] = HandStrategy(
            tuple([Op(OpKind.FALL, i, k) for i, k in enumerate(picks)] + tail)
        )
        if blocks:
            under = tuple(Block(b, e, name) for b, e in blocks)
            inside = {i for b, e in blocks for i in range(b, e)}
            ops = [Op(OpKind.FALL, i, k if i in inside else 0) for i, k in enumerate(picks)]
            found[f"every block under {name}"] = HandStrategy(tuple(ops + tail), under)
    return found


def verify(
    costs: ChainCosts,
    target: int | None,
    schedule: Schedule,
    measure: Callable[[Schedule], Measured],
    *,
    algorithm: str = "optimal",
    slots: int = 500,
    tries: int = 4,
    compare_hand: bool = True,
    blocks: Sequence[tuple[int, int]] = (),
    earlier: MutableMapping[tuple, tuple[Schedule, Measured]] | None = None,
    candidates: Sequence[Schedule] | None = None,
) -> tuple[Schedule, Verification]:
    """``schedule`` checked by XLA against ``target`` bytes (its measured temp, ``a_0``
    included as the plan counts it), corrected while over, then compared with the hand
    strategies of :func:`hand_strategies` (``blocks``: the user's blocks, spans of
    stages, where the chain cuts them finer).
    ``target=None`` (the store-all peak asked for: nothing
    to recompute) measures and reports only.

    ``measure(schedule)`` compiles the step under ``schedule``; results are memoised by op list,
    and recorded in ``earlier`` (schedules measured for the same step at other budgets: one of
    them that fits, with the fewest flops, is taken where nothing tried here fits; without it, a
    linen CNN was refused at 7.05 MiB, naming 10.51, after a schedule of 7.04 had been measured
    at a lower budget).
    ``candidates`` (fastest first): the schedules a correction takes from, instead of solving
    again (a chain with layer stacks: those that run each stack as one loop, so that no layer's
    parameters are sliced).
    Raises :class:`~jaxremat.InfeasibleBudget` when no schedule tried measures within ``target``.
    """
    start = time.perf_counter()
    seen: dict[tuple, Measured] = {}
    earlier = {} if earlier is None else earlier

    compiled = []

    def measured(s: Schedule) -> Measured:
        key = (tuple(s.ops), s.blocks)
        if key not in seen:
            if key not in earlier:
                earlier[key] = (s, measure(s))
                compiled.append(key)
            seen[key] = earlier[key][1]
        return seen[key]

    def hands(schedule: Schedule, fits: bool) -> list[tuple[str, Schedule]]:
        """The hand strategies to compile beside ``schedule`` (at most HAND_COMPILES)."""
        ranked = []
        # what a hand strategy is judged by is what the plan is judged by: compiled flops, so
        # candidates are ranked by the flops the profile predicts where it has them. The time
        # model alone can rank a policy below checkpointing (on the CPU's roofline, a policy's
        # backward re-runs memory-bound element-wise work priced near a whole recomputation;
        # "every block under dots_saveable" was never compiled on an NNX transformer, 2026-12-05)
        own = predicted_flops(costs, schedule.ops)
        for name, hand in hand_strategies(costs, blocks).items():
            ops = hand.ops
            sched = Schedule.from_ops(costs, ops, budget=target, algorithm=name, blocks=hand.blocks)
            # a block keeps its stages' boundaries only where its policy saves them: the bytes
            # it may measure lie between least_peak and peak (44.22 MiB of an NNX transformer's
            # blocks under dots_saveable between 31.23 and 61.25), so it is judged by the least
            peak, t = sched.least_peak, sched.time
            flops = predicted_flops(costs, ops)
            cost, mine = (flops, own) if flops is not None and own is not None else (t, schedule.time)
            # once a schedule fits, only strategies it might be kept for (preferred: cheaper beyond
            # the tie, or tied and leaner, as the plan was chosen); before, any: those predicted
            # within the budget first, the cheapest first, then the rest, the least memory first.
            # (The least memory first throughout took "every 3 stages checkpointed" at 0.31 of an
            # equinox transformer's 75% budget, 1.15x the plain flops, where "every stage under
            # dots_saveable" fitted at 1.02x, 2026-12-05.)
            close = peak <= HAND_SLACK * target or not fits
            same = tuple(ops) == tuple(schedule.ops) and hand.blocks == schedule.blocks
            if not same and close and (not fits or preferred(cost, peak, mine, schedule.peak)):
                # blocks that may fit only at their least after those that fit at their most: at
                # 30% of the equinox transformer, its blocks under dots_saveable (between 2.45 and
                # 9.07 MiB predicted, 8.48 measured) took the compiles from every stage
                # checkpointed (1.11x the plain flops chosen instead of 1.09x, 2026-12-05). Of
                # equal cost, the user's blocks first (they keep less than their stages under the
                # same policy, for the same flops), then the least memory.
                unsure = sched.peak > HAND_SLACK * target
                key = (0, unsure, cost, not hand.blocks, peak) if fits or peak <= target else (1, peak)
                ranked.append((key, name, sched))
        return [(name, sched) for _, name, sched in sorted(ranked, key=lambda r: r[0])[:HAND_COMPILES]]

    def first_hands(schedule: Schedule) -> list[tuple[str, Schedule]]:
        """The hand strategies worth compiling before correcting ``schedule``: predicted within
        the budget at their least and in no more flops than it (no others can spare a correction;
        a loop MLP's compiled two for nothing)."""
        own = predicted_flops(costs, schedule.ops)
        return [
            (name, h)
            for name, h in hands(schedule, False)
            if h.least_peak <= target
            and (own is None or (f := predicted_flops(costs, h.ops)) is None or f <= own * (1 + 1e-9))
        ]

    def prefetch(schedules: Sequence[Schedule]) -> None:
        """Compile ``schedules`` side by side (each is compiled whatever the others measure)."""
        todo = [h for h in schedules if (tuple(h.ops), h.blocks) not in {*seen, *earlier}]
        if len(todo) > 1:
            for h, m in zip(todo, side_by_side(measure, todo)):
                key = (tuple(h.ops), h.blocks)
                if key not in earlier:
                    earlier[key] = (h, m)
                    compiled.append(key)

    x0, asked = int(costs.x[0]), schedule.asked
    if compare_hand and target is not None and threads() > 1:
        # the plan and the hand strategies it is compared with once it fits (the common case),
        # compiled side by side rather than one after another: a linen decoder's plan and "every
        # block under dots_saveable", 2.7 s each, 2026-12-06. Over the budget, the hand strategy is
        # one a correction would be compared with too, or one kept in ``earlier``.
        prefetch([schedule] + [h for _, h in hands(schedule, True)][: threads() - 1])
    got = measured(schedule)
    chosen, corrections = "plan", 0
    fits = target is None or got.peak <= target
    if candidates is not None and target is not None:
        # loop schedules, cheapest first: over the budget, the cheapest that measures within it;
        # within, a cheaper one that does too (the cost model's loop memory is pessimistic: the
        # plan at a scanned decoder's "minimal" policy memory ran 1.17x its time, 2026-12-06)
        # ranked by the flops the profile predicts, as hand strategies are (the roofline time
        # model priced a decoder's every layer under dots_saveable above a checkpointing mix of
        # 1.17x its flops, which ran 1.13-1.33x its time)
        def cost(c: Schedule) -> tuple:
            flops = predicted_flops(c.costs, c.ops)
            return (c.time,) if flops is None else (flops, c.time)

        mine = cost(schedule)
        pool = sorted((c for c in candidates if not fits or cost(c) < mine), key=cost)
        cal = calibrated_pick(
            pool, target, lambda s: measured(s).peak - x0, optimistic=lambda s: int(LOOP_OPTIMISM * s.peak), tries=tries
        )
        if cal is not None:
            schedule, chosen = cal.schedule, "corrected plan" if not fits else "a faster loop schedule measured within"
            got, fits = measured(schedule), True
        corrections = len(seen) - 1
    elif not fits and compare_hand and _hand_first(first_hands(schedule), measured, prefetch, target, got):
        pass  # a hand strategy fits in no more flops than the plan over the budget: no correction can win
    elif not fits:
        before = len(seen)  # the plan, and the hand strategies compiled first
        # calibrated_solve adds a_0 to what measure gives it; our peak holds it already
        try:
            cal = calibrated_solve(
                costs,
                target,
                lambda s: measured(s).peak - x0,
                algorithm=algorithm,
                slots=slots,
                tries=tries + 1,
                start=schedule,  # measured already: the corrections start from it
                tolerance=CORRECTED_WITHIN,
                tie=LEAN_TIE,
            )
            schedule, chosen, fits = cal.schedule, "corrected plan", True
            got = measured(schedule)
        except InfeasibleBudget:
            pass  # the hand strategies below may still fit
        corrections = len(seen) - before
    checks: list[HandCheck] = []
    if compare_hand and target is not None:
        picked = hands(schedule, fits)
        prefetch([h for _, h in picked])
        for name, hand in picked:
            m = measured(hand)
            peak = hand.peak
            ok = m.peak <= target + HAND_BYTES
            checks.append(HandCheck(name, peak, m.peak, m.flops, ok))
            if ok and (not fits or preferred(m.flops, m.peak, got.flops, got.peak)):
                schedule, got, chosen, fits = hand, m, name, True
    if not fits and target is not None:
        found = [(m.flops, n, s, m) for n, (s, m) in enumerate(earlier.values()) if m.peak <= target]
        if found:
            _, _, schedule, got = min(found, key=lambda f: f[:2])
            chosen, fits = f"{schedule.algorithm} (measured at another budget)", True
    if not fits:
        least = min(m.peak for _, m in earlier.values())
        raise InfeasibleBudget(
            algorithm,
            target,
            least,
            note=f"measured by XLA: the least memory of the {len(earlier)} schedules compiled "
            "(the plan, its corrections and the hand strategies that might fit, at this budget and those asked "
            "before of the same function)",
        )
    verification = Verification(
        budget=schedule.peak if target is None else target,
        predicted_peak=schedule.peak,
        measured_peak=got.peak,
        flops=got.flops,
        corrections=corrections,
        compiles=len(compiled),
        seconds=time.perf_counter() - start,
        chosen=chosen,
        hand=tuple(checks),
    )
    return (schedule if target is None else dataclasses.replace(schedule, budget=target, asked=asked)), verification


def _hand_first(
    picked: Sequence[tuple[str, Schedule]],
    measured: Callable[[Schedule], Measured],
    prefetch: Callable[[Sequence[Schedule]], None],
    target: int,
    got: Measured,
) -> bool:
    """Whether, of the hand strategies ``picked`` for a plan that measured ``got``, over the
    budget, one fits in no more flops than it: compiled side by side before any correction, as
    they would be after it. A correction plans for less memory, so for no fewer flops; each is a
    compile of the step (an equinox transformer's 50% plan took four corrections before "every
    block under dots_saveable", which fitted in the first plan's flops, was chosen: 7 compiles,
    now 3)."""
    prefetch([h for _, h in picked])
    return any(measured(h).peak <= target + HAND_BYTES and measured(h).flops <= got.flops for _, h in picked)


__all__ = ["HandCheck", "HandStrategy", "Measured", "Verification", "hand_strategies", "verify"]
