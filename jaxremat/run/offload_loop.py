"""A Repeat's copies run as loops when the schedule moves some of their buffers to host memory.

The selective loop (:mod:`jaxremat.run.selective`) keeps one residual buffer that every copy
writes into, a checkpointed copy's write masked. A buffer in host memory cannot be written that
way: a masked write reads the row back, and on a GPU XLA's host-offload passes only move
whole, unconditional writes. So a Repeat whose schedule offloads something runs as
:func:`offload_scan`: its copies, each stored alone (under any store option) or checkpointed
alone, are cut into *segments* of consecutive copies treated alike (:class:`CopyKind`: stored
under the same option or checkpointed, input and bundle in the same memory), and each segment
is one forward ``lax.scan`` and one backward ``lax.scan``. Inside a segment every iteration
does the same thing, so the transfers are plain scan outputs and inputs: the forward writes
each copy's input ``a_i`` and bundle ``abar_i`` as a row of a scan output, moved to
``jax.memory.Space.Host`` when the schedule offloads it (the pattern XLA offloads scan
residuals by), and the backward reads the row back with ``Space.Device`` before its pullback.

The segments index the Repeat's stacked variables by the copy's position (no slice, so no copy
of the parameters), and the backward accumulates the stacked gradient in one carried buffer,
each iteration writing its copy's row. One block body is compiled per segment, forward and
backward; schedules from ``"optimal_offload"`` usually make a few segments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jaxremat.run._offload import to_device, to_host
from jaxremat.run.loop_plan import CopyKind
from jaxremat.run._copies import Linearised, Step, fill, inexact, replay


@dataclass(frozen=True)
class Segment:
    """Copies ``lo .. hi - 1`` of the loop, all of kind ``kind``."""

    lo: int
    hi: int
    kind: CopyKind


def segments(kinds: Sequence[CopyKind]) -> tuple[Segment, ...]:
    """``kinds`` cut into maximal runs of equal kinds."""
    out: list[Segment] = []
    for u, kind in enumerate(kinds):
        if out and out[-1].kind == kind:
            out[-1] = Segment(out[-1].lo, u + 1, kind)
        else:
            out.append(Segment(u, u + 1, kind))
    return tuple(out)


def _row(tree: Any, u: jax.Array) -> Any:
    return jax.tree.map(lambda t: lax.dynamic_index_in_dim(t, u, 0, keepdims=False), tree)


def offload_scan(
    step_for: Callable[[int], Step], kinds: Sequence[CopyKind], stacked: Any, a: Any, keys: Any
) -> tuple[Any, Any]:
    """Run ``step(p, keys, a, u) -> (a, updates)`` over the ``n = len(kinds)`` slices ``p`` of
    ``stacked`` (leading axis ``n``; ``u`` the slice's index), copy ``u`` as ``kinds[u]`` says;
    ``step_for(option)`` is the step under that store option (0: every residual kept). Returns
    the last output and the updates stacked over the copies."""
    kinds = tuple(kinds)
    segs = segments(kinds)
    p0 = _row(stacked, jnp.int32(0))
    steps = {k: replay(step_for(k), p0, keys, a, jnp.int32(0))[0] for k in sorted({s.kind.option for s in segs})}
    # a copy's residuals are stacked and moved as they are (PRNG keys as their data), not packed
    # into one row per dtype as in the selective loop: the packing concatenate is not written in
    # place into the scan's output, one more copy of the residuals (6 of 27 MiB on an 8-block GPT)
    traced: dict[int, Linearised] = {}

    def linearised(option: int, a: Any) -> Linearised:
        if option not in traced:
            traced[option] = Linearised.trace(steps[option], p0, keys, a)
        return traced[option]

    @jax.custom_vjp
    def loop(stacked: Any, keys: Any, a: Any) -> tuple[Any, Any]:
        # without a gradient nothing is kept or moved: one scan over every copy
        return lax.scan(lambda a, u: steps[0](_row(stacked, u), keys, a, u), a, jnp.arange(len(kinds)))

    def fwd(stacked: Any, keys: Any, a: Any) -> tuple[tuple[Any, Any], tuple]:
        saved, parts = [], []
        for seg in segs:
            kind = seg.kind
            lin = linearised(kind.option if kind.stored else 0, a)

            def body(a: Any, u: jax.Array, kind: CopyKind = kind, lin: Linearised = lin) -> tuple[Any, tuple]:
                p = _row(stacked, u)
                inp = to_host(a) if kind.host_input else a
                if not kind.stored:
                    out, updates = steps[0](p, keys, a, u)
                    return out, (inp, [], updates)
                out, updates, stored = lin.run(p, keys, a, u)
                row = lin.keys.encode(stored)
                return out, (inp, to_host(row) if kind.host_bundle else row, updates)

            a, (inputs, rows, updates) = lax.scan(body, a, jnp.arange(seg.lo, seg.hi))
            saved.append((inputs, rows))
            parts.append(updates)
        return (a, _concat(parts)), (stacked, keys, saved)

    def bwd(res: tuple, g: tuple[Any, Any]) -> tuple:
        stacked, keys, saved = res
        p_leaves, p_tree = jax.tree.flatten(stacked)
        p_diff = [inexact(leaf) for leaf in p_leaves]
        a_like = jax.tree.map(lambda t: t[0], saved[0][0])
        a_leaves, a_tree = jax.tree.flatten(a_like)
        a_diff = [inexact(leaf) for leaf in a_leaves]
        g_a = [c for c, d in zip(jax.tree.leaves(g[0]), a_diff) if d]
        d_p = [jnp.zeros_like(leaf) for leaf, d in zip(p_leaves, p_diff) if d]
        for seg, (inputs, rows) in reversed(list(zip(segs, saved))):
            kind = seg.kind
            lin = traced[kind.option if kind.stored else 0]

            def body(carry: tuple, xs: tuple, kind: CopyKind = kind, lin: Linearised = lin) -> tuple[tuple, None]:
                g_a, d_p = carry
                u, inp, row = xs
                p = _row(stacked, u)
                a = to_device(inp) if kind.host_input else inp
                if kind.stored:
                    stored = lin.keys.decode(to_device(row) if kind.host_bundle else row)
                else:
                    stored = lin.run(p, keys, a, u)[2]  # recomputed from the saved input
                d = lin.pullback(stored, p, a)(a_tree.unflatten(fill(g_a, a_diff, a_leaves)))
                n_p = sum(p_diff)
                d_p = [
                    lax.dynamic_update_index_in_dim(acc, row_d.astype(acc.dtype), u, 0)
                    for acc, row_d in zip(d_p, d[:n_p])
                ]
                return (list(d[n_p:]), d_p), None

            (g_a, d_p), _ = lax.scan(body, (g_a, d_p), (jnp.arange(seg.lo, seg.hi), inputs, rows), reverse=True)
        d_stacked = p_tree.unflatten(fill(d_p, p_diff, p_leaves))
        return d_stacked, None, a_tree.unflatten(fill(g_a, a_diff, a_leaves))

    loop.defvjp(fwd, bwd)
    return loop(stacked, keys, a)


def _concat(parts: list) -> Any:
    """Per-segment stacked trees joined along the copies (one tree when there is one segment)."""
    if len(parts) == 1 or not jax.tree.leaves(parts[0]):
        return parts[0]
    return jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts)


__all__ = ["Segment", "offload_scan", "segments"]
