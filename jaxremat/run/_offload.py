"""Moving what a schedule keeps to host memory and back (``Offload`` / ``Prefetch`` ops).

Each offloaded buffer is one ``jax.device_put(..., jax.memory.Space.Host)`` in the forward pass
(one equation for all its arrays) and one ``jax.device_put(..., jax.memory.Space.Device)`` in the
backward pass, before the first op that reads it. When the copies run is XLA's to schedule: on a
GPU its host-offload passes overlap them with compute; on the CPU, where host and device memory
are one, they compile to nothing and the gradients are unchanged.

An offloaded stored stage runs as a ``custom_vjp`` whose residuals are those of ``jax.vjp``:
the leaves that are the stage's variables (parameters) stay where they are, the leaves that are
its input are ``a_i`` (moved when the schedule offloads ``a_i``), the others are its bundle
``abar_i`` (moved when it offloads ``abar_i``).
"""

from __future__ import annotations

from typing import Any, Callable

import jax

from jaxremat.model.stage import Rngs


def to_host(tree: Any) -> Any:
    """``tree``'s arrays in host memory (one ``device_put``; ``tree`` itself when empty)."""
    return jax.device_put(tree, jax.memory.Space.Host) if jax.tree.leaves(tree) else tree


def to_device(tree: Any) -> Any:
    """``tree``'s arrays back in device memory (one ``device_put``)."""
    return jax.device_put(tree, jax.memory.Space.Device) if jax.tree.leaves(tree) else tree


Apply = Callable[[Any, Any, Rngs], tuple[Any, Any]]


def offloaded_stage(apply: Apply, *, bundle: bool, inputs: bool) -> Callable[[Any, Rngs, Any], tuple[Any, Any]]:
    """``stage(variables, keys, a) -> (out, updates)``: ``apply`` whose backward reads its
    residuals from host memory, the bundle's when ``bundle``, the input's when ``inputs``.
    Made once per traced call (its pullback's structure is kept between forward and backward)."""
    cell: dict[str, Any] = {}

    def moves(kind: str) -> bool:
        return (kind == "bundle" and bundle) or (kind == "input" and inputs)

    @jax.custom_vjp
    def stage(variables: Any, keys: Rngs, a: Any) -> tuple[Any, Any]:
        return apply(variables, a, keys)

    def fwd(variables: Any, keys: Rngs, a: Any):
        out, pull, updates = jax.vjp(lambda v, x: apply(v, x, keys), variables, a, has_aux=True)
        res, cell["tree"] = jax.tree.flatten(pull)
        own = {id(leaf) for leaf in jax.tree.leaves(variables)}
        ins = {id(leaf) for leaf in jax.tree.leaves(a)}
        cell["kinds"] = kinds = tuple("param" if id(r) in own else "input" if id(r) in ins else "bundle" for r in res)
        # the bundle and the input are two buffers of the schedule, each its own transfer
        moved = {
            kind: to_host([r for r, k in zip(res, kinds) if k == kind]) for kind in ("bundle", "input") if moves(kind)
        }
        kept = [r for r, k in zip(res, kinds) if not moves(k)]
        return (out, updates), (moved, kept)

    def bwd(saved: tuple, g: tuple[Any, Any]):
        moved, kept = saved
        back = {kind: iter(to_device(leaves)) for kind, leaves in moved.items()}
        kept = iter(kept)
        pull = cell["tree"].unflatten([next(back[k]) if moves(k) else next(kept) for k in cell["kinds"]])
        d_variables, d_a = pull(g[0])
        return d_variables, None, d_a

    stage.defvjp(fwd, bwd)
    return stage


__all__ = ["offloaded_stage", "to_device", "to_host"]
