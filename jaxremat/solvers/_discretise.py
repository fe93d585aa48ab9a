"""Sizes in slots, the per-segment forward thresholds, and the least memory of persistent schedules.

The dynamic program works on a chain extended with the loss as stage ``L``: ``x[L+1] = 0`` and
stage ``L`` has zero store-all size, times and temporaries, so the base case ``s == t == L``
reads "the loss needs ``x[L]`` free". All arrays here use that extension.

Store options (``docs/cost_model.md``) are a leading axis ``K`` of ``xbar``, ``bwd`` and
``bwd_tmp``; a stage with fewer options has the missing ones at :data:`ABSENT` bytes (they never
fit) and infinite time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxremat.core.costs import ChainCosts


ABSENT = np.iinfo(np.int64).max // 16  # the size of a store option a stage does not have


@dataclass(frozen=True, eq=False)
class SlotChain:
    """A chain's sizes in whole slots (or in bytes when ``slots`` is None), extended by the loss.

    ``x`` has ``L+2`` entries; ``xbar``, ``bwd_tmp`` and ``bwd`` are ``(K, L+1)`` (one row per
    store option), the others ``L+1``; sizes above ``slots`` are clipped to ``slots + 1`` (they
    can never fit, and clipping keeps sums small).
    """

    L: int
    slots: int | None
    x: np.ndarray
    xbar: np.ndarray  # (K, L+1)
    fwd_tmp: np.ndarray
    bwd_tmp: np.ndarray  # (K, L+1)
    bwd_need: np.ndarray  # (K, L+1): bwd_tmp less the output bytes B does not read (the store-all branch)
    fwd: np.ndarray  # float64, L+1
    bwd: np.ndarray  # float64, (K, L+1); inf where a stage lacks the option
    fb: np.ndarray  # float64, L+1: time of FB s
    fb_tmp: np.ndarray  # L+1: bytes of FB s beyond a_s, delta_{s+1}, delta_s
    ov: np.ndarray | None = None  # (L+2, L+2): bytes a_p and a_q share (rounded down); None: nothing shared
    P: np.ndarray | None = None  # L+2: ChainCosts.held_before (rounded up); None: nothing held

    @property
    def held(self) -> np.ndarray:
        """``P[n]`` (zeros when nothing is held): held while stage ``n``'s backward runs, and
        while forward ops run before the backward of stage ``n - 1``."""
        return np.zeros(self.L + 2, np.int64) if self.P is None else self.P

    @property
    def xd(self) -> np.ndarray:
        """``x[n] + P[n]``: what ``δ_n`` and the held bytes take while the segment ending at
        stage ``n - 1`` runs its forward ops (the DP's ``x[t+1]`` in every forward check)."""
        return self.x + self.held

    @property
    def K(self) -> int:
        return self.xbar.shape[0]


def _ceil_slots(sizes: np.ndarray, mem: int, slots: int) -> np.ndarray:
    """``ceil(size * slots / mem)`` in exact integer arithmetic, clipped to ``slots + 1``."""
    sizes = np.asarray(sizes, dtype=np.int64)
    if mem <= 0:
        return np.where(sizes == 0, 0, slots + 1).astype(np.int64)
    if int(sizes.max(initial=0)) < (1 << 62) // max(slots, 1):  # exact in int64
        return np.minimum(-((-sizes * slots) // mem), slots + 1)
    out = [min(-((-int(v) * slots) // mem), slots + 1) for v in sizes.ravel()]
    return np.array(out, dtype=np.int64).reshape(sizes.shape)


def extend(costs: ChainCosts) -> SlotChain:
    """The chain in bytes, extended by the loss stage (which has option 0 only, all zeros)."""
    z = np.zeros(1, dtype=np.int64)
    zf = np.zeros(1)
    xbar, bwd, bwd_tmp, unread, exists = costs.option_arrays()
    K = xbar.shape[0]
    loss = np.zeros((K, 1), bool)
    loss[0] = True
    exists = np.concatenate([exists, loss], axis=1)
    pad = lambda a, dtype: np.concatenate([a, np.zeros((K, 1), dtype)], axis=1)  # noqa: E731
    return SlotChain(
        L=costs.length,
        slots=None,
        x=np.concatenate([costs.x, z]),
        xbar=np.where(exists, pad(xbar, np.int64), ABSENT),
        fwd_tmp=np.concatenate([costs.fwd_tmp, z]),
        bwd_tmp=np.where(exists, pad(bwd_tmp, np.int64), ABSENT),
        bwd_need=np.where(exists, pad(bwd_tmp - unread, np.int64), ABSENT),
        fwd=np.concatenate([costs.fwd, zf]),
        bwd=np.where(exists, pad(bwd, np.float64), np.inf),
        fb=np.concatenate([costs.fb, zf]),
        fb_tmp=np.concatenate([costs.fb_tmp, z]),
        ov=np.pad(costs.overlap, (0, 1)) if costs.shared else None,
        P=np.array(costs.held_before) if costs.held.any() else None,
    )


def discretise(costs: ChainCosts, budget: int, slots: int) -> SlotChain:
    """Sizes in slots of ``(budget - x[0]) / slots`` bytes, every size rounded up."""
    b = extend(costs)
    mem = int(budget) - int(costs.x[0])
    x = _ceil_slots(b.x, mem, slots)
    ov = None
    if b.ov is not None:
        # the DP subtracts ov[p, q] from x[q]: round the difference up (x[q] - ov[p, q] bytes, in
        # slots), not each term, so that a size clipped at slots + 1 stays out of reach
        ov = np.maximum(x[None, :] - _ceil_slots(b.x[None, :] - b.ov, mem, slots), 0)
    return SlotChain(
        L=b.L,
        slots=slots,
        x=x,
        xbar=_ceil_slots(b.xbar, mem, slots),
        fwd_tmp=_ceil_slots(b.fwd_tmp, mem, slots),
        bwd_tmp=_ceil_slots(b.bwd_tmp, mem, slots),
        bwd_need=_ceil_slots(b.bwd_need, mem, slots),
        fwd=b.fwd,
        bwd=b.bwd,
        fb=b.fb,
        fb_tmp=_ceil_slots(b.fb_tmp, mem, slots),
        ov=ov,
        P=None if b.P is None else _ceil_slots(b.P, mem, slots),
    )


def base_need(c: SlotChain) -> np.ndarray:
    """``(K + 1, L + 1)``: the memory the base case ``s == t`` needs with each store option
    (``Fall s k; B s``, rows ``0 .. K-1``) and with ``FB s`` (row ``K``), ``δ_{s+1}`` included."""
    s = np.arange(c.L + 1)
    x0, x1, P = c.x[s], c.x[s + 1], c.held
    stored = np.maximum(x1 + c.xbar + c.fwd_tmp + P[s + 1], x0 + x1 + c.xbar + c.bwd_tmp + P[s])
    return np.concatenate([stored, (x1 + x0 + c.fb_tmp + P[s])[None, :]])


def base_time(c: SlotChain) -> np.ndarray:
    """``(K + 1, L + 1)``: the base case's time with each store option and with ``FB s``."""
    return np.concatenate([c.fwd[None, :] + c.bwd, c.fb[None, :]])


def store_need(c: SlotChain) -> tuple[np.ndarray, np.ndarray]:
    """For the store-all branch of ``(s, t)`` with option ``k``: ``(K, L+1)`` memory the
    backward ``B s`` needs (``x[s] + x[s+1] + xbar + bwd_tmp - unread``: the segment's backwards
    and the loss read the bundle's output before it; and what is held then: ``P[s]``),
    and the forward's need beyond
    ``x[t+1]`` (``xbar + fwd_tmp``)."""
    s = np.arange(c.L + 1)
    return c.x[s] + c.x[s + 1] + c.xbar + c.bwd_need + c.held[s], c.xbar + c.fwd_tmp


def forward_thresholds(
    x: np.ndarray, fwd_tmp: np.ndarray, rows: int, cols: int, ov: np.ndarray | None = None
) -> np.ndarray:
    """``T[s, k]``: memory the forwards ``Fck s, Fn s+1 .. Fn s+k`` need beyond ``δ_{t+1}``.

    ``T[s, k] = max(x[s+1] + fwd_tmp[s], max_{1<=q<=k} x[s+q] + x[s+q+1] + fwd_tmp[s+q])``:
    the checkpoint option ``j = s + k + 1`` of the DP is allowed iff ``m >= x[t+1] + T[s, k]``.
    With shared values (``ov``), each activation counts only what is not already live: ``a_{s+q}``
    less what it shares with the held ``a_s``, ``a_{s+q+1}`` less what it shares with ``a_{s+q}``
    (a value shared with ``a_s`` and ``a_{s+q+1}`` is in ``a_{s+q}`` too: values span runs of
    activations). Entries past the chain's end are filled with clipped indices and never used.
    """
    n = len(fwd_tmp)
    xi = lambda i: x[np.minimum(i, len(x) - 1)]  # noqa: E731
    fi = lambda i: fwd_tmp[np.minimum(i, n - 1)]  # noqa: E731
    s = np.arange(rows)[:, None]
    q = np.arange(cols)[None, :]
    w = xi(s + q) + xi(s + q + 1) + fi(s + q)
    u = xi(s + 1) + fi(s)
    if ov is not None:
        oi = lambda p, r: ov[np.minimum(p, len(ov) - 1), np.minimum(r, len(ov) - 1)]  # noqa: E731
        w = w - oi(s, s + q) - oi(s + q, s + q + 1)
        u = u - oi(s, s + 1)
    w = np.where(q == 0, u, w)
    return np.maximum.accumulate(w, axis=1)


def forward_times(fwd: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """``F[s, k] = fwd[s] + ... + fwd[s+k]`` (float64; indices past the end clipped)."""
    prefix = np.concatenate([[0.0], np.cumsum(fwd)])
    s = np.arange(rows)[:, None]
    k = np.arange(cols)[None, :]
    hi = np.minimum(s + k + 1, len(prefix) - 1)
    lo = np.minimum(s, len(prefix) - 1)
    return prefix[hi] - prefix[lo]


def bisect_least(lo: int, hi: int, feasible) -> int:
    """The least budget in ``(lo, hi]`` that is ``feasible``, given ``lo`` infeasible, ``hi``
    feasible, and feasibility growing with the budget."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if feasible(mid):
            hi = mid
        else:
            lo = mid
    return hi


def least_memory(c: SlotChain) -> int:
    """Least memory (in ``c``'s units, beyond ``a_0``) that any persistent schedule needs.

    Same feasibility conditions as the time DP, with times dropped: ``need(s, t)`` is the least
    ``m`` with ``C(m, s, t)`` finite. Exact in the units given (bytes or slots).
    """
    L = c.L
    x, xb, ft = c.x, c.xbar, c.fwd_tmp
    T = forward_thresholds(x, ft, L + 1, L + 1, c.ov)
    ov = np.zeros((L + 2, L + 2), np.int64) if c.ov is None else c.ov
    big = np.iinfo(np.int64).max // 8
    need = np.full((L + 2, L + 2), big, dtype=np.int64)  # need[s, length]
    s_all = np.arange(L + 1)
    back, fwd_need = store_need(c)  # (K, L+1) each
    need[s_all, 0] = base_need(c).min(axis=0)
    for d in range(1, L + 1):
        s = np.arange(L - d + 1)
        t = s + d
        xd = c.xd
        sa = np.maximum(
            np.maximum(xd[t + 1][None, :] + fwd_need[:, s], back[:, s]),
            xb[:, s] + need[s + 1, d - 1][None, :],
        ).min(axis=0)
        k = np.arange(d)[None, :]
        j = s[:, None] + k + 1
        ck = np.maximum(
            np.maximum(xd[t + 1][:, None] + T[s[:, None], k], x[j] - ov[s[:, None], j] + need[j, d - 1 - k]),
            need[s[:, None], k],
        )
        need[s, d] = np.minimum(sa, ck.min(axis=1))
    return int(need[0, L])
