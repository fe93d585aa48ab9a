"""Replay an op list under the rules of ``docs/cost_model.md`` with exact bytes.

The :class:`Machine` holds what is live and applies one op at a time; :func:`simulate` replays
a whole schedule. Solvers, tests and the exhaustive search all go through the same rules.

Offloading (``Offload``/``Prefetch`` ops, with a :class:`~jaxremat.core.transfers.Bandwidth`)
adds time: compute ops run one at a time in list order, copies run beside them on two links,
and a compute op that needs a buffer still being prefetched waits for it (a stall). Memory is
counted at op granularity, on the safe side: an offload releases its device bytes at the first
compute op that starts after its copy ended.

Bytes a stage's backward makes from constants alone (``ChainCosts.held``) count from the start
until that backward runs, as XLA allocates them.

Shared values (``ChainCosts.shared``: a skip tensor that is part of several activations) are
counted once: each is reference-counted by the live buffers that hold it, and a buffer's bytes
are its own bytes plus those of its shared values no other live buffer holds.
"""

from __future__ import annotations

from typing import Iterable

from jaxremat.core.costs import ChainCosts
from jaxremat.core.ops import FORWARD_KINDS, TRANSFER_KINDS, Op, OpKind, ops_of
from jaxremat.core.transfers import Bandwidth, BandwidthLike

Key = tuple[str, int]  # a buffer: ("a", i) for the standalone a_i, ("abar", i) for the bundle


class Replay(tuple):
    """What :func:`simulate` returns: ``(peak, time)`` (so ``peak, time = simulate(...)`` works),
    with ``host_peak`` (the most bytes held on the host at once) and ``stall`` (time compute
    waited for prefetches) as attributes."""

    def __new__(cls, peak: int, time: float, host_peak: int = 0, stall: float = 0.0) -> "Replay":
        r = tuple.__new__(cls, (int(peak), float(time)))
        r.host_peak, r.stall = int(host_peak), float(stall)
        return r

    @property
    def peak(self) -> int:
        return self[0]

    @property
    def time(self) -> float:
        return self[1]

    def __getnewargs__(self) -> tuple:
        return (self[0], self[1], self.host_peak, self.stall)


class Machine:
    """Live buffers of a schedule being replayed.

    ``a`` holds the standalone activations (indices ``1..L``; ``a_0`` is always live and never
    counted), ``abar`` the bundles (stage -> the store option they were made with), ``delta``
    the index of the live gradient (or ``None``), ``next_b`` the stage whose backward comes next.
    """

    __slots__ = (
        "costs", "L", "a", "abar", "delta", "next_b", "loss_done", "cur", "time",
        "bandwidth", "offloading", "on_host", "prefetching", "links", "host_spans", "stall", "refs", "P", "read",
        "moved",
    )

    def __init__(self, costs: ChainCosts, bandwidth: Bandwidth | None = None):
        self.costs = costs
        self.L = costs.length
        self.a: set[int] = set()
        self.abar: dict[int, int] = {}
        self.delta: int | None = None
        self.next_b = self.L - 1
        self.loss_done = False
        self.cur = 0
        self.time = 0.0  # the end of the last compute op
        self.bandwidth = bandwidth
        self.offloading: dict[Key, float] = {}  # copy to the host issued; device bytes held until it ends
        self.on_host: set[Key] = set()  # device bytes released: readable again only after a Prefetch
        self.prefetching: dict[Key, float] = {}  # copy back issued (bytes counted): readable when it ends
        self.links = {"to_host": 0.0, "to_device": 0.0}  # when each link's last copy ends
        self.host_spans: list[tuple[float, float, int]] = []  # (from, to, bytes) held on the host
        self.stall = 0.0
        self.refs: dict[int, int] = {}  # shared value -> how many live buffers hold it
        self.P = tuple(int(v) for v in costs.held_before)  # held until each backward, by stage
        self.read: set[int] = set()  # bundles whose output the next backward (or the loss) has read
        self.moved: set[int] = set()  # bundles offloaded: prefetched whole, they take no credit

    def copy(self) -> "Machine":
        m = Machine.__new__(Machine)
        m.costs, m.L = self.costs, self.L
        m.a, m.abar = set(self.a), dict(self.abar)
        m.delta, m.next_b, m.loss_done = self.delta, self.next_b, self.loss_done
        m.cur, m.time = self.cur, self.time
        m.bandwidth, m.offloading, m.on_host = self.bandwidth, dict(self.offloading), set(self.on_host)
        m.prefetching, m.links = dict(self.prefetching), dict(self.links)
        m.host_spans, m.stall = list(self.host_spans), self.stall
        m.refs, m.P, m.read, m.moved = dict(self.refs), self.P, set(self.read), set(self.moved)
        return m

    def key(self) -> tuple:
        """A hashable summary of the state (for searches; without transfers' timing)."""
        return (frozenset(self.a), frozenset(self.abar.items()), self.delta, self.next_b, self.loss_done,
                frozenset(self.read), frozenset(self.moved))

    def a_live(self, i: int) -> bool:
        return i == 0 or i in self.a or (i - 1) in self.abar

    @property
    def done(self) -> bool:
        return self.next_b == -1 and self.delta == 0

    def nbytes(self, key: Key) -> int:
        kind, i = key
        return int(self.costs.x[i]) if kind == "a" else int(self.costs.option_table[i][self.abar[i]][0])

    # A buffer's shared values: the standalone a_k holds those of a_k; the bundle abar_i those of
    # a_{i+1} (its output), and its xbar already counts the ones stage i makes (the others are
    # a_i's, live as long as the bundle).
    def _own(self, key: Key, xbar: int = 0) -> tuple[tuple[int, ...], int]:
        c = self.costs
        kind, i = key
        if not c.shared:
            return (), int(c.x[i]) if kind == "a" else xbar
        if kind == "a":
            return c.shared_pieces[i], int(c.x[i] - c.overlap[i, i])
        return c.shared_pieces[i + 1], xbar - c.new_shared_bytes(i)

    def _hold(self, key: Key, xbar: int = 0) -> int:
        """Make ``key`` live; return the bytes added: its own, and its shared values not yet live."""
        pieces, added = self._own(key, xbar)
        for n in pieces:
            if not self.refs.get(n):
                added += self.costs.shared[n].nbytes
            self.refs[n] = self.refs.get(n, 0) + 1
        return added

    def _release(self, key: Key, xbar: int = 0) -> int:
        """Free ``key``; return the bytes freed (its shared values that no other buffer holds)."""
        pieces, own = self._own(key, xbar)
        freed = own
        for n in pieces:
            self.refs[n] -= 1
            if not self.refs[n]:
                freed += self.costs.shared[n].nbytes
        return freed

    def holder(self, i: int) -> Key | None:
        """The buffer that holds ``a_i`` (``None`` for the input ``a_0``)."""
        if i == 0:
            return None
        return ("a", i) if i in self.a else ("abar", i - 1)

    def needs(self, op: Op) -> list[Key]:
        """The buffers a compute op reads (its gradients are never moved)."""
        kind, i = op.kind, op.stage
        if kind is OpKind.B:
            return [k for k in (("abar", i), self.holder(i)) if k is not None]
        return [k for k in (self.holder(i),) if k is not None]

    def transfer(self, op: Op, fail) -> None:
        """Issue a copy at the end of the last compute op (``docs/cost_model.md``)."""
        if self.bandwidth is None:
            raise fail("a transfer needs a bandwidth: simulate(costs, ops, bandwidth=bytes per time unit)")
        if self.costs.shared:
            raise fail(
                "transfers on a chain with shared values are not modelled (a value held by several buffers "
                "would move with one of them); replay on costs.without_shared()"
            )
        key: Key = (op.buffer, op.stage)
        exists = op.stage in self.a if op.buffer == "a" else op.stage in self.abar
        if op.kind is OpKind.OFFLOAD:
            if not exists:
                what = f"a standalone a_{op.stage}" if op.buffer == "a" else f"the bundle abar_{op.stage}"
                raise fail(f"{what} is not live, so there is nothing to offload")
            if key in self.offloading or key in self.on_host or key in self.prefetching:
                raise fail(f"{op.buffer}_{op.stage} is already offloaded (prefetch it before offloading it again)")
            start = max(self.time, self.links["to_host"])
            end = start + self.bandwidth.seconds(self.nbytes(key), "to_host")
            self.links["to_host"] = self.offloading[key] = end
            self.host_spans.append((self.time, float("inf"), self.nbytes(key)))
            if op.buffer == "abar":
                self.moved.add(op.stage)
            return
        # Prefetch
        if not exists or (key not in self.offloading and key not in self.on_host):
            raise fail(f"{op.buffer}_{op.stage} is not on the host (offload it first)")
        after = self.offloading.pop(key, None)  # still being copied: its device bytes stay
        if after is None:
            self.on_host.discard(key)
            self.cur += self.nbytes(key)
            after = 0.0
        start = max(self.time, self.links["to_device"], after)
        ready = start + self.bandwidth.seconds(self.nbytes(key), "to_device")
        self.links["to_device"] = self.prefetching[key] = ready
        n = next(n for n in range(len(self.host_spans) - 1, -1, -1) if self.host_spans[n][1] == float("inf"))
        t0, _, b = self.host_spans[n]
        self.host_spans[n] = (t0, ready, b)

    def start(self, op: Op, fail) -> None:
        """Start a compute op: wait for its prefetches, release finished offloads, check that
        what it reads is on the device."""
        needs = self.needs(op) if op.kind is not OpKind.LOSS or self.a_live(op.stage) else []
        begin = max([self.time] + [self.prefetching[k] for k in needs if k in self.prefetching])
        self.stall += begin - self.time
        self.time = begin
        for key, end in list(self.offloading.items()):
            if end <= begin:
                del self.offloading[key]
                self.on_host.add(key)
                self.cur -= self.nbytes(key)
        for key in needs:
            if key in self.on_host:
                raise fail(
                    f"reads {key[0]}_{key[1]}, whose offload ended and which was not prefetched "
                    f"(add ('Prefetch', {key[1]}, {key[0]!r}) before it)"
                )
            self.prefetching.pop(key, None)

    def freed(self, key: Key) -> None:
        """A buffer an op frees: forget its transfers."""
        self.offloading.pop(key, None)
        self.prefetching.pop(key, None)

    def host_peak(self) -> int:
        events = sorted([(t0, -b) for t0, _, b in self.host_spans] + [(t1, b) for _, t1, b in self.host_spans])
        top = cur = 0
        for _, negb in events:  # at equal times an arrival counts before a departure
            cur -= negb
            top = max(top, cur)
        return top

    def step(self, op: Op | tuple, position: int = 0) -> int | None:
        """Apply ``op``; return the bytes in use while it runs (without ``a_0``), ``None`` for a
        transfer op (it takes no compute time).

        Raises ``ValueError`` naming ``position`` if the op is not allowed here.
        """
        op = Op.of(op, position)
        kind, i, k = op.kind, op.stage, op.option
        c, L = self.costs, self.L

        def fail(why: str) -> ValueError:
            return ValueError(f"op #{position} {op!r}: {why}")

        if kind in TRANSFER_KINDS:
            if not 0 <= i <= L:
                raise fail(f"stage index out of range 0..{L}")
            self.transfer(op, fail)
            return None
        if self.offloading or self.prefetching or self.on_host:
            self.start(op, fail)
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
                added = self._hold(("abar", i), xbar)
                peak = self.cur + added + int(c.fwd_tmp[i]) + self.P[self.next_b + 1]
                self.abar[i] = k
                self.cur += added
            else:
                added = self._hold(("a", i + 1))
                peak = self.cur + added + int(c.fwd_tmp[i]) + self.P[self.next_b + 1]
                self.a.add(i + 1)
                self.cur += added
                if kind is OpKind.FN and i in self.a:
                    self.a.discard(i)
                    self.cur -= self._release(("a", i))
                    self.freed(("a", i))
            self.time += float(c.fwd[i])
            return peak
        if kind is OpKind.LOSS:
            if i != L:
                raise fail(f"the loss op is ('Loss', {L}) for this chain of {L} stages")
            if self.loss_done:
                raise fail("Loss runs exactly once")
            if not self.a_live(L):
                raise fail(f"a_{L} is not live (run the forward of stage {L - 1} first)")
            peak = self.cur + int(c.x[L]) + self.P[L]
            if L - 1 in self.abar:
                self.read.add(L - 1)
            self.loss_done = True
            self.delta = L
            self.cur += int(c.x[L])
            if L in self.a:
                self.a.discard(L)
                self.cur -= self._release(("a", L))
                self.freed(("a", L))
            return peak
        # OpKind.B or OpKind.FB: the backward of stage i
        if not 0 <= i < L:
            raise fail(f"stage index out of range 0..{L - 1}")
        if not self.loss_done:
            raise fail("a backward op before Loss")
        if i != self.next_b:
            expected = "nothing (all backward ops are done)"
            if self.next_b >= 0:
                expected = f"the backward of stage {self.next_b}"
            raise fail(f"backward ops run once each in order L-1..0; expected {expected}")
        if self.delta != i + 1:
            raise fail(f"delta_{i + 1} is not live")
        if not self.a_live(i):
            raise fail(f"a_{i} is not live (stage {i}'s input is needed by its backward)")
        if kind is OpKind.B:
            if i not in self.abar:
                raise fail(f"abar_{i} is not live (stage {i} must run 'Fall' before its backward)")
            # the bundle's output bytes B does not read are gone if the next backward (or the loss)
            # has read them; a bundle made after that backward keeps them (docs/cost_model.md)
            xbar, bwd, bwd_tmp, unread = c.option_table[i][self.abar.pop(i)]
            credit = unread if i in self.read and i not in self.moved else 0
            self.read.discard(i)
            self.moved.discard(i)
            peak = self.cur + int(c.x[i]) + bwd_tmp - credit + self.P[i]
            self.cur -= self._release(("abar", i), xbar)
            self.freed(("abar", i))
            self.time += bwd
        else:
            if i in self.abar:
                raise fail(f"abar_{i} is live: 'FB' recomputes the stage, so its bundle must not exist (use 'B')")
            if (i + 1) in self.a:
                raise fail(f"a standalone a_{i + 1} is live: 'FB' never makes the stage's output")
            peak = self.cur + int(c.x[i]) + int(c.fb_tmp[i]) + self.P[i]
            self.time += float(c.fb[i])
        if i - 1 in self.abar:
            self.read.add(i - 1)
        self.cur += int(c.x[i]) - int(c.x[i + 1])
        self.delta = i
        if i in self.a:
            self.a.discard(i)
            self.cur -= self._release(("a", i))
            self.freed(("a", i))
        self.next_b = i - 1
        return peak


def simulate(costs: ChainCosts, ops: Iterable[Op | tuple], *, bandwidth: BandwidthLike | None = None) -> Replay:
    """Replay ``ops`` on ``costs``; return ``(peak_bytes, time)`` as a :class:`Replay` (with
    ``.host_peak`` and ``.stall``).

    The peak is ``x[0]`` plus the largest "peak while it runs" over the compute ops; the time is
    the end of the last compute op: the sum of their times plus the stalls waiting for
    prefetches. ``bandwidth`` (bytes per time unit, one number or ``(to_host, to_device)``) is
    needed by ``Offload`` and ``Prefetch`` ops. Raises ``ValueError`` naming the op's position
    and what was wrong if the schedule breaks a rule or does not finish.
    """
    if not isinstance(costs, ChainCosts):
        raise TypeError(f"simulate expects ChainCosts, got {type(costs).__name__}")
    m = Machine(costs, None if bandwidth is None else Bandwidth.of(bandwidth))
    top = 0
    for n, op in enumerate(ops):
        peak = m.step(op, n)
        if peak is not None:
            top = max(top, peak)
    if not m.done:
        missing = "Loss" if not m.loss_done else f"('B', {m.next_b}) .. ('B', 0)"
        raise ValueError(f"schedule ends before the backward is complete: missing {missing}")
    return Replay(int(costs.x[0]) + top, m.time, m.host_peak(), m.stall)


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


__all__ = ["Machine", "Replay", "predicted_flops", "simulate"]
