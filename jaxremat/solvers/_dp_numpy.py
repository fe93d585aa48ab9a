"""A plain numpy transcription of the persistent DP of ``docs/cost_model.md`` (version 2: store
options, the fused forward-backward ``FB``, and shared values counted once).

Slow (Python loops over segments and splits) and written for reading: it is the reference the
jitted table fill of :mod:`jaxremat.solvers._dp_jax` is tested against, and the DP of chains
with shared values (``SlotChain.ov``), whose checkpoint option shifts ``C(j, t)`` by what
``a_j`` adds to the live ``a_s`` (``x[j] - ov[s, j]``), a shift that depends on the segment's
start and so does not fit the jitted fill's layout.
"""

from __future__ import annotations

import numpy as np

from jaxremat.core.ops import Op, OpKind
from jaxremat.solvers._discretise import SlotChain, base_need, base_time, forward_thresholds, store_need

Table = dict[tuple[int, int], np.ndarray]


def _overlap(c: SlotChain) -> np.ndarray:
    return np.zeros((c.L + 2, c.L + 2), np.int64) if c.ov is None else c.ov


def reference_table(c: SlotChain) -> Table:
    """``C[(s, t)]``: float64 vector over ``m = 0..S`` of the least time, ``inf`` if infeasible."""
    L, S = c.L, c.slots
    x, xb, ft = c.x, c.xbar, c.fwd_tmp
    fwd, bwd = c.fwd, c.bwd
    ov = _overlap(c)
    T = forward_thresholds(x, ft, L + 1, L + 1, c.ov)
    m = np.arange(S + 1)
    inf = np.full(S + 1, np.inf)

    def shifted(v: np.ndarray, by: int) -> np.ndarray:
        """``v[m - by]``, ``inf`` where ``m < by``."""
        out = inf.copy()
        if by <= S:
            out[by:] = v[: S + 1 - by]
        return out

    need, time = base_need(c), base_time(c)
    back, _ = store_need(c)
    xd = c.xd
    C: Table = {}
    for s in range(L + 1):
        # base: FB s, or Fall s k; B s for each option k (the loss, s = L, needs x[L])
        C[(s, s)] = np.min([np.where(m >= need[k, s], time[k, s], np.inf) for k in range(len(need))], axis=0)
    for d in range(1, L + 1):
        for s in range(L - d + 1):
            t = s + d
            best = inf.copy()
            for k in range(c.K):  # store all under option k: Fall s k, (s+1 .. t), B s
                ok = (m >= xd[t + 1] + xb[k, s] + ft[s]) & (m >= back[k, s])
                best = np.minimum(best, np.where(ok, fwd[s] + bwd[k, s] + shifted(C[(s + 1, t)], xb[k, s]), np.inf))
            for j in range(s + 1, t + 1):
                # Fck s, Fn s+1 .. Fn j-1 (thresholds T), then a_j kept: it adds what a_s lacks
                ok = m >= xd[t + 1] + T[s, j - s - 1]
                cost = fwd[s:j].sum() + shifted(C[(j, t)], x[j] - ov[s, j]) + C[(s, j - 1)]
                best = np.minimum(best, np.where(ok, cost, np.inf))
            C[(s, t)] = best
    return C


def reference_ops(c: SlotChain, C: Table) -> list[Op] | None:
    """The op list of the table ``C`` (from :func:`reference_table`) at ``m = S`` for the whole
    chain, ``None`` if it is infinite. Ties go as in :mod:`jaxremat.solvers._rebuild`: ``FB``,
    then the lowest option, in the base case; store-all before a checkpoint."""
    L, S = c.L, c.slots
    if not np.isfinite(C[(0, L)][S]):
        return None
    x, xb, ft = c.x, c.xbar, c.fwd_tmp
    ov = _overlap(c)
    T = forward_thresholds(x, ft, L + 1, L + 1, c.ov)
    need, time = base_need(c), base_time(c)
    back, _ = store_need(c)
    xd = c.xd
    K = c.K
    ops: list[Op] = []
    stack: list = [(0, L, S)]
    while stack:
        item = stack.pop()
        if isinstance(item, Op):
            ops.append(item)
            continue
        s, t, m = item
        if s == t:
            if s == L:
                ops.append(Op(OpKind.LOSS, L))
                continue
            t_k = np.where(m >= need[:, s], time[:, s], np.inf)
            k = K if t_k[K] == t_k.min() else int(np.argmin(t_k))
            ops.extend([Op(OpKind.FB, s)] if k == K else [Op(OpKind.FALL, s, k), Op(OpKind.B, s)])
            continue
        want = C[(s, t)][m]
        tol = 1e-12 * max(abs(want), 1.0)
        found = None
        for k in range(K):
            if m >= xd[t + 1] + xb[k, s] + ft[s] and m >= back[k, s] and m >= xb[k, s]:
                if c.fwd[s] + c.bwd[k, s] + C[(s + 1, t)][m - xb[k, s]] <= want + tol:
                    found = [Op(OpKind.B, s), (s + 1, t, m - int(xb[k, s])), Op(OpKind.FALL, s, k)]
                    break
        for j in range(s + 1, t + 1) if found is None else ():
            add = int(x[j] - ov[s, j])
            if m >= xd[t + 1] + T[s, j - s - 1] and m >= add:
                if c.fwd[s:j].sum() + C[(j, t)][m - add] + C[(s, j - 1)][m] <= want + tol:
                    fwd = [Op(OpKind.FCK, s)] + [Op(OpKind.FN, i) for i in range(s + 1, j)]
                    found = [(s, j - 1, m), (j, t, m - add)] + list(reversed(fwd))
                    break
        if found is None:
            raise AssertionError(f"DP table has no option reaching its value at s={s}, t={t}, m={m}")
        stack += found
    return ops
