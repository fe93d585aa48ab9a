"""The strategies people use by hand, as op lists under the same rules.

* ``store_all``: keep every stage's residuals (plain autodiff).
* ``every_stage``: keep every stage's input, recompute each stage once right before its
  backward, fused with it (``FB``; ``jax.checkpoint`` / ``nn.remat`` around every stage).
* ``sqrt``: about ``sqrt(L)`` evenly spaced checkpoints; each segment is recomputed storing all
  (``jax.checkpoint`` around every ``k`` stages).
* ``revolve``: binomial checkpointing (Griewank & Walther) with as many snapshots as the budget
  allows, each snapshot sized by the largest activation.
* ``recompute_all``: keep only the chain input; before each stage's backward, recompute its
  input from ``a_0`` (the least memory of these, quadratic time).
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from jaxremat.core.ops import Op, OpKind, store_all_ops


def _base(i: int, L: int) -> list[Op]:
    """The backward of stage ``i`` (or the loss) right after its input is recomputed: ``FB i``."""
    return [Op(OpKind.LOSS, L)] if i == L else [Op(OpKind.FB, i)]


def _advance(s: int, j: int) -> list[Op]:
    """From a held ``a_s`` to a standalone ``a_j`` (``s < j``), keeping ``a_s``."""
    return [Op(OpKind.FCK, s)] + [Op(OpKind.FN, i) for i in range(s + 1, j)]


def store_all(L: int) -> list[Op]:
    return store_all_ops(L)


def segments(L: int, starts: list[int]) -> list[Op]:
    """Checkpoint the input of each segment; recompute each segment storing all before its
    backward, its last stage fused with its backward (``FB``: what XLA runs for
    ``jax.checkpoint`` around the segment)."""
    bounds = sorted(set(starts) | {0}) + [L]
    ops: list[Op] = []
    for b, e in zip(bounds, bounds[1:]):
        ops += _advance(b, e)
    ops.append(Op(OpKind.LOSS, L))
    for b, e in reversed(list(zip(bounds, bounds[1:]))):
        ops += [Op(OpKind.FALL, i) for i in range(b, e - 1)] + [Op(OpKind.FB, e - 1)]
        ops += [Op(OpKind.B, i) for i in reversed(range(b, e - 1))]
    return ops


def every_stage(L: int) -> list[Op]:
    return segments(L, list(range(L)))


def sqrt_segments(L: int) -> list[Op]:
    n = max(1, round(math.sqrt(L)))
    return segments(L, [round(q * L / n) for q in range(n)])


@lru_cache(maxsize=64)
def _betas(snaps: int, limit: int) -> np.ndarray:
    """``beta(snaps, r) = C(snaps + r, snaps)`` for r = 0, 1, ... until it reaches ``limit``."""
    out = [1]
    r = 0
    while out[-1] < limit:
        r += 1
        out.append(math.comb(snaps + r, snaps))
    return np.array(out, dtype=np.int64)


def revolve_forwards(n: np.ndarray, c: int) -> np.ndarray:
    """Forward ops (unit cost) to reverse ``n`` steps from a held input with ``c`` extra snapshots.

    Griewank's count ``t(n, s) = r n - beta(s + 1, r - 1)`` of advances with ``s = c + 1``
    snapshots, plus the ``n`` taping forwards.
    """
    n = np.asarray(n, dtype=np.int64)
    snaps = c + 1
    limit = int(n.max()) if n.size else 1
    betas = _betas(snaps, max(limit, 1))
    r = np.searchsorted(betas, n, side="left")
    # beta(snaps + 1, r - 1) = C(snaps + r, snaps + 1), zero for r = 0
    prev = np.array([math.comb(snaps + int(v), snaps + 1) if v >= 1 else 0 for v in r.ravel()], dtype=np.int64)
    prev = prev.reshape(r.shape)
    return r * n - prev + n


def revolve(L: int, snapshots: int) -> list[Op]:
    """Binomial checkpointing of the chain plus its loss (``L + 1`` unit steps)."""
    ops: list[Op] = []

    def reverse(s: int, t: int, c: int) -> None:
        n = t - s + 1
        if n == 1:
            ops.extend(_base(s, L))
            return
        if c == 0:
            for i in range(t, s - 1, -1):
                if i > s:
                    ops.extend(_advance(s, i))
                ops.extend(_base(i, L))
            return
        m = np.arange(1, n)
        cost = m + revolve_forwards(n - m, c - 1) + revolve_forwards(m, c)
        j = s + int(m[int(np.argmin(cost))])
        ops.extend(_advance(s, j))
        reverse(j, t, c - 1)
        reverse(s, j - 1, c)

    reverse(0, L, max(0, min(snapshots, L)))
    return ops


def recompute_all(L: int) -> list[Op]:
    return revolve(L, 0)


FIXED = {
    "store_all": store_all,
    "every_stage": every_stage,
    "sqrt": sqrt_segments,
    "recompute_all": recompute_all,
}
