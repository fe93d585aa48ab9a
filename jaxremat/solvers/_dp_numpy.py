"""A plain numpy transcription of the persistent DP of ``docs/cost_model.md``.

Slow (Python loops over segments and splits) and written for reading: it is the reference the
jitted table fill of :mod:`jaxremat.solvers.dp_jax` is tested against.
"""

from __future__ import annotations

import numpy as np

from jaxremat.solvers._discretise import SlotChain


def reference_table(c: SlotChain) -> dict[tuple[int, int], np.ndarray]:
    """``C[(s, t)]``: float64 vector over ``m = 0..S`` of the least time, ``inf`` if infeasible."""
    L, S = c.L, c.slots
    x, xb, ft, bt = c.x, c.xbar, c.fwd_tmp, c.bwd_tmp
    fwd, bwd = c.fwd, c.bwd
    m = np.arange(S + 1)
    inf = np.full(S + 1, np.inf)

    def shifted(v: np.ndarray, by: int) -> np.ndarray:
        """``v[m - by]``, ``inf`` where ``m < by``."""
        out = inf.copy()
        if by <= S:
            out[by:] = v[: S + 1 - by]
        return out

    C: dict[tuple[int, int], np.ndarray] = {}
    for s in range(L + 1):
        ok = (m >= x[s + 1] + xb[s] + ft[s]) & (m >= x[s] + x[s + 1] + xb[s] + bt[s])
        C[(s, s)] = np.where(ok, fwd[s] + bwd[s], np.inf)
    for d in range(1, L + 1):
        for s in range(L - d + 1):
            t = s + d
            ok = (m >= x[t + 1] + xb[s] + ft[s]) & (m >= x[s] + x[s + 1] + xb[s] + bt[s])
            best = np.where(ok, fwd[s] + bwd[s] + shifted(C[(s + 1, t)], xb[s]), np.inf)
            for j in range(s + 1, t + 1):
                ok = m >= x[t + 1] + x[s + 1] + ft[s]
                for k in range(s + 1, j):
                    ok &= m >= x[t + 1] + x[k] + x[k + 1] + ft[k]
                ok &= m >= x[j]
                cost = fwd[s:j].sum() + shifted(C[(j, t)], x[j]) + C[(s, j - 1)]
                best = np.minimum(best, np.where(ok, cost, np.inf))
            C[(s, t)] = best
    return C
