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
    Called ``region(variables, keys, a, token)``, it returns ``(out, updates, token)``: the token
    (a float32 scalar) is for the region that runs right after this one, whose backward runs
    right before this one's.

    Arguments: ``offload`` keeps the saved input in host memory until the backward needs it;
    ``inner``, the keys of ``variables`` that regions inside ``body`` own (their gradients have
    passed those regions' barriers already); ``stages``, how many stages the region holds.

    How the incoming cotangent enters the backward:

    * it passes one optimisation barrier with the saved inputs, so the recomputation cannot
      start before the backward reaches this region (``jax.checkpoint``'s may run as early as XLA
      likes); with ``stages > 1`` or no floating input (and ``direct_cotangent``, on one device) the
      weight gradients also read one element
      of it, so that XLA cannot run the recomputation in the forward pass
      (``tests/test_fidelity.py::test_nested_regions_stay_within_their_plan``);
    * ``direct_cotangent=True``: the backward reads the cotangent as it was made, not the
      barrier's copy, so that ``FB`` may write over it as it dies; ``False`` for the region holding
      the chain's last stage (its cotangent is the loss gradient)
      (``tests/test_fidelity.py::test_a_backward_writes_over_its_incoming_cotangent``);
    * ``waits=True``: the cotangent was handed over by the region after this one (below), and the
      backward reads it plus zero times that region's token, after its weight gradients.

    The output passes a barrier too, so that it is materialised rather than fused into every
    reader, which kept the region's internals alive instead.

    How the weight gradients and the input's cotangent leave:

    * through one final barrier together (the default), so that the region before this one
      cannot recompute while this backward still computes its weight gradients;
    * ``ordered=True``: the input's cotangent leaves as it was made (this region's last stage
      writes over it in ``FB``, ``ChainCosts.fb_reuse``), the token's cotangent through the
      barrier instead, and the weight gradients wait for one element of it
      (``tests/test_execute.py::test_a_region_handing_its_cotangent_over_reads_its_kernels_before_their_update``);
    * every gradient waits for the recomputation before the last stage (``body``'s ``mark``, where
      a region is inside), and, for a region at the chain's input (``tapped=True``), for the
      token tapped into its first own stage's input, so that no read of a kernel can follow its
      update and XLA copies no donated kernel
      (``tests/test_fidelity.py::test_recomputation_reads_kernels_before_their_update``,
      ``::test_a_tap_keeps_no_cotangent_alive``).

    The measurements behind each rule: ``docs/notes/regions-measurements.md``.
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
