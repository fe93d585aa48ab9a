"""A plain numpy transcription of the persistent DP of ``docs/cost_model.md`` (version 2: store
options and the fused forward-backward ``FB``).

Slow (Python loops over segments and splits) and written for reading: it is the reference the
jitted table fill of :mod:`jaxremat.solvers._dp_jax` is tested against.
"""

from __future__ import annotations

import numpy as np

from jaxremat.solvers._discretise import SlotChain, base_need, base_time, store_need


def reference_table(c: SlotChain) -> dict[tuple[int, int], np.ndarray]:
    """``C[(s, t)]``: float64 vector over ``m = 0..S`` of the least time, ``inf`` if infeasible."""
    L, S = c.L, c.slots
    x, xb, ft = c.x, c.xbar, c.fwd_tmp
    fwd, bwd = c.fwd, c.bwd
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
    C: dict[tuple[int, int], np.ndarray] = {}
    for s in range(L + 1):
        # base: FB s, or Fall s k; B s for each option k (the loss, s = L, needs x[L])
        C[(s, s)] = np.min([np.where(m >= need[k, s], time[k, s], np.inf) for k in range(len(need))], axis=0)
    for d in range(1, L + 1):
        for s in range(L - d + 1):
            t = s + d
            best = inf.copy()
            for k in range(c.K):  # store all under option k: Fall s k, (s+1 .. t), B s
                ok = (m >= x[t + 1] + xb[k, s] + ft[s]) & (m >= back[k, s])
                best = np.minimum(best, np.where(ok, fwd[s] + bwd[k, s] + shifted(C[(s + 1, t)], xb[k, s]), np.inf))
            for j in range(s + 1, t + 1):
                ok = m >= x[t + 1] + x[s + 1] + ft[s]
                for q in range(s + 1, j):
                    ok &= m >= x[t + 1] + x[q] + x[q + 1] + ft[q]
                ok &= m >= x[j]
                cost = fwd[s:j].sum() + shifted(C[(j, t)], x[j]) + C[(s, j - 1)]
                best = np.minimum(best, np.where(ok, cost, np.inf))
            C[(s, t)] = best
    return C
