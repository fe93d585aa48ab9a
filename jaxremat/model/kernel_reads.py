"""A stage whose backward reads its kernels only after its output's cotangent arrives.

Both the executor (every top-level stored stage it can, :mod:`jaxremat.run._grad_tie`) and the
profiler (the last stage measured with the loss, :mod:`jaxremat.profiling.stage`) use it, so
what the profiler measures is what the step runs.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax import lax

from jaxremat.model.trees import all_floating


def orders_kernel_reads(rest: Any, a: Any) -> bool:
    """Whether the executor runs a stored stage (not the first: its input is the step's
    argument) with other variables ``rest`` (batch statistics; ``{}`` for none) and input ``a``
    under :func:`reads_after_cotangent`: its only variables are its parameters and its input is
    floating."""
    return not rest and all_floating(a)


def reads_after_cotangent(f: Callable[[Any, Any], Any], params: Any, a: Any) -> Any:
    """``f(params, a)``, whose backward reads the parameters only once the output's cotangent
    has arrived: the residuals that are the parameters pass one optimisation barrier with it.

    In the step users run, XLA makes the layout copies a backward reads of a kernel (the
    transposed kernel of a convolution's input gradient) from the parameters alone, so its
    scheduler may make them in the forward, where they live until that backward: measured on the
    conv autoencoder, a transposed-convolution stage stored whole kept its transposed kernel
    (0.28 MiB) from the forward on, and plans storing stages under options used 1.02-1.04x their
    prediction; with the barrier, 1.000-1.001x. The stage compiled alone (what the profiler
    measures) makes them inside its backward, as they are now made in the step. The same holds
    for a GPT block's reshaped attention kernels (its store-all step: 105.6 -> 100.8 MiB).
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


__all__ = ["orders_kernel_reads", "reads_after_cotangent"]
