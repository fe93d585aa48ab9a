"""``"optimal_offload"``: rematerialisation and host offloading solved together.

The class of schedules searched (``docs/cost_model.md``, *Remat and offloading together*): every
persistent schedule of ``"optimal"``, where the buffers its first forward sweep keeps may go to
host memory. That sweep is a sequence of top-level *steps*: a stored stage (``Fall s k``, kept
until ``B s``) or a checkpointed segment ``[s, j)`` (``Fck s, Fn s+1 .. Fn j-1``: it makes
``a_j``, and its backward later recomputes it from ``a_s``). Each step ends by making the buffer
the next step starts from: the bundle ``abar_s`` (which holds ``a_{s+1}``) or the standalone
``a_j``. That buffer, the *held input* of the next step, may be offloaded, under three rules:

1. its ``Offload`` is issued right after the op that makes it, and its copy must end within the
   compute of the next step's forward (so the device-to-host link is idle at the next offload);
2. its ``Prefetch`` is issued when the backward of the step after the next begins (the loss
   counts as the last step): one step ahead, so the copies back run in reverse order, each beside
   one step's backward, and the step that needs it waits (a stall) if it is late;
3. the held input of the loss (``a_L`` or ``abar_{L-1}``) stays on the device, and so do the
   chain's input ``a_0`` and buffers of zero bytes (a copy of nothing ends as it starts, so the
   next op could not read it); nothing inside a step's backward (a recomputation) is offloaded.

With no offload at all this is exactly ``"optimal"``'s class, so the result is never slower.

The dynamic program. ``W(s, m, h, g)``: least time to run the steps from ``s`` (their forwards,
the loss, their backwards down to ``s``) with ``m`` slots free, where ``h`` says whether this
step's held input is offloaded (and which buffer: ``a_s``, or ``abar_{s-1}`` under option ``k``)
and ``g`` is the buffer whose prefetch runs beside this step's backward (the held input of the
step before). ``h`` costs memory during this step's forward (until its copy ends) and backward
(it must be back); ``g`` costs memory during this step's backward, and turns the backward's time
``T`` into ``max(T, prefetch time of g)``. Everything else is the persistent DP's: a checkpointed
segment's backward is ``C(m', s, j - 1)`` from its table. Memory is in the same slots as
``"optimal"`` (sizes rounded up), transfer times in exact bytes, so a schedule that fits in slots
fits in bytes and the replay's time equals the DP's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from jaxremat.core.costs import ChainCosts
from jaxremat.core.ops import Op, OpKind
from jaxremat.core.schedule import InfeasibleBudget, Schedule
from jaxremat.core.transfers import Bandwidth
from jaxremat.solvers._discretise import SlotChain, bisect_least, discretise, extend
from jaxremat.solvers._dp_jax import table
from jaxremat.solvers._rebuild import rebuild_ops
from jaxremat.solvers.optimal import optimal_min_budget, solve_optimal

INF = np.inf
#: relative slack when the rebuild re-evaluates the fill's float arithmetic
TOL = 1e-9


@dataclass(frozen=True)
class Held:
    """A step's held input when it is offloaded: ``("a", s)`` or ``("abar", s - 1)`` (made
    under store option ``k``), with its size in slots and in bytes."""

    buffer: str
    stage: int
    k: int
    slots: int
    nbytes: int


class _Problem:
    """The chain in slots and bytes, the persistent DP's table, and the offloadable buffers."""

    def __init__(self, costs: ChainCosts, budget: int, slots: int, bandwidth: Bandwidth, remat: bool = True):
        self.remat = remat  # False: every stage stored whole, offloading only (no recomputation)
        self.c: SlotChain = discretise(costs, budget, slots)
        self.b: SlotChain = extend(costs)
        self.A, self.args = table(self.c)
        self.bw = bandwidth
        self.L, self.S, self.K = self.c.L, slots, self.c.K
        # h = 0: held on the device; h = 1: a_s offloaded; h = 2 + k: abar_{s-1} (option k) offloaded
        self.H = 2 + self.K
        groups: dict[tuple[int, int], int] = {(0, 0): 0}
        for held in self._all_held():
            groups.setdefault((held.slots, held.nbytes), len(groups))
        self.groups = groups
        self.g_slots = np.array([k[0] for k in groups], dtype=np.int64)
        self.g_time = np.array([k[1] for k in groups], dtype=np.float64) / bandwidth.to_device

    def held(self, s: int, h: int) -> Held | None:
        """Step ``s``'s held input when ``h`` offloads it (``None`` for ``h = 0`` or when ``h``
        does not exist at ``s``)."""
        c, b = self.c, self.b
        if h == 0 or s < 1 or s >= self.L:
            return None
        if h == 1:
            held = Held("a", s, 0, int(c.x[s]), int(b.x[s]))
        elif not np.isfinite(b.bwd[h - 2, s - 1]):
            return None  # stage s-1 has no option k
        else:
            k = h - 2
            held = Held("abar", s - 1, k, int(c.xbar[k, s - 1]), int(b.xbar[k, s - 1]))
        return held if held.nbytes > 0 else None

    def _all_held(self):
        for s in range(1, self.L):
            for h in range(1, self.H):
                held = self.held(s, h)
                if held is not None:
                    yield held

    def group(self, held: Held | None) -> int:
        return 0 if held is None else self.groups[(held.slots, held.nbytes)]

    def nested(self, s: int, t: int) -> np.ndarray:
        """``C(m, s, t)`` over ``m = 0..S`` (float64)."""
        return self.A[s, t - s, : self.S + 1].astype(np.float64)


def _shift(v: np.ndarray, by: int) -> np.ndarray:
    """``v[..., m - by]`` along the last axis, ``inf`` where ``m < by``."""
    out = np.full(v.shape, INF)
    n = v.shape[-1]
    if by < n:
        out[..., by:] = v[..., : n - by]
    return out


class _Step(NamedTuple):
    """One step of the DP from a stage (:func:`_steps`)."""

    choice: tuple  # ("store", option, offloads its bundle) or ("ck", next stored stage, offloads it)
    fwd_time: float  # the forward ops' time
    need: int  # slots the forward needs
    succ: tuple[int, int, int]  # the state it leads to: (stage, held input h', slots shifted)
    back: tuple[float, int] | None  # B s: (time, slots it needs); None: the nested table's


def _steps(p: _Problem, s: int, h: int):
    """Every :class:`_Step` from ``s`` with held input ``h``."""
    c, b = p.c, p.b
    held = p.held(s, h)
    tau = 0.0 if held is None else held.nbytes / p.bw.to_host
    extra = 0 if held is None else held.slots
    for k in range(p.K if p.remat else 1):
        if not np.isfinite(b.bwd[k, s]):
            continue
        if tau > b.fwd[s]:
            continue
        need = int(c.xbar[k, s] + c.fwd_tmp[s]) + extra
        for o in (0, 1):  # an offloaded bundle comes back whole: no credit for its unread output
            back = int(c.x[s] + c.x[s + 1] + c.xbar[k, s] + (c.bwd_tmp if o else c.bwd_need)[k, s])
            succ = (s + 1, 2 + k, 0) if o else (s + 1, 0, int(c.xbar[k, s]))
            yield _Step(("store", k, o), float(b.fwd[s]), need, succ, (float(b.bwd[k, s]), back))
    start, need = 0.0, 0
    for j in range(s + 1, p.L + 1 if p.remat else s + 1):
        q = j - 1
        own = int(c.x[s + 1] + c.fwd_tmp[s]) if q == s else int(c.x[q] + c.x[q + 1] + c.fwd_tmp[q])
        need = max(need, own + (extra if start < tau else 0), int(c.x[j]))
        start += float(b.fwd[q])
        if tau > start:
            continue
        for o in (0, 1):
            succ = (j, 1, 0) if o else (j, 0, int(c.x[j]))
            yield _Step(("ck", j, o), start, need, succ, None)


def fill(p: _Problem) -> list[np.ndarray]:
    """``W[s]``, an array ``(H, G, S + 1)`` per ``s = 0..L`` (``inf``: infeasible). Only the
    rows ``g`` a caller can pass are filled: the held inputs of steps before ``s``."""
    L, S, H, G = p.L, p.S, p.H, len(p.groups)
    m = np.arange(S + 1)
    W: list[np.ndarray] = [np.full((H, G, S + 1), INF) for _ in range(L + 1)]
    # the loss: needs x[L] free, with g's prefetch beside it (the loss itself takes no time)
    W[L][0] = np.where(m[None, :] >= p.c.x[L] + p.g_slots[:, None], p.g_time[:, None], INF)
    rows = {0}
    callers: list[np.ndarray] = []
    for s in range(L + 1):
        callers.append(np.array(sorted(rows)))
        rows.update(p.group(p.held(s, h)) for h in range(1, H))
    pad = np.full(S + 1, INF)
    for s in range(L - 1, -1, -1):
        g_rows = callers[s]
        g_slots, g_time = p.g_slots[g_rows], p.g_time[g_rows][:, None]
        for h in range(H):
            held = p.held(s, h)
            if h and held is None:
                continue
            gnext = p.group(held)
            p_slots = 0 if held is None else held.slots
            # row r of a backward over m_b = m - held - g_r: index into [inf * (S+1), C(., s, j-1)]
            index = np.clip(m[None, :] - p_slots - g_slots[:, None], -1 - S, S) + S + 1
            best = np.full((len(g_rows), S + 1), INF)
            tb, tb_of = None, None
            for choice, ftime, need, (j, h2, shift), bwd in _steps(p, s, h):
                if h2 and j >= L:
                    continue  # the loss's held input stays on the device
                succ = W[j][h2, gnext]
                if shift:
                    succ = _shift(succ, shift)
                succ = np.where(m >= need, succ, INF)
                if not np.isfinite(succ).any():
                    continue
                if tb_of != (choice[0], choice[1]):  # the same backward for both offload choices
                    tb_of = (choice[0], choice[1])
                    if bwd is not None:  # B s: a scalar time; memory: back, with held and g
                        t, back = bwd
                        tb = np.where(m[None, :] - p_slots - g_slots[:, None] >= back, np.maximum(t, g_time), INF)
                    else:  # a checkpointed segment's backward: C(m - held - g, s, j - 1)
                        tb = np.maximum(np.concatenate([pad, p.nested(s, j - 1)])[index], g_time)
                total = (ftime + succ)[None, :] + tb
                np.minimum(best, total, out=best)
            W[s][h, g_rows] = best
    return W


def rebuild(p: _Problem, W: list[np.ndarray]) -> list[Op]:
    """The op list of ``W[0][0, 0, S]``: re-evaluate each state's steps and take the first that
    reaches its value (no offload before offload, stored before checkpointed)."""
    ops: list[Op] = []

    def walk(s: int, h: int, g: Held | None, mm: int) -> None:
        target = W[s][h, p.group(g), mm]
        gs = 0 if g is None else g.slots
        gt = 0.0 if g is None else g.nbytes / p.bw.to_device
        prefetch = [] if g is None else [Op(OpKind.PREFETCH, g.stage, g.buffer)]
        if s == p.L:
            ops.extend(prefetch + [Op(OpKind.LOSS, p.L)])
            return
        held = p.held(s, h)
        p_slots = 0 if held is None else held.slots
        for choice, ftime, need, (j, h2, shift), bwd in _steps(p, s, h):
            if (h2 and j >= p.L) or mm < need or mm < shift:
                continue
            succ = W[j][h2, p.group(held), mm - shift]
            mb = mm - p_slots - gs
            if bwd is not None:
                t, back = bwd
                tb = max(t, gt) if mb >= back else INF
            else:
                tb = max(float(p.nested(s, j - 1)[mb]), gt) if mb >= 0 else INF
            total = ftime + succ + tb
            if not np.isfinite(total) or total > target * (1 + TOL) + TOL:
                continue
            kind, arg, o = choice
            if kind == "store":
                ops.append(Op(OpKind.FALL, s, arg))
                if o:
                    ops.append(Op(OpKind.OFFLOAD, s, "abar"))
            else:
                ops.extend([Op(OpKind.FCK, s)] + [Op(OpKind.FN, i) for i in range(s + 1, arg)])
                if o:
                    ops.append(Op(OpKind.OFFLOAD, arg, "a"))
            walk(j, h2, held, mm - shift)
            ops.extend(prefetch)
            if kind == "store":
                ops.append(Op(OpKind.B, s))
            else:
                ops.extend(rebuild_ops(p.A, p.args, root=(s, j - 1, mb)))
            return
        raise AssertionError(f"offload DP: no step reaches W[{s}][{h}] = {target} at m = {mm}")

    walk(0, 0, None, p.S)
    return ops


def offload_ops(
    costs: ChainCosts, budget: int, slots: int, bandwidth: Bandwidth, *, remat: bool = True
) -> tuple[list[Op] | None, float]:
    """The DP's op list and time for ``budget`` (``(None, inf)`` if nothing fits in slots).
    ``remat=False`` keeps to offloading alone: every stage stored whole, nothing recomputed."""
    if costs.held.any():
        # bytes held until a stage's backward: planned as held for the whole step (safe; the
        # replay releases them at each backward)
        budget, costs = int(budget) - int(costs.held.sum()), dataclasses.replace(costs, held=None)
    if int(budget) <= int(costs.x[0]):
        return None, INF
    p = _Problem(costs, budget, slots, bandwidth, remat)
    W = fill(p)
    best = float(W[0][0, 0, p.S])
    if not np.isfinite(best):
        return None, INF
    return rebuild(p, W), best


def solve_offload(
    costs: ChainCosts, budget: int, slots: int, bandwidth: Bandwidth, algorithm: str = "optimal_offload"
) -> Schedule:
    """The fastest schedule of the class above within ``budget``; never slower than
    ``"optimal"`` (whose schedule is taken when the DP in slots finds nothing faster)."""
    best: Schedule | None = None
    try:
        best = solve_optimal(costs, budget, slots, algorithm)
        best = Schedule.from_ops(
            costs, best.ops, budget=budget, algorithm=algorithm, note=best.note, bandwidth=bandwidth
        )
    except InfeasibleBudget:
        pass
    # Shared values are not modelled with transfers: the offload DP (which ignores them, a safe
    # over-count) is replayed as if each activation held its own copy of them.
    ops, _ = offload_ops(costs, budget, slots, bandwidth)
    if ops is not None:
        sched = Schedule.from_ops(costs.without_shared(), ops, budget=budget, algorithm=algorithm, bandwidth=bandwidth)
        if sched.peak > budget:
            raise AssertionError(f"offload DP schedule peaks at {sched.peak} bytes over the budget {budget}")
        if best is None or sched.time < best.time:
            best = sched
    if best is None:
        raise InfeasibleBudget(
            algorithm, budget, offload_min_budget(costs, slots, bandwidth), note=f"with {slots} slots"
        )
    return best


def offload_min_budget(costs: ChainCosts, slots: int, bandwidth: Bandwidth) -> int:
    """Smallest budget for which :func:`solve_offload` returns a schedule: at most
    ``"optimal"``'s, found by bisection below it (feasibility grows with the budget)."""
    hi = optimal_min_budget(costs, slots)
    x0 = int(costs.x[0])
    lo = x0  # nothing of positive size fits in x[0]
    feasible = lambda budget: offload_ops(costs, budget, slots, bandwidth)[0] is not None  # noqa: E731
    if hi - 1 <= lo or not feasible(hi - 1):
        return hi
    return bisect_least(lo, hi - 1, feasible)


__all__ = ["offload_min_budget", "offload_ops", "solve_offload"]
