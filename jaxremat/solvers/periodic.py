"""Periodic schedules: a stretch of identical stages treated as ``n`` repeats of one pattern.

A :class:`~jaxremat.Repeat` layer keeps its copies' parameters stacked on a leading axis. The
executor runs it without copying them only as one ``lax.scan`` whose iterations cover equal
slices of that axis (a reshape): the schedule must repeat one *pattern* of top-level units
(stored stages and checkpoint regions) over ``p`` stages, ``n = length / p`` times. Slicing the
stack at other boundaries makes XLA copy the slices and the gradient's pieces, about the layer's
parameter bytes that no plan counts (measured: 1x-2x the parameters of a 48-block model).

:func:`solve_periodic` searches those schedules: every pattern of up to ``max_period`` stages
made of stored stages and regions (keeping their stages' residuals inside, or checkpointing each
of them again), the other stages all stored or all checkpointed alone, each candidate replayed by
the simulator, the fastest within the budget kept. Patterns are few (dozens for ``max_period=4``), so this takes milliseconds.

A *selective* schedule is not periodic but runs as one loop too: each copy stored or checkpointed
alone, in any order (:func:`jaxremat.selective.selective_scan`, one block body to compile,
where a pattern of ``p`` stages compiles ``p``; a backward iteration holds one copy's residuals
more than a pattern loop, packed in a row). The search takes, per group, the one with the
most stored copies that fits (stored copies first: the loop keeps every stored copy's residuals
until its backward loop ends, and this order is the one whose simulated peak says so).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Iterator, Sequence

import numpy as np

from jaxremat.costs import ChainCosts
from jaxremat.schedule import Schedule
from jaxremat.selective import PATTERN_LOOP_UP_TO, runs_selective
from jaxremat.simulate import simulate
from jaxremat.tree import Leaf, Node, Unit, build, to_ops

MAX_PERIOD = PATTERN_LOOP_UP_TO
STORE, REGION = ("store", 1), ("region", 1)

Part = tuple[str, int]  # ("store", 1), ("region", k) with stored inside, ("nested", k) checkpointed inside


def _compositions(p: int) -> Iterator[tuple[int, ...]]:
    for cuts in itertools.product((False, True), repeat=p - 1):
        sizes, run = [], 1
        for c in cuts:
            if c:
                sizes.append(run)
                run = 1
            else:
                run += 1
        yield (*sizes, run)


def patterns(p: int) -> Iterator[tuple[Part, ...]]:
    """Every pattern of ``p`` stages."""
    for sizes in _compositions(p):
        options = [(("store", 1), ("region", 1)) if k == 1 else (("region", k), ("nested", k)) for k in sizes]
        yield from itertools.product(*options)


def _unit(part: Part, s: int) -> Unit:
    kind, k = part
    if kind == "store":
        return ("store", s)
    inner_kind = "store" if kind == "region" else "nested"
    inner = [("store", j) if inner_kind == "store" else ("region", j, j + 1, Leaf(j)) for j in range(s, s + k - 1)]
    return ("region", s, s + k, build(inner, Leaf(s + k - 1)))


def periodic_tree(
    L: int, groups: Sequence[tuple[int, int]], pattern_of: dict[int, tuple[Part, ...]], outside: str = "store"
) -> Node:
    """The schedule tree with group ``(start, length)`` repeating ``pattern_of[start]`` and every
    stage outside the groups stored (``outside="store"``) or checkpointed alone (``"region"``)."""
    spine: list[Unit] = []
    starts = {s: n for s, n in groups}
    i = 0
    while i < L:
        if i in starts:
            pattern, end = pattern_of[i], i + starts[i]
            while i < end:
                for part in pattern:
                    spine.append(_unit(part, i))
                    i += part[1]
        else:
            spine.append(_unit((outside, 1), i))
            i += 1
    return build(spine, Leaf(L))


def selective(k: int, n: int) -> tuple[Part, ...]:
    """The selective schedule of ``n`` copies with the first ``k`` stored, the rest checkpointed alone."""
    return (STORE,) * k + (REGION,) * (n - k)


def is_selective(pattern: Sequence[Part], n: int) -> bool:
    """Whether a group of ``n`` stages repeating ``pattern`` runs as a selective loop (the
    executor's test, :func:`~jaxremat.selective.runs_selective`)."""
    if not all(part in (STORE, REGION) for part in pattern) or n % len(pattern):
        return False
    return runs_selective([part == STORE for part in pattern] * (n // len(pattern)))


def compile_rank(pattern: Sequence[Part], n: int) -> float:
    """How much loop body a group's schedule compiles, in blocks: 1 for a pattern of one stage, 2
    for a selective loop (one block, its recomputation and the residual buffers), ``p + 0.5``
    for a loop over a pattern of ``p`` stages."""
    if is_selective(pattern, n):
        return 2.0
    p = sum(k for _, k in pattern)
    return 1.0 if p == 1 else p + 0.5


def loop_costs(
    costs: ChainCosts, groups: Sequence[tuple[int, int]], pattern_of: dict[int, Sequence[Part]], param_bytes: Sequence[int]
) -> ChainCosts:
    """``costs`` with what a loop over a group adds to the transients.

    Each iteration of the scan over a group with period ``p`` materialises its slice of the
    stacked variables (``p`` stages' worth, ``w`` bytes each), and for ``p > 1`` cuts it into
    the stages' variables again; the backward loop does the same and also gathers the slice's
    gradient pieces before writing them into the stacked gradient. So a stage gets ``w`` more
    forward and ``2 w`` more backward transient when ``p == 1``, ``2 p w`` and ``4 p w`` when
    ``p > 1`` (read off XLA's buffer assignment of a 12-block transformer; without these the
    prediction was up to 1.7x low for patterns of 4 stages).

    A selective loop iterates one stage at a time (``w``, ``2 w``); a forward iteration reads the
    row it writes (the masked write of a checkpointed copy) and a backward iteration holds one
    copy's residuals packed in one row beside the unpacked ones: ``r = xbar - x_out`` more of
    each (without them XLA's peak was up to 1.05x the prediction on 48 transformer blocks).
    """
    fwd_tmp, bwd_tmp = costs.fwd_tmp.copy(), costs.bwd_tmp.copy()
    for s, n in groups:
        pattern = pattern_of[s]
        p = sum(k for _, k in pattern)
        f, b = (1, 2) if p == 1 or is_selective(pattern, n) else (2 * p, 4 * p)
        for i in range(s, s + n):
            fwd_tmp[i] += f * int(param_bytes[i])
            bwd_tmp[i] += b * int(param_bytes[i])
        if is_selective(pattern, n):
            r = max(int(costs.xbar[s]) - int(costs.x[s + 1]), 0)
            for i in range(s, s + n):
                fwd_tmp[i] += r
                bwd_tmp[i] += r
    return dataclasses.replace(costs, fwd_tmp=np.asarray(fwd_tmp), bwd_tmp=np.asarray(bwd_tmp))


def _check_groups(L: int, groups: Sequence[tuple[int, int]]) -> None:
    end = 0
    for s, n in sorted(groups):
        if s < end or n < 1 or s + n > L:
            raise ValueError(f"periodic groups must be disjoint ranges within the chain's {L} stages; got {list(groups)}")
        end = s + n


def _candidate(costs: ChainCosts, groups: Sequence[tuple[int, int]], trial: dict, outside: str, param_bytes: Sequence[int] | None):
    L = costs.length
    ops = to_ops(periodic_tree(L, groups, trial, outside), L)
    c = costs if param_bytes is None else loop_costs(costs, groups, trial, param_bytes)
    peak, time = simulate(c, ops)
    return peak, time, ops, c


COMPILE_TOLERANCE = 0.005


def solve_periodic(
    costs: ChainCosts,
    budget: int,
    groups: Sequence[tuple[int, int]],
    *,
    max_period: int = MAX_PERIOD,
    param_bytes: Sequence[int] | None = None,
    compile_tolerance: float = COMPILE_TOLERANCE,
) -> Schedule | None:
    """The fastest schedule within ``budget`` bytes that runs each group ``(start, length)`` as
    one loop: a pattern of at most ``max_period`` stages repeated over it, or a selective loop
    (each copy stored or checkpointed alone, in any mix); ``None`` when none fits.

    Of the schedules within ``compile_tolerance`` (a share) of the fastest step time, the one
    with the least loop body to compile is kept (:func:`compile_rank`): a selective loop compiles
    one block where a pattern of ``p`` stages compiles ``p``, and is as fast whenever the
    pattern only mixes stored and checkpointed stages; ``max_period=1`` keeps to one-block bodies.

    With ``param_bytes`` (per stage, the bytes of its variables), each candidate is simulated on
    :func:`loop_costs`, and the schedule returned carries those costs (its peak includes them).

    Each group's choice is made in turn (the others held at their current choice, starting
    from stored stages), twice over; ties go to the lower peak.
    """
    _check_groups(costs.length, groups)
    if not groups:
        return None
    sizes = dict(groups)
    choice = {s: (STORE,) for s, _ in groups}
    options = {
        s: [pat for p in range(1, min(max_period, n) + 1) if n % p == 0 for pat in patterns(p)] for s, n in groups
    }
    fits: list[tuple[float, int, float, tuple, dict, ChainCosts]] = []
    best: tuple | None = None

    def consider(trial: dict, outside: str) -> bool:
        nonlocal best
        peak, time, ops, c = _candidate(costs, groups, trial, outside, param_bytes)
        if peak > budget:
            return False
        rank = sum(compile_rank(trial[g], sizes[g]) for g in trial)
        fits.append((time, peak, rank, ops, trial, c))
        if best is None or (time, peak, rank) < best[:3]:
            best = fits[-1]
        return True

    for _ in range(2 if len(groups) > 1 else 1):
        for (s, n), outside in itertools.product(groups, ("store", "region")):
            for pat in options[s]:
                consider({**choice, s: pat}, outside)
            lo, hi = 1, n - 1  # the most stored copies that fit (the peak grows with them)
            while lo <= hi:
                k = (lo + hi) // 2
                if consider({**choice, s: selective(k, n)}, outside):
                    lo = k + 1
                else:
                    hi = k - 1
            if best is not None:
                choice = dict(best[4])
    if best is None:
        return None
    near = [f for f in fits if f[0] <= best[0] * (1 + compile_tolerance) + 1e-12]
    time, peak, rank, ops, trial, c = min(near, key=lambda f: (f[2], f[0], f[1]))
    return Schedule.from_ops(c, ops, budget=budget, algorithm="optimal", note="periodic")


def periodic_schedules(
    costs: ChainCosts,
    groups: Sequence[tuple[int, int]],
    *,
    max_period: int = MAX_PERIOD,
    param_bytes: Sequence[int] | None = None,
    selective_steps: int = 16,
    limit: int = 5000,
) -> list[Schedule]:
    """The schedules :func:`solve_periodic` chooses from (each group's pattern of up to
    ``max_period`` stages, or a selective loop with up to ``selective_steps``
    numbers of stored copies, evenly spread; the stages outside stored or checkpointed), fastest
    first, each on :func:`loop_costs` when ``param_bytes`` is given; ``ValueError`` if there are
    more than ``limit``."""
    L = costs.length
    _check_groups(L, groups)
    options = []
    for _, n in groups:
        stored = sorted({int(round(q)) for q in np.linspace(1, n - 1, min(selective_steps, n - 1))}) if n > 1 else []
        options.append(
            [pat for p in range(1, min(max_period, n) + 1) if n % p == 0 for pat in patterns(p)] + [selective(k, n) for k in stored]
        )
    count = 2 * int(np.prod([len(o) for o in options]))
    if count > limit:
        raise ValueError(f"{count} periodic schedules for these groups, more than the limit of {limit}; lower max_period")
    out = []
    for outside in ("store", "region"):
        for combo in itertools.product(*options):
            trial = {s: pat for (s, _), pat in zip(groups, combo)}
            _, _, ops, c = _candidate(costs, groups, trial, outside, param_bytes)
            out.append(Schedule.from_ops(c, ops, budget=None, algorithm="optimal", note="periodic"))
    return sorted(out, key=lambda s: (s.time, s.peak))


__all__ = [
    "COMPILE_TOLERANCE", "MAX_PERIOD", "compile_rank", "is_selective", "loop_costs", "patterns", "periodic_schedules", "periodic_tree", "selective", "solve_periodic",
]
