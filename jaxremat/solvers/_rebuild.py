"""Rebuild the op list of the persistent DP from its filled table."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxremat.core.ops import Op, OpKind

TIE = 8 * float(np.finfo(np.float32).eps)


class _Node(NamedTuple):
    """The segment ``s .. t`` with ``m`` slots, still to expand."""

    s: int
    t: int
    m: int


def base_choice(args: dict[str, np.ndarray], s: int, m: int) -> int:
    """The base case's choice at ``(s, s)`` with ``m`` slots: an option ``k`` (``Fall s k; B s``)
    or ``K`` (``FB s``); on equal times ``FB`` (what XLA runs), then the lowest option."""
    need, time = args["base_need"][:, s], args["base_time"][:, s]
    ok = m >= need
    if not ok.any():
        raise AssertionError(f"DP table has no finite base option at s={s}, m={m}")
    t = np.where(ok, time, np.float32(np.inf))
    best = t.min()
    K = len(t) - 1
    return K if t[K] == best else int(np.argmax(t == best))


def rebuild_ops(A: np.ndarray, args: dict[str, np.ndarray], root: tuple[int, int, int] | None = None) -> list[Op]:
    """Walk the table ``A[s, t - s, m]`` from ``root`` (``(s, t, m)``; ``(0, L, S)`` by default)
    and emit the ops of the best option at every node.

    Options are evaluated with the same float32 arithmetic as the fill; any finite option is
    feasible by construction, so the walk never dead-ends on a finite root. With ``args["ov"]``
    (shared values, the numpy DP's table), a checkpoint ``a_j`` takes ``x[j] - ov[s, j]``.
    """
    L = int(args["L"])
    S = int(args["S"])
    x, xd, xbar, ftmp = args["x"], args["xd"], args["xbar"], args["fwd_tmp"]
    fb, thr, F = args["fb"], args["thr"], args["F"]
    K = xbar.shape[0]
    ov = args.get("ov")
    back = x[None, : L + 1] + x[None, 1 : L + 2] + xbar[:, : L + 1] + args["bwd_tmp"][:, : L + 1]
    ops: list[Op] = []
    stack: list[_Node | Op] = [_Node(0, L, S) if root is None else _Node(*root)]
    while stack:
        item = stack.pop()
        if isinstance(item, Op):
            ops.append(item)
            continue
        s, t, m = item
        if s == t:
            if s == L:
                ops.append(Op(OpKind.LOSS, L))
            else:
                k = base_choice(args, s, m)
                ops.extend([Op(OpKind.FB, s)] if k == K else [Op(OpKind.FALL, s, k), Op(OpKind.B, s)])
            continue
        d = t - s
        best, choice = np.float32(np.inf), None
        for k in range(K):
            if m >= xd[t + 1] + xbar[k, s] + ftmp[s] and m >= back[k, s] and m >= xbar[k, s]:
                v = fb[k, s] + A[s + 1, d - 1, m - xbar[k, s]]
                if v < best:
                    best, choice = v, ("store", k)
        q = np.arange(d)
        j = s + q + 1
        add = x[j] - (0 if ov is None else ov[s, j])  # what keeping a_j adds to the live a_s
        ok = (m >= add) & (m >= xd[t + 1] + thr[s, :d])
        if ok.any():
            q, j, add = q[ok], j[ok], add[ok]
            v = (A[s, q, m] + A[j, t - j, m - add]) + F[s, q]
            i = int(np.argmin(v))  # first (shortest left segment) among equals
            # a split must win by more than float32 rounding: on ties, store (no recomputation)
            if v[i] < (best - TIE * abs(best) if np.isfinite(best) else best):
                best, choice = v[i], ("ck", int(j[i]), int(add[i]))
        if choice is None:
            raise AssertionError(f"DP table has no finite option at s={s}, t={t}, m={m}")
        if choice[0] == "store":
            k = choice[1]
            stack += [Op(OpKind.B, s), _Node(s + 1, t, m - int(xbar[k, s])), Op(OpKind.FALL, s, k)]
        else:
            _, j, add_j = choice
            fwd = [Op(OpKind.FCK, s)] + [Op(OpKind.FN, i) for i in range(s + 1, j)]
            stack += [_Node(s, j - 1, m), _Node(j, t, m - add_j)]
            stack += list(reversed(fwd))
    return ops
