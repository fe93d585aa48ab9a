"""Which parts of a schedule run as loops: computed once per schedule, before anything is traced.

The top-level units of a schedule (stored stages and checkpoint regions) are cut into
*segments*: each :class:`~jaxremat.Repeat` layer that runs as one loop (a :class:`PatternLoop`
or a :class:`SelectiveLoop`, by the rules of :mod:`jaxremat.core.loops`; an
:class:`OffloadLoop` where the schedule moves some of its buffers to host memory), and the stretches of
units between them (a :class:`Stretch`). Inside a stretch, runs of alike units over a Repeat's
stacked variables (:class:`StackedRun`) still run as a scan, over slices that XLA copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from jaxremat.core.loops import runs_selective
from jaxremat.core.tree import RegionUnit, StoreUnit, Unit, offloads_in, shape
from jaxremat.model.chain import Chain
from jaxremat.model.identity import stage_identity


@dataclass(frozen=True)
class CopyKind:
    """How one copy runs: ``stored`` under store option ``option`` (its residuals kept, those of
    the option's checkpoint policy) or checkpointed (``stored=False``: only its input kept, the
    copy recomputed in the backward pass); ``host_input`` / ``host_bundle``: its input ``a_i`` /
    its bundle ``abar_i`` kept in host memory."""

    stored: bool
    option: int = 0
    host_input: bool = False
    host_bundle: bool = False

    def __post_init__(self) -> None:
        if not self.stored and (self.option or self.host_bundle):
            raise ValueError(f"{self}: a checkpointed copy has no store option and no bundle to offload")


@dataclass(frozen=True)
class PatternLoop:
    """A Repeat layer whose units repeat ``pattern`` (over ``period`` stages) ``repeats`` times:
    one scan over its stacked variables reshaped to ``(repeats, period, ...)``."""

    start: int
    pattern: tuple[Unit, ...]
    period: int
    repeats: int


@dataclass(frozen=True)
class SelectiveLoop:
    """A Repeat layer whose copies are each stored (``True``) or checkpointed alone, in a mix that
    repeats no short pattern: one selective loop (:func:`~jaxremat.run.selective.selective_scan`)."""

    start: int
    stored: tuple[bool, ...]

    @property
    def length(self) -> int:
        return len(self.stored)


@dataclass(frozen=True)
class OffloadLoop:
    """A Repeat layer whose copies are each stored or checkpointed alone and some of whose
    buffers the schedule keeps in host memory: loops over runs of alike copies
    (:func:`~jaxremat.run.offload_loop.offload_scan`)."""

    start: int
    kinds: tuple[CopyKind, ...]

    @property
    def length(self) -> int:
        return len(self.kinds)


Loop = PatternLoop | SelectiveLoop | OffloadLoop


@dataclass(frozen=True)
class Stretch:
    """Top-level units between loops, run in turn."""

    units: tuple[Unit, ...]


@dataclass(frozen=True)
class StackedRun:
    """``count`` alike units of ``stages`` stages each, from stage ``start``, inside one Repeat
    layer: a scan over their slice of the stacked variables."""

    start: int
    count: int
    stages: int


@dataclass(frozen=True)
class LoopPlan:
    """How the top-level units of a schedule run."""

    segments: tuple[Loop | Stretch, ...]
    loops: dict[int, Loop]  # by first stage
    stacked_runs: dict[int, StackedRun]  # by first stage
    sliced_layers: tuple[int, ...]  # Repeat layers (model layer index) whose variables are sliced


class Alike:
    """Whether two units do the same thing over stages with the same identity
    (:func:`~jaxremat.model.identity.stage_identity`: structure key and variable shapes)."""

    def __init__(self, chain: Chain, shapes: Sequence[Any]):
        self.ids = [stage_identity(st, v) if st.key else None for st, v in zip(chain.stages, shapes)]

    def __call__(self, u: Unit, w: Unit) -> bool:
        if type(u) is not type(w) or u.stop - u.start != w.stop - w.start:
            return False
        if isinstance(u, RegionUnit) and shape(u.inner, u.start) != shape(w.inner, w.start):
            return False
        if isinstance(u, StoreUnit) and u.option != w.option:  # stored under different policies
            return False
        return all(
            self.ids[u.start + p] is not None and self.ids[u.start + p] == self.ids[w.start + p]
            for p in range(u.stop - u.start)
        )

    def runs(self, units: Sequence[Unit]) -> list[tuple[int, int]]:
        """``units`` cut into maximal runs ``[i, j)`` of alike units."""
        out, i = [], 0
        while i < len(units):
            j = i + 1
            while j < len(units) and self(units[i], units[j]):
                j += 1
            out.append((i, j))
            i = j
        return out


def _inside(units: Sequence[Unit], start: int, stop: int) -> list[Unit]:
    return [u for u in units if start <= u.start < stop]


def _one_stage_each(units: Sequence[Unit], start: int, stop: int) -> list[Unit] | None:
    """The units covering stages ``start .. stop-1`` when each covers exactly one of them."""
    inside = _inside(units, start, stop)
    if len(inside) != stop - start or any(
        (u.start, u.stop) != (start + q, start + q + 1) for q, u in enumerate(inside)
    ):
        return None
    return inside


def selective_flags(units: Sequence[Unit], start: int, stop: int) -> tuple[bool, ...] | None:
    """Per stage of ``start .. stop-1``, stored or not, when the units covering them are each one
    stage, stored or checkpointed alone, in a mix that runs as a selective loop; else ``None``."""
    inside = _one_stage_each(units, start, stop)
    if inside is None:
        return None
    if any(isinstance(u, StoreUnit) and u.option for u in inside):
        return None  # a selective loop stores whole copies only (store option 0)
    flags = tuple(isinstance(u, StoreUnit) for u in inside)
    return flags if runs_selective(flags) else None


def offload_kinds(
    units: Sequence[Unit], start: int, stop: int, offloaded: frozenset[tuple[str, int]]
) -> tuple[CopyKind, ...] | None:
    """Per stage of ``start .. stop-1``, how it runs in an :class:`OffloadLoop`, when the units
    covering them are each one stage (stored under any option, or checkpointed alone); else ``None``."""
    inside = _one_stage_each(units, start, stop)
    if inside is None:
        return None
    return tuple(
        CopyKind(True, u.option, ("a", u.start) in offloaded, ("abar", u.start) in offloaded)
        if isinstance(u, StoreUnit)
        else CopyKind(False, 0, ("a", u.start) in offloaded)
        for u in inside
    )


def find_pattern(units: Sequence[Unit], start: int, stop: int, alike: Alike) -> PatternLoop | None:
    """The loop when the units covering stages ``start .. stop-1`` repeat ``m`` alike units over
    ``p`` stages; ``None`` when they do not (or straddle the ends), or when a pattern of more than
    one stage stores one under a store option (its iteration runs under a checkpoint that saves everything
    but the variables' cuts, and JAX then saves the stage's residuals whole: 12 such GPT blocks
    under ``dots_saveable`` kept 156 MiB where the policy keeps 50)."""
    inside = _inside(units, start, stop)
    if not inside or inside[0].start != start or inside[-1].stop != stop:
        return None
    for m in range(1, len(inside) + 1):
        if len(inside) % m:
            continue
        if all(alike(inside[q], inside[q + r]) for r in range(m, len(inside), m) for q in range(m)):
            p = inside[m - 1].stop - start
            if p > 1 and any(isinstance(u, StoreUnit) and u.option for u in inside[:m]):
                return None
            return PatternLoop(start, tuple(inside[:m]), p, len(inside) // m)
    return None


def plan_loops(
    chain: Chain,
    shapes: Sequence[Any],
    units: Sequence[Unit],
    scan: bool | None,
    alike: Alike | None = None,
    offloaded: frozenset[tuple[str, int]] = frozenset(),
) -> LoopPlan:
    """The :class:`LoopPlan` of a schedule's top-level ``units`` on ``chain`` (variable ``shapes``
    per stage). ``scan=False`` runs everything unrolled (no loops). A Repeat layer some of whose
    buffers the schedule ``offloaded`` runs as an :class:`OffloadLoop` when each of its copies is
    stored or checkpointed alone, and unrolled otherwise (no pattern loop moves buffers)."""
    alike = alike or Alike(chain, shapes)
    loops: dict[int, Loop] = {}
    sliced: list[int] = []
    if scan is not False:
        for g in chain.stacked:
            if offloads_in(offloaded, g.start, g.start + g.length):
                kinds = offload_kinds(units, g.start, g.start + g.length, offloaded)
                if kinds is None:
                    sliced.append(g.layer)
                else:
                    loops[g.start] = OffloadLoop(g.start, kinds)
                continue
            flags = selective_flags(units, g.start, g.start + g.length)
            found = (
                SelectiveLoop(g.start, flags)
                if flags is not None
                else find_pattern(units, g.start, g.start + g.length, alike)
            )
            if found is None:
                sliced.append(g.layer)
            else:
                loops[g.start] = found
    segments: list[Loop | Stretch] = []
    stretch: list[Unit] = []
    i = 0
    while i < len(units):
        loop = loops.get(units[i].start)
        if loop is None:
            stretch.append(units[i])
            i += 1
            continue
        if stretch:
            segments.append(Stretch(tuple(stretch)))
            stretch = []
        segments.append(loop)
        i += len(loop.pattern) * loop.repeats if isinstance(loop, PatternLoop) else loop.length
    if stretch:
        segments.append(Stretch(tuple(stretch)))
    runs: dict[int, StackedRun] = {}
    if scan is not False:
        for seg in segments:
            if not isinstance(seg, Stretch):
                continue
            for a, b in alike.runs(seg.units):
                first, last = seg.units[a], seg.units[b - 1]
                found = chain.group_of(first.start)
                offloads = offloads_in(offloaded, first.start, last.stop)
                if b - a >= 2 and found is not None and last.stop <= found[0].start + found[0].length and not offloads:
                    runs[first.start] = StackedRun(first.start, b - a, first.stop - first.start)
    return LoopPlan(tuple(segments), loops, runs, tuple(sliced))


__all__ = [
    "Alike",
    "CopyKind",
    "Loop",
    "LoopPlan",
    "OffloadLoop",
    "PatternLoop",
    "SelectiveLoop",
    "StackedRun",
    "Stretch",
    "find_pattern",
    "offload_kinds",
    "plan_loops",
    "selective_flags",
]
