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

from jaxremat.core.ops import Op
from jaxremat.solvers._discretise import SlotChain, base_need, base_time, forward_thresholds, store_need
from jaxremat.solvers._dp_jax import prepare
from jaxremat.solvers._rebuild import rebuild_ops

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
    chain, ``None`` if it is infinite: the jitted table's walk
    (:func:`~jaxremat.solvers._rebuild.rebuild_ops`) over ``C`` laid out as that table."""
    L, S = c.L, c.slots
    if not np.isfinite(C[(0, L)][S]):
        return None
    args = prepare(c)
    args["thr"] = forward_thresholds(c.x, c.fwd_tmp, *args["thr"].shape, c.ov)
    args["ov"] = _overlap(c)
    A = np.full((L + 1, L + 1, S + 1), np.inf)
    for (s, t), v in C.items():
        A[s, t - s] = v
    return rebuild_ops(A, args)
