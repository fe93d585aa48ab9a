"""The tree of a persistent schedule (``docs/cost_model.md``), read from and written back to its op list.

For a segment of stages ``s .. t`` (stage ``L`` is the loss) the ops are one of

* ``Fall s k, <ops of s+1 .. t>, B s`` (:class:`Store`): stage ``s`` keeps the residuals of its
  store option ``k`` (0: all of them);
* ``Fck s, Fn s+1 .. Fn j-1, <ops of j .. t>, <ops of s .. j-1>`` (:class:`Region`): stages
  ``s .. j-1`` keep only their input ``a_s`` and are recomputed following ``<ops of s .. j-1>``;
* ``Fall s k, B s`` or ``FB s`` / ``Loss`` (:class:`Leaf`) for a single stage.

A segment is a *spine*: a sequence of top-level units (:class:`StoreUnit` and
:class:`RegionUnit`) ending in a leaf.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from jaxremat.core.ops import TRANSFER_KINDS, Op, OpKind, ops_of


@dataclass(frozen=True)
class Store:
    """Stage ``stage`` runs plainly under store option ``option``, then ``rest`` (stages
    ``stage+1 .. t``)."""

    stage: int
    rest: "Node"
    option: int = 0


@dataclass(frozen=True)
class Region:
    """Stages ``start .. stop-1`` in a checkpoint region recomputed as ``inner``; then ``rest``."""

    start: int
    stop: int
    inner: "Node"
    rest: "Node"


@dataclass(frozen=True)
class Leaf:
    """A single stage, ``Fall s k, B s`` (``fused`` false) or ``FB s`` (``fused``), or the loss
    (``stage == L``)."""

    stage: int
    option: int = 0
    fused: bool = False


Node = Store | Region | Leaf


@dataclass(frozen=True)
class StoreUnit:
    """A top-level piece of a spine: stage ``stage`` stored under option ``option``."""

    stage: int
    option: int = 0

    @property
    def start(self) -> int:
        return self.stage

    @property
    def stop(self) -> int:
        return self.stage + 1

    def moved(self, at: int) -> "StoreUnit":
        """The same unit starting at stage ``at``."""
        return StoreUnit(at, self.option)

    def structure(self) -> tuple:
        """What the unit does, with stage indices relative to its start."""
        return ("store", self.option)


@dataclass(frozen=True)
class RegionUnit:
    """A top-level piece of a spine: stages ``start .. stop-1`` in a checkpoint region whose
    recomputation follows ``inner``."""

    start: int
    stop: int
    inner: Node

    def moved(self, at: int) -> "RegionUnit":
        return RegionUnit(at, at + self.stop - self.start, shift(self.inner, at - self.start))

    def structure(self) -> tuple:
        return ("region", self.stop - self.start, shape(self.inner, self.start))


Unit = StoreUnit | RegionUnit


def parse(ops: Sequence[Op | tuple], L: int) -> Node:
    """The tree of a persistent schedule; ``ValueError`` if ``ops`` is not one."""
    ops = ops_of(ops)
    pos = 0

    def expect(kind: OpKind, i: int) -> Op:
        nonlocal pos
        if pos >= len(ops) or ops[pos][:2] != (kind, i):
            got = ops[pos] if pos < len(ops) else "the end"
            raise ValueError(
                f"not a persistent schedule: expected ({kind.value!r}, {i}) at op #{pos}, got {got}; "
                "execute() runs the tree-shaped schedules that jaxremat's solvers produce"
            )
        pos += 1
        return ops[pos - 1]

    def at(kind: OpKind, i: int) -> bool:
        return pos < len(ops) and ops[pos][:2] == (kind, i)

    def segment(s: int, t: int) -> Node:
        nonlocal pos
        if s == t:
            if s == L:
                expect(OpKind.LOSS, L)
                return Leaf(s)
            if at(OpKind.FB, s):
                pos += 1
                return Leaf(s, fused=True)
            option = expect(OpKind.FALL, s).option
            expect(OpKind.B, s)
            return Leaf(s, option)
        if at(OpKind.FALL, s):
            option = ops[pos].option
            pos += 1
            rest = segment(s + 1, t)
            expect(OpKind.B, s)
            return Store(s, rest, option)
        expect(OpKind.FCK, s)
        j = s + 1
        while pos < len(ops) and ops[pos] == (OpKind.FN, j) and j < t:
            pos += 1
            j += 1
        rest = segment(j, t)
        inner = segment(s, j - 1)
        return Region(s, j, inner, rest)

    tree = segment(0, L)
    if pos != len(ops):
        raise ValueError(f"not a persistent schedule: {len(ops) - pos} op(s) left after the backward, from op #{pos}")
    return tree


def offloads_in(offloaded: frozenset[tuple[str, int]], start: int, stop: int) -> bool:
    """Whether any buffer of ``offloaded`` belongs to stages ``start .. stop - 1`` (their inputs
    ``("a", i)`` or bundles ``("abar", i)``; ``a_stop`` is the next stage's input)."""
    return any(start <= i < stop for _, i in offloaded)


def parse_offloads(ops: Sequence[Op | tuple], L: int) -> tuple[Node, frozenset[tuple[str, int]]]:
    """The tree of a schedule with transfer ops, and the buffers it offloads (``("a", i)``:
    the input of the top-level unit starting at ``i``; ``("abar", i)``: the bundle of the
    top-level stored stage ``i``). Where the copies run is XLA's to schedule, so only which
    buffers move matters here; ``ValueError`` for an offload the executor cannot run (a buffer
    that is not kept by the first forward pass's top-level units, or never prefetched)."""
    ops = ops_of(ops)
    tree = parse([op for op in ops if op.kind not in TRANSFER_KINDS], L)
    spine, _ = units(tree)
    starts = {u.start for u in spine if u.start > 0}
    stored = {u.stage for u in spine if isinstance(u, StoreUnit)}
    moved: set[tuple[str, int]] = set()
    for n, op in enumerate(ops):
        if op.kind is OpKind.OFFLOAD:
            key = (op.buffer, op.stage)
            if (op.buffer == "a" and op.stage not in starts) or (op.buffer == "abar" and op.stage not in stored):
                raise ValueError(
                    f"op #{n} {op!r}: the executor offloads what the first forward pass keeps at the top "
                    "level (the input of a top-level unit, or a top-level stored stage's bundle), as "
                    "'optimal_offload' plans it"
                )
            moved.add(key)
        elif op.kind is OpKind.PREFETCH and (op.buffer, op.stage) not in moved:
            raise ValueError(f"op #{n} {op!r}: prefetches a buffer that was not offloaded before it")
    return tree, frozenset(moved)


def units(node: Node) -> tuple[list[Unit], Leaf]:
    """A segment's tree as its sequence of top-level units and its final leaf."""
    spine: list[Unit] = []
    while not isinstance(node, Leaf):
        if isinstance(node, Store):
            spine.append(StoreUnit(node.stage, node.option))
        else:
            spine.append(RegionUnit(node.start, node.stop, node.inner))
        node = node.rest
    return spine, node


def shape(node: Node, base: int) -> tuple:
    """The structure of a tree with stage indices relative to ``base``."""
    if isinstance(node, Leaf):
        return ("leaf", node.stage - base, node.option, node.fused)
    if isinstance(node, Store):
        return ("store", node.stage - base, node.option, shape(node.rest, base))
    return ("region", node.start - base, node.stop - base, shape(node.inner, base), shape(node.rest, base))


def shift(node: Node, d: int) -> Node:
    """``node`` with every stage index moved by ``d``."""
    if isinstance(node, Leaf):
        return Leaf(node.stage + d, node.option, node.fused)
    if isinstance(node, Store):
        return Store(node.stage + d, shift(node.rest, d), node.option)
    return Region(node.start + d, node.stop + d, shift(node.inner, d), shift(node.rest, d))


def build(spine: Sequence[Unit], leaf: Leaf) -> Node:
    """The tree of a spine (the inverse of :func:`units`)."""
    node: Node = leaf
    for u in reversed(spine):
        node = Store(u.stage, node, u.option) if isinstance(u, StoreUnit) else Region(u.start, u.stop, u.inner, node)
    return node


def to_ops(node: Node, L: int) -> list[Op]:
    """The op list of a tree (the inverse of :func:`parse`)."""
    if isinstance(node, Leaf):
        if node.stage == L:
            return [Op(OpKind.LOSS, L)]
        if node.fused:
            return [Op(OpKind.FB, node.stage)]
        return [Op(OpKind.FALL, node.stage, node.option), Op(OpKind.B, node.stage)]
    if isinstance(node, Store):
        return [Op(OpKind.FALL, node.stage, node.option), *to_ops(node.rest, L), Op(OpKind.B, node.stage)]
    return [
        Op(OpKind.FCK, node.start),
        *[Op(OpKind.FN, j) for j in range(node.start + 1, node.stop)],
        *to_ops(node.rest, L),
        *to_ops(node.inner, L),
    ]


__all__ = [
    "Leaf",
    "Node",
    "Region",
    "RegionUnit",
    "Store",
    "StoreUnit",
    "Unit",
    "build",
    "offloads_in",
    "parse",
    "parse_offloads",
    "shape",
    "shift",
    "to_ops",
    "units",
]
