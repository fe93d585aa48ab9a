"""One loop over a Repeat's copies in which each copy is stored or recomputed, chosen per copy.

A schedule that stores some copies of a repeated block and checkpoints the others one by one
(``Fall`` for the first, ``Fck``/recompute for the second) need not repeat a pattern to run as a
loop: :func:`selective_scan` runs all ``n`` copies as one forward ``lax.scan`` and one backward
``lax.scan``, whatever the order of stored and recomputed copies, and compiles one block body
forward and one backward (as ``nn.scan(nn.remat(block))`` does), where a loop over a pattern
of ``k`` copies compiles ``k`` of each.

Forward: every iteration takes the block's ``jax.vjp``; the residuals that are not the block's
inputs go into buffers of ``k`` rows, one per stored copy (a checkpointed copy's write is
masked: it writes a row back unchanged, so no scratch row is needed), and every copy's input is saved (the schedule
keeps it: a checkpoint, or
``a_i``, which ``B i`` needs). Backward: each iteration reads its residuals from the buffer or,
for a checkpointed copy, recomputes them from its saved input (a ``lax.cond``), then applies the
pullback rebuilt from them. Residuals that are inputs (parameters, the input) are not stored:
they are taken from the stacked parameters and the saved inputs.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxremat.run._copies import Linearised, Step, fill, inexact, replay


def selective_scan(step: Step, flags: Sequence[bool], stacked: Any, a: Any, keys: Any) -> tuple[Any, Any]:
    """Run ``step(p, keys, a, u) -> (a, updates)`` over the ``n = len(flags)`` slices ``p`` of
    ``stacked`` (leading axis ``n``; ``u`` the slice's index); returns the last output and the
    updates stacked over the copies. Under ``jax.grad``, copy ``u`` keeps its residuals when
    ``flags[u]`` and otherwise only its input, being recomputed when the backward pass reaches it.
    """
    flags = tuple(bool(f) for f in flags)
    n, k = len(flags), sum(flags)
    # a checkpointed copy's write is masked, onto row 0 (unchanged): no scratch row
    slots = np.where(flags, np.cumsum(flags) - 1, 0).astype(np.int32)
    traced: list[Linearised] = []
    step = replay(step, jax.tree.map(lambda t: t[0], stacked), keys, a, jnp.int32(0))[0]

    def plain(stacked: Any, keys: Any, a: Any) -> tuple[Any, Any]:
        return lax.scan(lambda a, xs: step(xs[0], keys, a, xs[1]), a, (stacked, jnp.arange(n)))

    @jax.custom_vjp
    def loop(stacked: Any, keys: Any, a: Any) -> tuple[Any, Any]:
        return plain(stacked, keys, a)

    def fwd(stacked: Any, keys: Any, a: Any) -> tuple[tuple[Any, Any], tuple]:
        lin = Linearised.trace(step, jax.tree.map(lambda t: t[0], stacked), keys, a)
        traced.append(lin)
        bufs = [jnp.zeros((k, size), dtype) for dtype, size in lin.layout.buffers]

        def body(carry: tuple, xs: tuple) -> tuple[tuple, tuple]:
            a, bufs = carry
            p, u, slot, keep = xs
            out, updates, stored = lin.run(p, keys, a, u)
            return (out, lin.layout.write(bufs, lin.keys.encode(stored), slot, keep)), (a, updates)

        (out, bufs), (inputs, updates) = lax.scan(body, (a, bufs), (stacked, jnp.arange(n), slots, jnp.asarray(flags)))
        return (out, updates), (stacked, keys, inputs, bufs)

    def bwd(res: tuple, g: tuple[Any, Any]) -> tuple:
        stacked, keys, inputs, bufs = res
        lin = traced[-1]
        a_leaves, a_tree = jax.tree.flatten(jax.tree.map(lambda t: t[0], inputs))
        p_leaves = jax.tree.leaves(stacked)
        a_diff = [inexact(leaf) for leaf in a_leaves]
        p_diff = [inexact(leaf) for leaf in p_leaves]
        g_carry = [c for c, d in zip(jax.tree.leaves(g[0]), a_diff) if d]

        def body(g: list, xs: tuple) -> tuple[list, list]:
            p, a, u, stored, slot = xs

            def recompute() -> list:
                return lin.pack(lin.run(p, keys, a, u)[2])

            def load() -> list:
                return [lax.dynamic_index_in_dim(b, slot, 0, keepdims=False) for b in bufs]

            pull = lin.pullback(lin.unpack(lax.cond(stored, load, recompute)), p, a)
            d = pull(jax.tree.unflatten(a_tree, fill(g, a_diff, a_leaves)))
            return list(d[sum(p_diff) :]), list(d[: sum(p_diff)])

        ga, dp = lax.scan(body, g_carry, (stacked, inputs, jnp.arange(n), jnp.asarray(flags), slots), reverse=True)
        d_stacked = jax.tree.structure(stacked).unflatten(fill(dp, p_diff, p_leaves))
        return d_stacked, None, a_tree.unflatten(fill(ga, a_diff, a_leaves))

    loop.defvjp(fwd, bwd)
    return loop(stacked, keys, a)


__all__ = ["selective_scan"]
