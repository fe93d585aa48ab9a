"""What a solver returns: an op list with its predicted time and peak, and why it may fail."""

from __future__ import annotations

import re

import dataclasses
from dataclasses import dataclass, field

from jaxremat.core.costs import ChainCosts
from jaxremat.core.ops import FORWARD_KINDS, Op, OpKind, ops_of
from jaxremat.core.simulator import simulate
from jaxremat.core.transfers import Bandwidth, BandwidthLike
from jaxremat.core.units import format_bytes


class InfeasibleBudget(ValueError):
    """No schedule of this algorithm fits the budget.

    Attributes:
      min_budget: the smallest budget in bytes for which the algorithm finds a schedule.
      budget: the budget that was asked for, in bytes.
      algorithm: the algorithm's name.
    """

    def __init__(self, algorithm: str, budget: int, min_budget: int, note: str = ""):
        self.algorithm = algorithm
        self.budget = int(budget)
        self.min_budget = int(min_budget)
        self.note = note
        msg = (
            f"budget {format_bytes(budget)} ({budget:,} bytes) is below what algorithm "
            f"{algorithm!r} needs on this chain: at least {format_bytes(min_budget)} "
            f"({min_budget:,} bytes)"
        )
        if note:
            msg += f"; {note}"
        super().__init__(msg)

    def __reduce__(self):
        # pickling (multiprocessing, pytest-xdist) rebuilds the error from these: the note too
        return (InfeasibleBudget, (self.algorithm, self.budget, self.min_budget, self.note))


@dataclass(frozen=True)
class StageDecision:
    """What a schedule does with one stage."""

    stage: int
    first_pass: str  # "stored" (Fall), "checkpoint" (Fck: input kept), "dropped" (Fn), "none"
    forwards: int  # forward executions of the stage, recomputations (FB included) included
    policy: str = ""  # first pass "stored": the store option's policy ("" for store-all)
    fused: bool = False  # its backward is FB: recomputed right before it, fused with it
    offloaded: bool = False  # what its first pass keeps (its bundle, or its input) goes to host memory

    @property
    def recomputed(self) -> int:
        return max(self.forwards - 1, 0)


@dataclass(frozen=True)
class Block:
    """Stages ``start .. stop-1``, stored at the top level, run as one ``jax.checkpoint`` under the
    checkpoint policy named ``policy``: what a user writes as ``jax.checkpoint(block, policy)``
    where the chain cuts the user's block into several stages. It keeps the block's input and
    what the policy saves over the whole block, not the boundaries between its stages (a
    residual stream the policy recomputes from saved dots). The cost model prices stages, not
    blocks: a schedule with blocks is one of the hand strategies that
    :func:`~jaxremat.api.verify.verify` compiles, and its measured peak is what counts."""

    start: int
    stop: int
    policy: str


@dataclass(frozen=True)
class Schedule:
    """A valid op list (``docs/cost_model.md``) with its simulated peak (bytes) and time."""

    ops: tuple[Op, ...]
    time: float
    peak: int
    budget: int | None
    algorithm: str
    costs: ChainCosts = field(repr=False, compare=False)
    note: str = ""
    host_peak: int = 0  # the most bytes held in host memory at once (offloading)
    bandwidth: Bandwidth | None = None  # the links' bandwidths the schedule was replayed with
    blocks: tuple[Block, ...] = ()  # runs of stored stages run as one checkpoint under a policy
    asked: str = ""  # what the budget was asked as, if not bytes ("50% of the store-all peak, 16.08 MiB")

    @property
    def least_peak(self) -> int:
        """The peak less the bytes of the boundaries inside its blocks, which a block keeps only
        where its policy saves them: the least the schedule may measure (the peak itself for a
        schedule without blocks), and never less than the input, which every schedule holds (the
        boundaries subtracted are those of every block, not only those live at the peak)."""
        inside = sum(int(self.costs.x[j]) for b in self.blocks for j in range(b.start + 1, b.stop))
        return max(self.peak - inside, int(self.costs.x[0]))

    @classmethod
    def from_ops(
        cls,
        costs: ChainCosts,
        ops,
        *,
        budget: int | None,
        algorithm: str,
        note: str = "",
        bandwidth: BandwidthLike | None = None,
        blocks: tuple[Block, ...] = (),
    ) -> "Schedule":
        """Build a schedule, replaying ``ops`` for its exact peak and time (``bandwidth`` for
        ``Offload`` and ``Prefetch`` ops). With ``blocks``, the peak is that of the stages run
        one by one, which keep the boundaries inside the blocks too: more than the blocks keep,
        by at most those boundaries' bytes (see :class:`Block`)."""
        ops = ops_of(ops)
        bw = None if bandwidth is None else Bandwidth.of(bandwidth)
        r = simulate(costs, ops, bandwidth=bw)
        blocks = tuple(blocks)
        stored = {op.stage for op in ops if op.kind is OpKind.FALL}
        for b in blocks:
            if not 0 <= b.start < b.stop <= costs.length or not stored.issuperset(range(b.start, b.stop)):
                raise ValueError(
                    f"{b}: a block is a run of stages that the schedule stores, within 0 .. {costs.length}"
                )
        return cls(
            ops=ops,
            time=r.time,
            peak=r.peak,
            budget=budget,
            algorithm=algorithm,
            costs=costs,
            note=note,
            host_peak=r.host_peak,
            bandwidth=bw,
            blocks=blocks,
        )

    @property
    def offloads(self) -> tuple[Op, ...]:
        """The schedule's ``Offload`` ops, in order."""
        return tuple(op for op in self.ops if op.kind is OpKind.OFFLOAD)

    def with_algorithm(self, algorithm: str) -> "Schedule":
        """The same schedule reported under another name (an alias)."""
        return dataclasses.replace(self, algorithm=algorithm)

    @property
    def overhead(self) -> float:
        """Time over the store-all time ``sum(fwd) + sum(bwd)`` (1.0: as fast as plain autodiff;
        below 1.0 when recomputing as ``FB`` is predicted cheaper than reading residuals back)."""
        base = float(self.costs.fwd.sum() + self.costs.bwd.sum())
        return self.time / base if base > 0 else 1.0

    def decisions(self) -> list[StageDecision]:
        """Per stage: how its first forward keeps memory, and how often it runs forward."""
        L = self.costs.length
        first: list[str] = ["none"] * L
        policy = [""] * L
        counts = [0] * L
        fused = [False] * L
        names = {OpKind.FALL: "stored", OpKind.FCK: "checkpoint", OpKind.FN: "dropped"}
        for op in self.ops:
            i = op.stage
            if op.kind in FORWARD_KINDS:
                if counts[i] == 0:
                    first[i] = names[op.kind]
                    policy[i] = self.costs.option(i, op.option).name if op.option else ""
                counts[i] += 1
            elif op.kind is OpKind.FB:
                counts[i] += 1
                fused[i] = True
        off = [False] * L
        for op in self.offloads:  # a bundle is its stage's; a standalone a_j is stage j's input
            if op.stage < L:
                off[op.stage] = True
        return [StageDecision(i, first[i], counts[i], policy[i], fused[i], off[i]) for i in range(L)]

    def summary(self) -> str:
        """A readable report: budget, peak, time, and what happens to every stage."""
        c = self.costs
        budget = "none" if self.budget is None else format_bytes(self.budget)
        if self.asked:
            budget += f" ({self.asked})"
        where = f" per device (of {c.devices})" if c.devices > 1 else ""
        lines = [
            f"schedule ({self.algorithm}): {c.length} stages, {len(self.ops)} ops",
            f"  budget {budget}{where}, predicted peak {format_bytes(self.peak)}{where}, "
            f"time {self.time:.6g} ({self.overhead:.3f}x store-all)",
        ]
        if self.offloads:
            lines.append(
                f"  offloaded {len(self.offloads)} buffer(s) to host memory, host peak {format_bytes(self.host_peak)}"
            )
        if self.note:
            lines.append(f"  note: {self.note}")
        legend = {
            "stored": "stored whole (Fall)",
            "checkpoint": "input checkpointed (Fck)",
            "dropped": "input not kept (Fn)",
            "none": "never run",
        }
        rows = []
        for d in self.decisions():
            first = f"stored under {d.policy} (Fall)" if d.policy else legend[d.first_pass]
            rec = f", recomputed {d.recomputed}x" if d.recomputed else ""
            rec += " (the last time fused with its backward, FB)" if d.fused else ""
            rec += ", kept in host memory (offloaded, prefetched for the backward)" if d.offloaded else ""
            rows.append((c.stage_name(d.stage), first + rec))
        rows = _grouped(rows)
        width = max(len(name) for name, _ in rows)
        lines += [f"  {name:<{width}}  {what}" for name, what in rows]
        for b in self.blocks:
            lines.append(f"  stages {b.start}-{b.stop - 1}: one jax.checkpoint under {b.policy} (a block)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


_LAYER = re.compile(r"^(\d+):(.*)\[(\d+)\]$")


def _grouped(rows: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Runs of a layer stack's stages (``3:Decoder/layers[2]``) with the same decision as one row
    (``3-9:Decoder/layers[2..8]``), so that a 48-layer stack does not take 48 lines."""
    out: list[tuple[str, str]] = []
    run: list[tuple[re.Match, str]] = []

    def flush() -> None:
        if len(run) == 1:
            out.append((run[0][0].string, run[0][1]))
        elif run:
            (a, what), (b, _) = run[0], run[-1]
            out.append((f"{a.group(1)}-{b.group(1)}:{a.group(2)}[{a.group(3)}..{b.group(3)}]", what))
        run.clear()

    for name, what in rows:
        m = _LAYER.match(name)
        if m is None or (run and (run[-1][0].group(2), run[-1][1]) != (m.group(2), what)):
            flush()
        if m is None:
            out.append((name, what))
        else:
            run.append((m, what))
    flush()
    return out
