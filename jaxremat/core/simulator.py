"""Replay an op list under the rules of ``docs/cost_model.md`` with exact bytes.

The :class:`Machine` holds what is live and applies one op at a time; :func:`simulate` replays
a whole schedule. Solvers, tests and the exhaustive search all go through the same rules.
"""

from __future__ import annotations

from typing import Iterable

from jaxremat.core.costs import ChainCosts
from jaxremat.core.ops import FORWARD_KINDS, Op, OpKind, ops_of


class Machine:
    """Live buffers of a schedule being replayed.

    ``a`` holds the standalone activations (indices ``1..L``; ``a_0`` is always live and never
    counted), ``abar`` the bundles (stage -> the store option they were made with), ``delta``
    the index of the live gradient (or ``None``), ``next_b`` the stage whose backward comes next.
    """

    __slots__ = ("costs", "L", "a", "abar", "delta", "next_b", "loss_done", "cur", "time")

    def __init__(self, costs: ChainCosts):
        self.costs = costs
        self.L = costs.length
        self.a: set[int] = set()
        self.abar: dict[int, int] = {}
        self.delta: int | None = None
        self.next_b = self.L - 1
        self.loss_done = False
        self.cur = 0
        self.time = 0.0

    def copy(self) -> "Machine":
        m = Machine.__new__(Machine)
        m.costs, m.L = self.costs, self.L
        m.a, m.abar = set(self.a), dict(self.abar)
        m.delta, m.next_b, m.loss_done = self.delta, self.next_b, self.loss_done
        m.cur, m.time = self.cur, self.time
        return m

    def key(self) -> tuple:
        """A hashable summary of the state (for searches)."""
        return (frozenset(self.a), frozenset(self.abar.items()), self.delta, self.next_b, self.loss_done)

    def a_live(self, i: int) -> bool:
        return i == 0 or i in self.a or (i - 1) in self.abar

    @property
    def done(self) -> bool:
        return self.next_b == -1 and self.delta == 0

    def step(self, op: Op | tuple, position: int = 0) -> int:
        """Apply ``op``; return the bytes in use while it runs (without ``a_0``).

        Raises ``ValueError`` naming ``position`` if the op is not allowed here.
        """
        op = Op.of(op, position)
        kind, i, k = op.kind, op.stage, op.option
        c, L = self.costs, self.L

        def fail(why: str) -> ValueError:
            return ValueError(f"op #{position} {op!r}: {why}")

        if kind in FORWARD_KINDS:
            if not 0 <= i < L:
                raise fail(f"stage index out of range 0..{L - 1}")
            if not self.a_live(i):
                raise fail(f"a_{i} is not live (nothing holds stage {i}'s input)")
            if (i + 1) in self.a or i in self.abar:
                raise fail(f"a_{i + 1} is already live; an op may not create a live buffer again")
            if kind is OpKind.FALL:
                table = c.option_table[i]
                if k >= len(table):
                    raise fail(f"stage {i} has {len(table)} store option(s); there is no option {k}")
                xbar = table[k][0]
                peak = self.cur + xbar + int(c.fwd_tmp[i])
                self.abar[i] = k
                self.cur += xbar
            else:
                peak = self.cur + int(c.x[i + 1]) + int(c.fwd_tmp[i])
                self.a.add(i + 1)
                self.cur += int(c.x[i + 1])
                if kind is OpKind.FN and i in self.a:
                    self.a.discard(i)
                    self.cur -= int(c.x[i])
            self.time += float(c.fwd[i])
            return peak
        if kind is OpKind.LOSS:
            if i != L:
                raise fail(f"the loss op is ('Loss', {L}) for this chain of {L} stages")
            if self.loss_done:
                raise fail("Loss runs exactly once")
            if not self.a_live(L):
                raise fail(f"a_{L} is not live (run the forward of stage {L - 1} first)")
            peak = self.cur + int(c.x[L])
            self.loss_done = True
            self.delta = L
            self.cur += int(c.x[L])
            if L in self.a:
                self.a.discard(L)
                self.cur -= int(c.x[L])
            return peak
        # OpKind.B or OpKind.FB: the backward of stage i
        if not 0 <= i < L:
            raise fail(f"stage index out of range 0..{L - 1}")
        if not self.loss_done:
            raise fail("a backward op before Loss")
        if i != self.next_b:
            expected = f"the backward of stage {self.next_b}" if self.next_b >= 0 else "nothing (all backward ops are done)"
            raise fail(f"backward ops run once each in order L-1..0; expected {expected}")
        if self.delta != i + 1:
            raise fail(f"delta_{i + 1} is not live")
        if not self.a_live(i):
            raise fail(f"a_{i} is not live (stage {i}'s input is needed by its backward)")
        if kind is OpKind.B:
            if i not in self.abar:
                raise fail(f"abar_{i} is not live (stage {i} must run 'Fall' before its backward)")
            xbar, bwd, bwd_tmp = c.option_table[i][self.abar.pop(i)]
            peak = self.cur + int(c.x[i]) + bwd_tmp
            self.cur -= xbar
            self.time += bwd
        else:
            if i in self.abar:
                raise fail(f"abar_{i} is live: 'FB' recomputes the stage, so its bundle must not exist (use 'B')")
            if (i + 1) in self.a:
                raise fail(f"a standalone a_{i + 1} is live: 'FB' never makes the stage's output")
            peak = self.cur + int(c.x[i]) + int(c.fb_tmp[i])
            self.time += float(c.fb[i])
        self.cur += int(c.x[i]) - int(c.x[i + 1])
        self.delta = i
        if i in self.a:
            self.a.discard(i)
            self.cur -= int(c.x[i])
        self.next_b = i - 1
        return peak


def simulate(costs: ChainCosts, ops: Iterable[Op | tuple]) -> tuple[int, float]:
    """Replay ``ops`` on ``costs``; return ``(peak_bytes, time)``.

    The peak is ``x[0]`` plus the largest "peak while it runs" over all ops; the time is the
    sum of the forward and backward times of the ops. Raises ``ValueError`` naming the op's
    position and what was wrong if the schedule breaks a rule or does not finish.
    """
    if not isinstance(costs, ChainCosts):
        raise TypeError(f"simulate expects ChainCosts, got {type(costs).__name__}")
    m = Machine(costs)
    top = 0
    for n, op in enumerate(ops):
        top = max(top, m.step(op, n))
    if not m.done:
        missing = "Loss" if not m.loss_done else f"('B', {m.next_b}) .. ('B', 0)"
        raise ValueError(f"schedule ends before the backward is complete: missing {missing}")
    return int(costs.x[0]) + top, m.time


def predicted_flops(costs: ChainCosts, ops: Iterable[Op | tuple]) -> float | None:
    """The flops ``ops`` run, from the profiled flops of ``costs`` (``None`` when it has none):
    every forward op's forward, every ``B``'s backward under its bundle's option, every ``FB``."""
    if costs.fwd_flops is None or costs.bwd_flops is None:
        return None
    total, option = 0.0, {}
    for op in ops_of(ops):
        i = op.stage
        if op.kind in FORWARD_KINDS:
            total += float(costs.fwd_flops[i])
            if op.kind is OpKind.FALL:
                option[i] = op.option
        elif op.kind is OpKind.B:
            o = costs.option(i, option.get(i, 0))
            total += float(costs.bwd_flops[i] if o.bwd_flops is None else o.bwd_flops)
        elif op.kind is OpKind.FB:
            fb = costs.fb_flops[i] if costs.fb_flops is not None else costs.fwd_flops[i] + costs.bwd_flops[i]
            total += float(fb)
    return total


__all__ = ["Machine", "predicted_flops", "simulate"]
