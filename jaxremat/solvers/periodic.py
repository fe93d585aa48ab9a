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
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Iterator, Sequence

import numpy as np

from jaxremat.costs import ChainCosts
from jaxremat.schedule import Schedule
from jaxremat.simulate import simulate
from jaxremat.tree import Leaf, Node, Unit, build, to_ops

MAX_PERIOD = 4

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


def loop_costs(costs: ChainCosts, groups: Sequence[tuple[int, int]], periods: dict[int, int], param_bytes: Sequence[int]) -> ChainCosts:
    """``costs`` with what a loop over a group adds to its stages' transients.

    Each iteration of the scan over a group with period ``p`` materialises its slice of the
    stacked variables (``p`` stages' worth, ``w`` bytes each), and for ``p > 1`` cuts it into
    the stages' variables again; the backward loop does the same and also gathers the slice's
    gradient pieces before writing them into the stacked gradient. So a stage gets ``w`` more
    forward and ``2 w`` more backward transient when ``p == 1``, ``2 p w`` and ``4 p w`` when
    ``p > 1`` (read off XLA's buffer assignment of a 12-block transformer; without these the
    prediction was up to 1.7x low for patterns of 4 stages).
    """
    fwd_tmp, bwd_tmp = costs.fwd_tmp.copy(), costs.bwd_tmp.copy()
    for s, n in groups:
        p = periods[s]
        f, b = (1, 2) if p == 1 else (2 * p, 4 * p)
        for i in range(s, s + n):
            fwd_tmp[i] += f * int(param_bytes[i])
            bwd_tmp[i] += b * int(param_bytes[i])
    return dataclasses.replace(costs, fwd_tmp=np.asarray(fwd_tmp), bwd_tmp=np.asarray(bwd_tmp))


def _check_groups(L: int, groups: Sequence[tuple[int, int]]) -> None:
    end = 0
    for s, n in sorted(groups):
        if s < end or n < 1 or s + n > L:
            raise ValueError(f"periodic groups must be disjoint ranges within the chain's {L} stages; got {list(groups)}")
        end = s + n


def solve_periodic(
    costs: ChainCosts,
    budget: int,
    groups: Sequence[tuple[int, int]],
    *,
    max_period: int = MAX_PERIOD,
    param_bytes: Sequence[int] | None = None,
) -> Schedule | None:
    """The fastest schedule within ``budget`` bytes that repeats one pattern over each group
    ``(start, length)``, or ``None`` when none fits.

    With ``param_bytes`` (per stage, the bytes of its variables), each candidate is simulated on
    :func:`loop_costs`, and the schedule returned carries those costs (its peak includes them).

    Each group's pattern is chosen in turn (the others held at their current choice, starting
    from stored stages), twice over; ties go to the lower peak, then the shorter period.
    """
    L = costs.length
    _check_groups(L, groups)
    if not groups:
        return None
    choice = {s: (("store", 1),) for s, _ in groups}
    options = {
        s: [pat for p in range(1, min(max_period, n) + 1) if n % p == 0 for pat in patterns(p)] for s, n in groups
    }
    best: tuple | None = None
    for _ in range(2 if len(groups) > 1 else 1):
        for (s, _n), outside in itertools.product(groups, ("store", "region")):
            for pat in options[s]:
                trial = {**choice, s: pat}
                ops = to_ops(periodic_tree(L, groups, trial, outside), L)
                c = costs
                if param_bytes is not None:
                    c = loop_costs(costs, groups, {g: sum(k for _, k in trial[g]) for g, _ in groups}, param_bytes)
                peak, time = simulate(c, ops)
                key = (time, peak, len(pat))
                if peak <= budget and (best is None or key < best[0]):
                    best = (key, ops, trial, c)
            if best is not None:
                choice = dict(best[2])
    if best is None:
        return None
    return Schedule.from_ops(best[3], best[1], budget=budget, algorithm="optimal", note="periodic")


def periodic_schedules(
    costs: ChainCosts,
    groups: Sequence[tuple[int, int]],
    *,
    max_period: int = MAX_PERIOD,
    param_bytes: Sequence[int] | None = None,
    limit: int = 5000,
) -> list[Schedule]:
    """Every periodic schedule (each group's pattern, the stages outside stored or checkpointed),
    fastest first, each on :func:`loop_costs` when ``param_bytes`` is given; ``ValueError`` if
    there are more than ``limit``."""
    L = costs.length
    _check_groups(L, groups)
    options = [[pat for p in range(1, min(max_period, n) + 1) if n % p == 0 for pat in patterns(p)] for _, n in groups]
    count = 2 * int(np.prod([len(o) for o in options]))
    if count > limit:
        raise ValueError(f"{count} periodic schedules for these groups, more than the limit of {limit}; lower max_period")
    out = []
    for outside in ("store", "region"):
        for combo in itertools.product(*options):
            trial = {s: pat for (s, _), pat in zip(groups, combo)}
            c = costs
            if param_bytes is not None:
                c = loop_costs(costs, groups, {g: sum(k for _, k in trial[g]) for g, _ in groups}, param_bytes)
            ops = to_ops(periodic_tree(L, groups, trial, outside), L)
            out.append(Schedule.from_ops(c, ops, budget=None, algorithm="optimal", note="periodic"))
    return sorted(out, key=lambda s: (s.time, s.peak))


__all__ = ["MAX_PERIOD", "loop_costs", "patterns", "periodic_schedules", "periodic_tree", "solve_periodic"]
