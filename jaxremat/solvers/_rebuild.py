"""Rebuild the op list of the persistent DP from its filled table."""

from __future__ import annotations

import numpy as np

from jaxremat.core.ops import Op, OpKind

TIE = 8 * float(np.finfo(np.float32).eps)


def rebuild_ops(A: np.ndarray, args: dict[str, np.ndarray]) -> list[Op]:
    """Walk the table ``A[s, t - s, m]`` from ``(0, L, S)`` and emit the ops of the best option at every node.

    Options are evaluated with the same float32 arithmetic as the fill; any finite option is
    feasible by construction, so the walk never dead-ends on a finite root.
    """
    L = int(args["L"])
    S = int(args["S"])
    x, xbar, ftmp = args["x"], args["xbar"], args["fwd_tmp"]
    fb, thr, F = args["fb"], args["thr"], args["F"]
    back = x[: L + 1] + x[1 : L + 2] + xbar[: L + 1] + args["bwd_tmp"][: L + 1]
    ops: list[Op] = []
    stack: list[tuple] = [("node", 0, L, S)]
    while stack:
        item = stack.pop()
        if item[0] == "op":
            ops.append(item[1])
            continue
        _, s, t, m = item
        if s == t:
            ops.extend([Op(OpKind.LOSS, L)] if s == L else [Op(OpKind.FALL, s), Op(OpKind.B, s)])
            continue
        d = t - s
        best, choice = np.float32(np.inf), None
        if m >= x[t + 1] + xbar[s] + ftmp[s] and m >= back[s] and m >= xbar[s]:
            v = fb[s] + A[s + 1, d - 1, m - xbar[s]]
            if v < best:
                best, choice = v, ("store",)
        k = np.arange(d)
        j = s + k + 1
        ok = (m >= x[j]) & (m >= x[t + 1] + thr[s, :d])
        if ok.any():
            k, j = k[ok], j[ok]
            v = (A[s, k, m] + A[j, t - j, m - x[j]]) + F[s, k]
            i = int(np.argmin(v))  # first (shortest left segment) among equals
            # a split must win by more than float32 rounding: on ties, store (no recomputation)
            if v[i] < (best - TIE * abs(best) if np.isfinite(best) else best):
                best, choice = v[i], ("ck", int(j[i]))
        if choice is None:
            raise AssertionError(f"DP table has no finite option at s={s}, t={t}, m={m}")
        if choice[0] == "store":
            stack += [("op", Op(OpKind.B, s)), ("node", s + 1, t, m - int(xbar[s])), ("op", Op(OpKind.FALL, s))]
        else:
            j = choice[1]
            fwd = [Op(OpKind.FCK, s)] + [Op(OpKind.FN, i) for i in range(s + 1, j)]
            stack += [("node", s, j - 1, m), ("node", j, t, m - int(x[j]))]
            stack += [("op", op) for op in reversed(fwd)]
    return ops
