"""A checkpoint region whose recomputation waits for the backward pass to reach it."""

from __future__ import annotations

from typing import Any, Callable, Collection

import jax
from jax import lax

from jaxremat.run._offload import to_device, to_host

RegionBody = Callable[[dict, dict, Any], tuple[Any, dict]]


def tied_checkpoint(
    body: RegionBody, *, offload: bool = False, inner: Collection[Any] = (), direct_cotangent: bool = True
) -> Callable[..., tuple[Any, dict]]:
    """``body(variables, keys, a) -> (out, updates)`` keeping only its inputs for the backward
    pass, where it is recomputed once the output's cotangent has arrived. ``offload=True``
    keeps the saved input ``a`` in host memory until the backward pass needs it. ``inner``: the
    keys of ``variables`` that regions inside ``body`` own (their gradients have passed those
    regions' barriers already). ``direct_cotangent=False``: the backward reads the incoming
    cotangent as the barrier returns it (the region holding the chain's last stage; see below).

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
    """

    @jax.custom_vjp
    def region(owned: dict, keys: dict, a: Any) -> tuple[Any, dict]:
        out, updates = body(owned, keys, a)
        return lax.optimization_barrier(out), updates

    def fwd(owned: dict, keys: dict, a: Any) -> tuple[tuple[Any, dict], tuple]:
        return region(owned, keys, a), (owned, keys, to_host(a) if offload else a)

    def bwd(res: tuple, g: tuple[Any, Any]) -> tuple:
        if offload:
            res = (*res[:2], to_device(res[2]))
        owned, keys, a, g_out = lax.optimization_barrier((*res, g[0]))
        if direct_cotangent:
            g_out = g[0]  # ordered by the barrier all the same: the recomputation reads its outputs
        _, pull = jax.vjp(lambda owned, a: body(owned, keys, a)[0], owned, a)
        # the input's cotangent leaves with the parameters' through one barrier: the region
        # before this one (whose recomputation waits for it) cannot start while this backward
        # still computes its weight gradients (XLA otherwise overlaps the two, 1.11x the plan
        # with every transformer block checkpointed)
        d_owned, d_a = pull(g_out)
        # the weight gradients of an inner region's stages passed its barrier already; held
        # through this one too, one in a layout other than its output's stays a temporary until
        # the step's end (+128 KiB per nesting level on a GPT's least-budget schedule)
        mine = {k: g for k, g in d_owned.items() if k not in inner}
        mine, d_a = lax.optimization_barrier((mine, d_a))
        return {**d_owned, **mine}, None, d_a

    region.defvjp(fwd, bwd)
    return region


__all__ = ["tied_checkpoint"]
