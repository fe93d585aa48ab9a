"""A stored stage whose parameter gradient leaves its backward with its input's cotangent."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxremat.model.stage import Rngs, convolves

Apply = Callable[[Any, Any, Rngs], tuple[Any, Any]]


@jax.custom_vjp
def _tie(params: Any, a: Any) -> tuple[Any, Any]:
    return params, a


def _tie_fwd(params: Any, a: Any) -> tuple[tuple[Any, Any], None]:
    return (params, a), None


def _tie_bwd(_: None, g: tuple[Any, Any]) -> tuple[Any, Any]:
    return lax.optimization_barrier(g)


_tie.defvjp(_tie_fwd, _tie_bwd)


def _reads_after_cotangent(f: Callable[[Any, Any], Any], params: Any, a: Any) -> Any:
    """``f(params, a)``, whose backward reads the parameters only once the output's cotangent
    has arrived: the residuals that are the parameters pass one optimisation barrier with it.

    In the step users run, XLA makes the layout copies a backward reads of a kernel (the
    transposed kernel of a convolution's input gradient) from the parameters alone, so its
    scheduler may make them in the forward, where they live until that backward: measured on the
    conv autoencoder, a transposed-convolution stage stored whole kept its transposed kernel
    (0.28 MiB) from the forward on, and plans storing stages under options used 1.02-1.04x their
    prediction; with the barrier, 1.000-1.001x. The stage compiled alone (what the profiler
    measures) makes them inside its backward, as they are now made in the step.
    """
    static: dict = {}  # the residuals' structure and which of them are the parameters, set by fwd

    @jax.custom_vjp
    def run(params: Any, a: Any) -> Any:
        return f(params, a)

    def fwd(params: Any, a: Any) -> tuple[Any, list]:
        out, vjp = jax.vjp(f, params, a)
        leaves, static["tree"] = jax.tree.flatten(vjp)
        # a residual that is a parameter is the very array (tracer) passed in, not a copy of it
        ids = {id(p) for p in jax.tree.leaves(params)}
        static["params"] = [k for k, leaf in enumerate(leaves) if id(leaf) in ids]
        return out, leaves

    def bwd(leaves: list, g: Any) -> tuple[Any, Any]:
        leaves = list(leaves)
        kernels, g = lax.optimization_barrier(([leaves[k] for k in static["params"]], g))
        for k, leaf in zip(static["params"], kernels):
            leaves[k] = leaf
        return static["tree"].unflatten(leaves)(g)

    run.defvjp(fwd, bwd)
    return run(params, a)


def _inexact(tree: Any) -> bool:
    leaves = jax.tree.leaves(tree)
    return bool(leaves) and all(jnp.issubdtype(jnp.result_type(x), jnp.inexact) for x in leaves)


def tied_gradients(apply: Apply) -> Apply:
    """``apply`` (a stage stored under plain autodiff, whole or under a policy) whose parameter
    cotangent and input cotangent pass one optimisation barrier together, when the stage runs a
    convolution.

    In the step users run, the parameters are donated and the optimizer writes the new ones over
    them. A stored stage's backward reads a kernel for its input gradient, and nothing orders that
    read before the update that overwrites the kernel, which needs only the weight gradient. So
    XLA's copy insertion keeps a copy of the kernel (in the layout the input gradient reads), and
    its scheduler makes the copy at the step's start, where it lives until that backward: bytes
    no stage's measurements hold, since the stage compiled alone makes the copy inside its
    backward. Tied to the input's cotangent, the update of a kernel waits for the backward's input
    gradient, so the read comes first and no copy is needed. Checkpoint regions tie their
    gradients the same way (:func:`~jaxremat.run._regions.tied_checkpoint`).

    Only convolutions gain (measured on the CPU, 2026-12-02, update step): the conv
    autoencoder's plans use 0.4 MiB less (XLA temp / plan 1.049 -> 1.020 at its 14.9 MiB plan),
    in the same step time, and a ResNet's store-all step 0.08 MiB less in no more time. A stage of matmuls does not: tied, a
    12-block GPT's stored blocks keep two activation buffers of the copies' size instead (the same
    temp at store-all) and its step ran 5-7% slower; an MLP-Mixer's store-all step used 1.1 MiB
    more.

    Its backward also reads the kernels only after the output's cotangent arrives
    (:func:`_reads_after_cotangent`), when the stage has no other variables and no random keys.

    A stage whose input is not floating (token ids) or that has no parameters is left as it is:
    its input has no cotangent to tie to, or nothing is copied.
    """

    def tied(variables: Any, a: Any, keys: Rngs) -> tuple[Any, Any]:
        params = variables.get("params") if isinstance(variables, dict) else None
        if params is None or not jax.tree.leaves(params) or not _inexact(a) or not convolves(lambda v, a: apply(v, a, keys), variables, a):
            return apply(variables, a, keys)
        params, a = _tie(params, a)
        if keys or set(variables) != {"params"}:
            return apply({**variables, "params": params}, a, keys)
        return _reads_after_cotangent(lambda p, x: apply({"params": p}, x, keys)[0], params, a), {}

    return tied


__all__ = ["tied_gradients"]
