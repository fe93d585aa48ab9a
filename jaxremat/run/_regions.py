"""A checkpoint region whose recomputation waits for the backward pass to reach it."""

from __future__ import annotations

import enum
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


class Enters(enum.Enum):
    """How a region's backward reads the cotangent of its output."""

    #: As it was made (not the barrier's copy), so that the region's last ``FB`` may write over
    #: it as it dies (``tests/test_fidelity.py::test_a_backward_writes_over_its_incoming_cotangent``).
    DIRECT = "direct"
    #: As the barrier returns it: the region holding the chain's last stage, whose cotangent is
    #: the loss gradient.
    BARRIER = "barrier"
    #: As it was made, plus zero times the token of the region after this one, which handed the
    #: cotangent over directly (:attr:`Leaves.HANDED`): read after that region's weight gradients.
    AFTER_NEXT = "after next"


class Leaves(enum.Enum):
    """How a region's weight gradients and its input's cotangent leave its backward."""

    #: Through one final barrier together, so that the region before this one cannot recompute
    #: while this backward still computes its weight gradients.
    TOGETHER = "together"
    #: The input's cotangent as it was made (the stage before writes over it in its ``FB``,
    #: ``ChainCosts.fb_reuse``), the token's cotangent through the barrier instead, the weight
    #: gradients after one element of the input's cotangent; the body's first region hands its
    #: cotangent over the same way
    #: (``tests/test_execute.py::test_a_region_handing_its_cotangent_over_reads_its_kernels_before_their_update``).
    HANDED = "handed"
    #: Together, the weight gradients after the token tapped into the input of the region's first
    #: own stage (a region at the chain's input: its input's cotangent is dead), so that no read of
    #: a kernel follows its update (``tests/test_fidelity.py::test_a_tap_keeps_no_cotangent_alive``).
    TAPPED = "tapped"


def tied_checkpoint(
    body: RegionBody,
    *,
    enters: Enters = Enters.DIRECT,
    leaves: Leaves = Leaves.TOGETHER,
    offload: bool = False,
    inner: Collection[Any] = (),
    stages: int = 1,
) -> Callable[..., tuple[Any, dict, jax.Array]]:
    """``body(variables, keys, a, token, tap) -> (out, updates, mark)`` keeping only its inputs
    for the backward pass, where it is recomputed once the output's cotangent has arrived.
    Called ``region(variables, keys, a, token)``, it returns ``(out, updates, token)``: the token
    (a float32 scalar) is for the region that runs right after this one, whose backward runs
    right before this one's. ``body``'s ``token`` is the one its first region gets
    (:attr:`Leaves.HANDED`), ``tap`` the one tapped into its first own stage's input
    (:attr:`Leaves.TAPPED`), ``mark`` one element of its last stage's input where a region runs
    before it.

    Arguments: ``enters`` and ``leaves``, the enums' rules below; ``offload`` keeps the saved
    input in host memory until the backward needs it; ``inner``, the keys of ``variables`` that
    regions inside ``body`` own (their gradients have passed those regions' barriers already);
    ``stages``, how many stages the region holds.

    Rules, each pinned by a test (the measurements behind them: ``docs/notes/regions-measurements.md``):

    * The incoming cotangent passes one optimisation barrier with the saved inputs, so the
      recomputation cannot start before the backward reaches this region (``jax.checkpoint``'s
      may run as early as XLA likes).
    * With ``stages > 1`` or no floating input (and not :attr:`Enters.BARRIER`, on one device),
      the weight gradients also read one element of the barrier's cotangent, so that XLA cannot
      run the recomputation in the forward pass
      (``tests/test_fidelity.py::test_nested_regions_stay_within_their_plan``).
    * The output passes a barrier too, so that it is materialised rather than fused into every
      reader, which kept the region's internals alive instead.
    * Every gradient waits for the recomputation before the last stage (``body``'s ``mark``, where
      a region is inside), so that no read of a kernel follows its update and XLA copies no
      donated kernel (``tests/test_fidelity.py::test_recomputation_reads_kernels_before_their_update``).
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
        owned, keys, a, g_out, arrived = _enter(res, g, enters, stages)
        # Leaves.HANDED: the body's first region (if it starts the body) hands its input's
        # cotangent over directly too, with a token of its own, whose cotangent this one's waits for
        inner_token = order_token() if leaves is Leaves.HANDED else None
        tap_token = order_token() if leaves is Leaves.TAPPED else None
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
            g_out = after(g_out, mark)
        d_owned, d_a, d_inner, d_tap = pull(g_out)
        # the weight gradients of an inner region's stages passed its barrier already; held
        # through this one too, one in a layout other than its output's stays a temporary until
        # the step's end (+128 KiB per nesting level on a GPT's least-budget schedule)
        mine = {k: g for k, g in d_owned.items() if k not in inner}
        if arrived is not None:
            # its weight gradients read the barrier's element of the cotangent, so that the
            # barrier, and the recomputation reading its outputs, wait for the cotangent (why
            # each kind of region needs it: docs/notes/regions-measurements.md)
            mine = after(mine, arrived)
        if leaves is Leaves.HANDED:
            mine, d_a, d_token = _leave_handed(mine, d_a, d_inner)
        elif leaves is Leaves.TAPPED:
            mine, d_a, d_token = _leave_together(after(mine, d_tap), d_a)
        else:
            mine, d_a, d_token = _leave_together(mine, d_a)
        return {**d_owned, **mine}, None, d_a, d_token

    region.defvjp(fwd, bwd)
    return region


def _enter(res: tuple, g: tuple[Any, Any, jax.Array], enters: Enters, stages: int) -> tuple:
    """``(owned, keys, a, g_out, arrived)``: the saved inputs and the incoming cotangent through
    one barrier (``g[2]``: the token's cotangent, from the next region once its weight gradients
    are made), the cotangent the backward reads as ``enters`` says, and ``arrived``, the element
    of the barrier's cotangent the weight gradients wait for (or ``None``)."""
    # a region whose saved input is parameters alone (a jaxpr chain's first stage reads the
    # function's inputs as parameters, its activation is empty), or that holds more than one
    # stage, passes one element of the cotangent too (one device only: on an Explicit mesh,
    # slicing the sharded cotangent to one element fails when the step is transformed)
    empty = not any(jnp.issubdtype(jnp.result_type(x), jnp.inexact) and jnp.size(x) for x in jax.tree.leaves(res[2]))
    tie = enters is not Enters.BARRIER and (empty or stages > 1) and jax.device_count() == 1
    arrived = element_now(g[0]) if tie else None
    owned, keys, a, g_out, token, arrived = lax.optimization_barrier((*res, g[0], g[2], arrived))
    # XLA drops a barrier's unused outputs with their operands, so the cotangent leaves this
    # barrier here, and nothing but XLA's scheduler keeps the recomputation after it (measured:
    # it does; reading a scalar of the barrier's copy changed no plan's memory and made the GPT's
    # every-block plan 5-7% slower)
    if enters is Enters.DIRECT:
        g_out = g[0]
    elif enters is Enters.AFTER_NEXT:
        g_out = after(g[0], token)
    return owned, keys, a, g_out, arrived


def _leave_together(mine: dict, d_a: Any) -> tuple[dict, Any, None]:
    """The weight gradients and the input's cotangent through one barrier: the region before
    this one (whose recomputation waits for it) cannot start while this backward still computes
    its weight gradients (XLA otherwise overlaps the two, 1.11x the plan with every transformer
    block checkpointed)."""
    mine, d_a = lax.optimization_barrier((mine, d_a))
    return mine, d_a, None


def _leave_handed(mine: dict, d_a: Any, d_inner: Any) -> tuple[dict, Any, Any]:
    """The input's cotangent as it was made, so nothing orders the reads of this region's
    kernels for it before their update: the weight gradients wait for one element of it
    (without, XLA copied the kernel of every such region's first stage, 1.34x the plan), and
    leave with the token's cotangent through the barrier."""
    mark = element_now(d_a)
    if mark is not None:
        mine = after(mine, mark)
    mine, d_token = lax.optimization_barrier((mine, d_inner))
    return mine, d_a, d_token


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


__all__ = ["Enters", "Leaves", "mark_of", "order_token", "tap", "tied_checkpoint"]
