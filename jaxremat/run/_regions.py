"""A checkpoint region whose recomputation waits for the backward pass to reach it."""

from __future__ import annotations

from typing import Any, Callable, Collection

import jax
import jax.numpy as jnp
from jax import lax

from jaxremat.run._names import fresh_names
from jaxremat.run._offload import to_device, to_host

RegionBody = Callable[[dict, dict, Any, Any, Any], tuple[Any, dict, Any]]


def order_token() -> jax.Array:
    """A region's order token (see :func:`tied_checkpoint`): a float32 scalar whose cotangent
    carries nothing but an ordering."""
    return jnp.zeros((), jnp.float32)


def after(tree: Any, token: jax.Array) -> Any:
    """``tree`` unchanged, read only once ``token`` is made: each float leaf plus ``0 * token``,
    which XLA fuses into the leaf's readers and cannot fold (``0 * t`` is not 0 for a NaN). The
    readers still read the leaf's own instruction, and may write over it."""

    def one(x: Any) -> Any:
        if not jnp.issubdtype(jnp.result_type(x), jnp.inexact):
            return x
        return x + (0 * token).astype(jnp.result_type(x))

    return jax.tree.map(one, tree)


@jax.custom_vjp
def tap(a: Any, token: jax.Array) -> Any:
    """``a`` unchanged; ``token``'s cotangent is one element of ``a``'s, so whatever reads it
    waits for ``a``'s cotangent (a slice: no flops, nothing to fold)."""
    return a


def _tap_fwd(a: Any, token: jax.Array) -> tuple[Any, None]:
    return a, None


def _tap_bwd(_: None, g: Any) -> tuple[Any, jax.Array]:
    mark = element_now(g)
    return g, order_token() if mark is None else mark


tap.defvjp(_tap_fwd, _tap_bwd)


def tied_checkpoint(
    body: RegionBody,
    *,
    offload: bool = False,
    inner: Collection[Any] = (),
    direct_cotangent: bool = True,
    ordered: bool = False,
    waits: bool = False,
    tapped: bool = False,
    stages: int = 1,
) -> Callable[..., tuple[Any, dict, jax.Array]]:
    """``body(variables, keys, a, token, tap) -> (out, updates, mark)`` keeping only its inputs
    for the backward pass, where it is recomputed once the output's cotangent has arrived.
    ``offload=True`` keeps the saved input ``a`` in host memory until the backward pass needs it. ``inner``: the
    keys of ``variables`` that regions inside ``body`` own (their gradients have passed those
    regions' barriers already). ``direct_cotangent=False``: the backward reads the incoming
    cotangent as the barrier returns it (the region holding the chain's last stage; see below).
    ``stages``: how many stages the region holds; more than one, its recomputation waits for the
    cotangent by data dependence (see the comment at ``tie``).

    ``jax.checkpoint``'s recomputation depends only on the saved input, so XLA may schedule it
    as early as it likes (before later stages' backward has freed their memory); here the saved
    inputs and the incoming cotangent pass one optimisation barrier together, so the
    recomputation cannot start before the backward pass reaches this region.

    The output passes an optimisation barrier too, so that it is materialised: otherwise XLA
    fuses the region's element-wise tail (say a residual block's ``relu(x + h)``) into every
    consumer and keeps the region's internals alive instead of its output, which the plan
    recomputes (measured on a ResNet-style chain: 1.08x the planned memory).

    The backward reads the incoming cotangent itself, not the barrier's copy of it: the barrier
    only orders the recomputation after it. XLA writes an element-wise output over a dying
    operand only when the user reads the instruction that made that operand (its heap
    simulator's ``IsUserOf`` test), which a barrier's output never is. A residual block's
    ``FB`` writes its relu derivative over the incoming cotangent (``FB``'s measured bytes take
    credit for it); reading the barrier's copy, it needed one activation more, and the ResNet's
    least-budget plan used 9.04 MiB where 8.02 were planned (8.04 now). The region holding the
    chain's last stage keeps the barrier's copy: its cotangent is the loss gradient, and read
    directly XLA kept 1.75 MiB more of the GPT's logit-sized buffers in its store-all plan.

    In the step users run, the parameters are donated and the optimizer writes each new kernel
    over the old one, so every read of a kernel must come, by data dependence, before the
    kernel's update; XLA copies a kernel (at the step's start, live until its update) wherever
    one does not. Two reads in a region's backward may not:

    * the recomputation's, where its result reaches no gradient of the kernel's stage. With a
      region inside this one, the recomputation of the inner region's stages feeds only this
      region's own stages' gradients (when the last stage's input gradient does not read its
      input, as in a final linear layer, not even those), while the inner region recomputes them
      again for its own. ``body`` returns a ``mark``, one element of its last stage's input
      (:func:`mark_of`; ``None`` if it runs no unit before that stage, or holds no region), and
      this backward's cotangent waits for it (:func:`after`): every gradient made here, the
      inner regions' included, comes after the recomputation. Without it, on the conv
      autoencoder (a region over every stage, one inside it over all but the last), XLA copied
      every inner kernel; on its least-budget plan, 8.94 MiB of temp where 8.00 were planned.
      Only where a region is inside: a region of stages stored whole (the sqrt schedule),
      marked too, changed XLA's schedule both ways, the GPT's 28.1 MiB plan to 29.9 and the
      autoencoder's 20.5 MiB one to 17.5 (predicted 28.1 and 22.0).
    * the reads for the stages' input gradients, where the region starts at the chain's input
      (``tapped=True``): that input's cotangent is dead, so XLA drops it from the final barrier
      below, and the weight gradients leaving through it wait for none of those reads. ``body``
      then gets a token (``tap``) to :func:`tap` into the input of its first own stage after the
      chain's first, whose input gradient is the last of those reads (the first stage's is
      dead), and the weight gradients wait for the token's cotangent instead. With the mark
      alone, the autoencoder's least-budget plan still used 8.94 MiB; with both, 8.01 MiB
      (measured on the CPU, 2026-12-04; its step time within this machine's noise, its flops
      +0.04%).

    The region is called ``region(variables, keys, a, token)`` and returns ``(out, updates,
    token)``; the token (a float32 scalar) is for the region that runs right after this one,
    whose backward runs right before this one's. Its input's cotangent leaves that backward in
    one of two ways:

    * through the final barrier, with its weight gradients (``ordered=False``, ``token`` is
      ``None``): this region's recomputation, which waits for the cotangent, waits for them
      too. But the cotangent is then a barrier's output, which this region's backward cannot
      write over.
    * as it was made (``ordered=True``: it was given this region's token), where this region's
      last stage writes over it in its ``FB`` (``ChainCosts.fb_reuse``). The token's cotangent
      leaves through the final barrier instead and enters this region's first barrier: the
      recomputation still waits for the weight gradients. This region (``waits=True``) reads the
      cotangent plus zero times that token (:func:`after`), so that no part of its backward runs
      before them either. With every ResNet block a region of its own, XLA used 10.02 MiB where
      9.02 were planned through the barrier, and 9.03 MiB so. ``body`` then gets a token too:
      a region starting it hands the cotangent over the same way (the cotangent leaves through
      it), and its token's cotangent joins this one's.

    Where nothing is written over the cotangent the barrier stays: handing it over directly
    changed no live bytes on a transformer or the GPT but XLA packed them worse (every
    transformer block a region: 1.06x the plan, 0.99x through the barrier).
    """

    @jax.custom_vjp
    @fresh_names
    def region(owned: dict, keys: dict, a: Any, token: jax.Array | None) -> tuple[Any, dict, jax.Array]:
        out, updates, _ = body(owned, keys, a, token, None)
        return lax.optimization_barrier(out), updates, order_token()

    @fresh_names
    def fwd(owned: dict, keys: dict, a: Any, token: jax.Array | None) -> tuple[tuple[Any, dict, jax.Array], tuple]:
        return region(owned, keys, a, token), (owned, keys, to_host(a) if offload else a)

    @fresh_names
    def bwd(res: tuple, g: tuple[Any, Any, jax.Array]) -> tuple:
        if offload:
            res = (*res[:2], to_device(res[2]))
        # g[2]: the token's cotangent, from the next region once its weight gradients are made
        # a region whose saved input is parameters alone (a jaxpr chain's first stage reads the
        # function's inputs as parameters, its activation is empty), or that holds more than one
        # stage, passes one element of the cotangent too (below: what keeps it in the barrier)
        # (one device only: on an Explicit mesh, slicing the sharded cotangent to one element
        # fails when the step is transformed; untied there, as before)
        empty = not any(
            jnp.issubdtype(jnp.result_type(x), jnp.inexact) and jnp.size(x) for x in jax.tree.leaves(res[2])
        )
        tie = direct_cotangent and (empty or stages > 1) and jax.device_count() == 1
        arrived = element_now(g[0]) if tie else None
        owned, keys, a, g_out, token, arrived = lax.optimization_barrier((*res, g[0], g[2], arrived))
        if direct_cotangent:
            # XLA drops a barrier's unused outputs with their operands, so the cotangent leaves
            # this barrier here, and nothing but XLA's scheduler keeps the recomputation after it
            # (measured: it does; reading a scalar of the barrier's copy, to keep it, changed no
            # plan's memory and made the GPT's every-block plan 5-7% slower)
            g_out = after(g[0], token) if waits else g[0]
        # ordered, the body's first region (if it starts the body) hands its input's cotangent
        # over directly too, with a token of its own, whose cotangent this one's waits for
        inner_token = order_token() if ordered else None
        tap_token = order_token() if tapped else None
        _, pull, mark = jax.vjp(
            lambda owned, a, t, s: _out_and_mark(body(owned, keys, a, t, s)),
            owned,
            a,
            inner_token,
            tap_token,
            has_aux=True,
        )
        if mark is not None:
            # every gradient of this backward waits for the recomputation before the last stage
            # (the first of the two reads in the docstring)
            g_out = after(g_out, mark)
        # the input's cotangent leaves with the parameters' through one barrier: the region
        # before this one (whose recomputation waits for it) cannot start while this backward
        # still computes its weight gradients (XLA otherwise overlaps the two, 1.11x the plan
        # with every transformer block checkpointed)
        d_owned, d_a, d_inner, d_tap = pull(g_out)
        # the weight gradients of an inner region's stages passed its barrier already; held
        # through this one too, one in a layout other than its output's stays a temporary until
        # the step's end (+128 KiB per nesting level on a GPT's least-budget schedule)
        mine = {k: g for k, g in d_owned.items() if k not in inner}
        if arrived is not None:
            # its weight gradients read the barrier's element of the cotangent, so that the
            # barrier, and the recomputation reading its outputs, wait for the cotangent. Without,
            # XLA ran the recomputations of nested regions side by side: a 12-layer MLP written
            # as a Python loop, recompute_all, 25 MiB where 4 were planned (4.0 with the tie);
            # tying the saved inputs instead copied them (5.3). A region of several stages needs
            # it too: the recomputation of the stages before its last reads no cotangent, and
            # XLA ran it in the forward pass, right after the first forward of those stages, and
            # held its results until the backward (a 12-layer loop MLP's 50% plan, stages 3-6 a
            # region followed by stored stages: 29.25 MiB where 18.25 were planned; tied, 19.25).
            # A region of one stage keeps the order without it: tied too, a 4-block
            # transformer's 30% plan (two one-stage regions) packed an 8 MiB hole into XLA's heap
            # at the same live bytes (1.09x the plan against 1.005x), and a conv autoencoder's
            # least plan once went 1.00 -> 1.10x.
            mine = after(mine, arrived)
        if ordered:
            # the cotangent leaves as it was made, so nothing orders the reads of this region's
            # kernels for it before their update: the weight gradients wait for one element of
            # it (element_now). Without, XLA copied the kernel of every such region's first
            # stage (16 tanh(x @ w) stages at 30%: 1.34x the plan)
            mark = element_now(d_a)
            if mark is not None:
                mine = after(mine, mark)
            mine, d_token = lax.optimization_barrier((mine, d_inner))
            return {**d_owned, **mine}, None, d_a, d_token
        if tapped:
            # (tying these gradients to the inner regions' instead: 1.21x the plan; the inner
            # regions' to these, which follow the recomputation that reads their kernels, 1.24x)
            mine = after(mine, d_tap)
        mine, d_a = lax.optimization_barrier((mine, d_a))
        return {**d_owned, **mine}, None, d_a, None

    region.defvjp(fwd, bwd)
    return region


def _out_and_mark(result: tuple[Any, dict, Any]) -> tuple[Any, Any]:
    out, _, mark = result
    return out, mark


def element_now(g: Any) -> jax.Array | None:
    """:func:`mark_of` a cotangent, made on its own behind a barrier, so that whatever waits for
    it does not keep the whole cotangent alive.

    Fused into its reader (weight gradients made at the end of a region's backward), the slice
    kept the whole cotangent until then: a chain of 16 ``tanh(x @ w)`` stages planned at 30% (a
    region from the input holding a stored stage and a region over stages 1-3, the tap on stage
    3's input) used 165 KiB where 147 were planned, 133 KiB with the barrier (measured
    2026-12-04). (On the forward marks too, it fixed no further plan.)
    """
    mark = mark_of(g)
    return None if mark is None else lax.optimization_barrier(mark)


def mark_of(a: Any) -> jax.Array | None:
    """One element of ``a``'s first floating leaf (as float32), or ``None`` if it has none."""
    leaves = [x for x in jax.tree.leaves(a) if jnp.issubdtype(jnp.result_type(x), jnp.inexact) and jnp.size(x)]
    return leaves[0].reshape(-1)[0].astype(jnp.float32) if leaves else None


__all__ = ["mark_of", "order_token", "tap", "tied_checkpoint"]
