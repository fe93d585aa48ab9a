"""Reorder a schedule's units over identical stages so that alike ones are adjacent.

The dynamic program is indifferent to the order of the units (stored stages and checkpoint
regions) it places along a stretch of identical stages, and its tie-breaking interleaves them:
on 48 identical transformer blocks at 50% it picks regions of 2, 3, 2, 2, 2, 3, ... stages. The
executor runs a run of *adjacent* alike units as one ``lax.scan``, so an interleaved order costs
a loop body per unit and compile time that grows with depth. :func:`regularise` groups alike
units together (regions of the same size and inner tree, stored stages), trying the orders of
the groups, and keeps a reordering only when the simulator (``docs/cost_model.md``) gives a peak no
higher and a time no longer than the schedule had: the result is never worse.
"""

from __future__ import annotations

import itertools
from typing import Callable, Hashable, Sequence

from jaxremat.core.schedule import Schedule
from jaxremat.core.simulator import simulate
from jaxremat.core.tree import Node, RegionUnit, Unit, build, parse, to_ops, units

MAX_KINDS_PERMUTED = 4  # stretches with more kinds of units try a few orders, not all


def stage_classes(schedule: Schedule) -> list[tuple]:
    """Per stage, the costs that make two stages interchangeable for the simulator."""
    c = schedule.costs
    return [
        (
            int(c.x[i]),
            int(c.x[i + 1]),
            int(c.xbar[i]),
            float(c.fwd[i]),
            float(c.bwd[i]),
            int(c.fwd_tmp[i]),
            int(c.bwd_tmp[i]),
        )
        for i in range(c.length)
    ]


def _orders(kinds: list[tuple], lengths: dict[tuple, int]) -> list[tuple[tuple, ...]]:
    if len(kinds) <= MAX_KINDS_PERMUTED:
        return list(itertools.permutations(kinds))
    by_length = sorted(kinds, key=lambda k: lengths[k])
    return [tuple(kinds), tuple(reversed(kinds)), tuple(by_length), tuple(reversed(by_length))]


def _stretches(spine: list[Unit], classes: Sequence[Hashable]) -> list[tuple[int, int]]:
    """Maximal runs ``[i, j)`` of units whose stages all share one class."""

    def cls(u: Unit) -> Hashable | None:
        found = {classes[s] for s in range(u.start, u.stop)}
        return found.pop() if len(found) == 1 else None

    out, i = [], 0
    while i < len(spine):
        j = i + 1
        c = cls(spine[i])
        while c is not None and j < len(spine) and cls(spine[j]) == c:
            j += 1
        out.append((i, j))
        i = j
    return out


def regularise(schedule: Schedule, classes: Sequence[Hashable] | None = None) -> Schedule:
    """``schedule`` with the units of every stretch of identical stages grouped by kind.

    Args:
      schedule: a persistent schedule (any solver's).
      classes: per stage, a label; stages with equal labels may trade places (default: equal
        costs, :func:`stage_classes`). Pass labels that also tell apart stages the executor
        must not mix (different modules with equal costs).

    Returns:
      A schedule with the same stages and a peak and time no worse (checked by simulation);
      ``schedule`` itself when no reordering helps.
    """
    L = schedule.costs.length
    if classes is None:
        classes = stage_classes(schedule)
    if len(classes) != L:
        raise ValueError(f"regularise: {len(classes)} stage classes for a chain of {L} stages")
    best = [schedule.peak, schedule.time]

    def fits(tree: Node) -> bool:
        peak, time = simulate(schedule.costs, to_ops(tree, L))
        if peak <= best[0] and time <= best[1] * (1 + 1e-9) + 1e-12:
            best[:] = [peak, time]
            return True
        return False

    def visit(node: Node, whole: Callable[[Node], Node]) -> Node:
        """``node`` regularised; ``whole(sub)`` is the full tree with ``node`` replaced by ``sub``."""
        spine, leaf = units(node)
        spine = list(spine)
        for idx, u in enumerate(spine):  # inner trees first, so that equal regions become alike
            if isinstance(u, RegionUnit):

                def inside(sub: Node, idx: int = idx) -> Node:
                    v = spine[idx]
                    return whole(build([*spine[:idx], RegionUnit(v.start, v.stop, sub), *spine[idx + 1 :]], leaf))

                spine[idx] = RegionUnit(u.start, u.stop, visit(u.inner, inside))
        for i, j in _stretches(spine, classes):
            spine[i:j] = _group(spine[i:j], lambda run, i=i, j=j: whole(build([*spine[:i], *run, *spine[j:]], leaf)))
        return build(spine, leaf)

    def _group(run: list[Unit], whole_with: Callable[[list[Unit]], Node]) -> list[Unit]:
        kinds = list(dict.fromkeys(u.structure() for u in run))
        if len(kinds) < 2:
            return run
        firsts = [u.structure() for u in run]
        if all(firsts[k] == firsts[k - 1] or firsts[k] not in firsts[:k] for k in range(1, len(firsts))):
            return run  # already grouped
        members = {k: [u for u in run if u.structure() == k] for k in kinds}
        lengths = {k: members[k][0].stop - members[k][0].start for k in kinds}
        chosen = run
        for order in _orders(kinds, lengths):
            at, placed = run[0].start, []
            for k in order:
                for u in members[k]:
                    placed.append(u.moved(at))
                    at += lengths[k]
            if fits(whole_with(placed)):
                chosen = placed
        return chosen

    tree = visit(parse(schedule.ops, L), lambda sub: sub)
    ops = to_ops(tree, L)
    if tuple(ops) == tuple(schedule.ops):
        return schedule
    return Schedule.from_ops(
        schedule.costs, ops, budget=schedule.budget, algorithm=schedule.algorithm, note=schedule.note
    )


__all__ = ["regularise", "stage_classes"]
