"""Periodic schedules: a stretch of identical stages treated as ``n`` repeats of one pattern.

A :class:`~jaxremat.Repeat` layer keeps its copies' parameters stacked on a leading axis. The
executor runs it without copying them only as one ``lax.scan`` whose iterations cover equal
slices of that axis (a reshape): the schedule must repeat one *pattern* of top-level units
(stored stages and checkpoint regions) over ``p`` stages, ``n = length / p`` times. Slicing the
stack at other boundaries makes XLA copy the slices and the gradient's pieces, about the layer's
parameter bytes that no plan counts (measured: 1x-2x the parameters of a 48-block model).

:func:`solve_periodic` searches those schedules: every pattern of up to ``max_period`` stages
made of stored stages (under each store option) and regions (keeping their stages' residuals
inside, or checkpointing each of them again), the other stages all stored or all checkpointed
alone, each candidate replayed by the simulator, the fastest within the budget kept. Patterns are
few (dozens for ``max_period=4``), so this takes milliseconds.

A *selective* schedule is not periodic but runs as one loop too: each copy stored or checkpointed
alone, in any order (:func:`jaxremat.run.selective.selective_scan`, one block body to compile,
where a pattern of ``p`` stages compiles ``p``; a backward iteration holds one copy's residuals
more than a pattern loop, packed in a row). The search takes, per group, the one with the
most stored copies that fits (stored copies first: the loop keeps every stored copy's residuals
until its backward loop ends, and this order is the one whose simulated peak says so).
"""

from __future__ import annotations

import itertools
from typing import Iterator, Sequence

import numpy as np

from jaxremat.core.costs import ChainCosts
from jaxremat.core.loops import (
    MAX_PERIOD,
    REGION,
    STORE,
    LoopGroup,
    Part,
    as_pattern,
    compile_rank,
    loop_costs,
)
from jaxremat.core.schedule import Schedule
from jaxremat.core.simulator import simulate
from jaxremat.core.tree import Leaf, Node, RegionUnit, StoreUnit, Unit, build, to_ops


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


def patterns(p: int, options: int = 1) -> Iterator[tuple[Part, ...]]:
    """Every pattern of ``p`` stages; a stage stored alone under each of ``options`` store options."""
    stores = tuple(Part("store", 1, k) for k in range(options))
    for sizes in _compositions(p):
        parts = [(*stores, REGION) if k == 1 else (Part("region", k), Part("nested", k)) for k in sizes]
        yield from itertools.product(*parts)


def _group_patterns(costs: ChainCosts, start: int, n: int, max_period: int) -> list[tuple[Part, ...]]:
    """The patterns tried over group ``(start, n)``: periods dividing ``n`` up to ``max_period``;
    a pattern of one stage also stores it under every store option the group's copies share (the
    executor runs longer patterns under a checkpoint that would save a stored stage whole)."""
    k = 1 + min(len(costs.options[i]) for i in range(start, start + n)) if costs.options is not None else 1
    return [pat for p in range(1, min(max_period, n) + 1) if n % p == 0 for pat in patterns(p, k if p == 1 else 1)]


def _unit(part: Part, s: int) -> Unit:
    k = part.size
    if part.kind == "store":
        return StoreUnit(s, part.option)
    # a region's last stage, and each stage checkpointed alone, runs fused with its backward (FB)
    inner: list[Unit] = [
        StoreUnit(j) if part.kind == "region" else RegionUnit(j, j + 1, Leaf(j, fused=True))
        for j in range(s, s + k - 1)
    ]
    return RegionUnit(s, s + k, build(inner, Leaf(s + k - 1, fused=True)))


def periodic_tree(
    L: int, groups: Sequence[LoopGroup], pattern_of: dict[int, tuple[Part, ...]], outside: str = "store"
) -> Node:
    """The schedule tree with group ``(start, length)`` repeating ``pattern_of[start]`` and every
    stage outside the groups stored (``outside="store"``) or checkpointed alone (``"region"``)."""
    spine: list[Unit] = []
    starts = {s: n for s, n in groups}
    i = 0
    while i < L:
        if i in starts:
            pattern, end = as_pattern(pattern_of[i]), i + starts[i]
            while i < end:
                for part in pattern:
                    spine.append(_unit(part, i))
                    i += part.size
        else:
            spine.append(_unit(Part(outside, 1), i))
            i += 1
    return build(spine, Leaf(L))


def selective(k: int, n: int) -> tuple[Part, ...]:
    """The selective schedule of ``n`` copies with the first ``k`` stored, the rest checkpointed alone."""
    return (STORE,) * k + (REGION,) * (n - k)


def _check_groups(L: int, groups: Sequence[LoopGroup]) -> None:
    end = 0
    for s, n in sorted(groups):
        if s < end or n < 1 or s + n > L:
            raise ValueError(
                f"periodic groups must be disjoint ranges within the chain's {L} stages; got {list(groups)}"
            )
        end = s + n


def _candidate(
    costs: ChainCosts, groups: Sequence[LoopGroup], trial: dict, outside: str, param_bytes: Sequence[int] | None
):
    L = costs.length
    ops = to_ops(periodic_tree(L, groups, trial, outside), L)
    c = costs if param_bytes is None else loop_costs(costs, groups, trial, param_bytes)
    peak, time = simulate(c, ops)
    return peak, time, ops, c


COMPILE_TOLERANCE = 0.005


def solve_periodic(
    costs: ChainCosts,
    budget: int,
    groups: Sequence[LoopGroup],
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
    options = {s: _group_patterns(costs, s, n, max_period) for s, n in groups}
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
    groups: Sequence[LoopGroup],
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
    for s, n in groups:
        stored = sorted({int(round(q)) for q in np.linspace(1, n - 1, min(selective_steps, n - 1))}) if n > 1 else []
        options.append(_group_patterns(costs, s, n, max_period) + [selective(k, n) for k in stored])
    count = 2 * int(np.prod([len(o) for o in options]))
    if count > limit:
        raise ValueError(
            f"{count} periodic schedules for these groups, more than the limit of {limit}; lower max_period"
        )
    out = []
    for outside in ("store", "region"):
        for combo in itertools.product(*options):
            trial = {s: pat for (s, _), pat in zip(groups, combo)}
            _, _, ops, c = _candidate(costs, groups, trial, outside, param_bytes)
            out.append(Schedule.from_ops(c, ops, budget=None, algorithm="optimal", note="periodic"))
    return sorted(out, key=lambda s: (s.time, s.peak))


__all__ = [
    "COMPILE_TOLERANCE",
    "MAX_PERIOD",
    "compile_rank",
    "loop_costs",
    "patterns",
    "periodic_schedules",
    "periodic_tree",
    "selective",
    "solve_periodic",
]
