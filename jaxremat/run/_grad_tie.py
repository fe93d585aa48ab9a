"""A stored stage whose parameter gradient leaves its backward with its input's cotangent."""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax import lax

from jaxremat.model.kernel_reads import orders_kernel_reads, reads_after_cotangent
from jaxremat.model.stage import Rngs, convolves
from jaxremat.model.trees import all_floating

Apply = Callable[[Any, Any, Rngs], tuple[Any, Any]]


@jax.custom_vjp
def _tie(params: Any, a: Any) -> tuple[Any, Any]:
    return params, a


def _tie_fwd(params: Any, a: Any) -> tuple[tuple[Any, Any], None]:
    return (params, a), None


def _tie_bwd(_: None, g: tuple[Any, Any]) -> tuple[Any, Any]:
    # the parameter cotangent waits for the input's; the input's leaves as it was made, not as
    # the barrier's copy, so that the next backward can write over it (see tied_checkpoint):
    # through the barrier, a ResNet plan storing blocks 3-6 under dots_saveable and recomputing
    # block 2 used 10.02 MiB where 9.90 were planned (9.79 now). XLA drops a barrier's unused
    # outputs with their operands, so this one holds the parameter cotangent alone and orders
    # nothing against the input's (measured 2026-12-03); kept in it by reading a scalar of its
    # copy, the conv autoencoder's 13.5 MiB plan used 13.02 MiB instead of 12.25
    g_params, _ = lax.optimization_barrier(g)
    return g_params, g[1]


_tie.defvjp(_tie_fwd, _tie_bwd)


def tied_gradients(apply: Apply) -> Apply:
    """``apply`` (a stage stored whole, or under a checkpoint policy; see
    :meth:`~jaxremat.run._walk.Walker.stage` for when) whose backward
    reads its kernels only after its output's cotangent arrives, when the stage's only variables
    are its parameters (:func:`~jaxremat.model.kernel_reads.reads_after_cotangent`), and, when
    the stage runs a convolution, whose parameter cotangent and input cotangent pass one
    optimisation barrier together.

    In the step users run, the parameters are donated and the optimizer writes the new ones over
    them. A stored stage's backward reads a kernel for its input gradient, and nothing orders that
    read before the update that overwrites the kernel, which needs only the weight gradient. So
    XLA's copy insertion keeps a copy of the kernel (in the layout the input gradient reads), and
    its scheduler makes the copy at the step's start, where it lives until that backward: bytes
    no stage's measurements hold, since the stage compiled alone makes the copy inside its
    backward. Tied to the input's cotangent, the update of a kernel waits for the backward's input
    gradient, so the read comes first and no copy is needed. Checkpoint regions tie their
    gradients the same way (:func:`~jaxremat.run._regions.tied_checkpoint`).

    Only convolutions gain from the tie (measured on the CPU, 2026-12-02, update step): the conv
    autoencoder's plans use 0.4 MiB less (XLA temp / plan 1.049 -> 1.020 at its 14.9 MiB plan),
    in the same step time, and a ResNet's store-all step 0.08 MiB less in no more time. A stage of
    matmuls does not: tied, a 12-block GPT's stored blocks keep two activation buffers of the
    copies' size instead (the same temp at store-all) and its step ran 5-7% slower; an
    MLP-Mixer's store-all step used 1.1 MiB more.

    The barrier alone does serve matmul stages (measured 2026-12-03, 12-block GPT, update step):
    XLA then makes a block's reshaped attention kernels inside its backward, not at the step's
    start. Store-all used 100.8 MiB instead of 105.6, the least-budget plan 8.28 instead of 9.21,
    in the same step time within this machine's noise (medians of 16 interleaved rounds: +5% and
    -6%, fastest calls equal).

    A stage whose input is not floating (token ids) or that has no parameters is left as it is:
    its input has no cotangent to tie to, or nothing is copied.
    """

    def tied(variables: Any, a: Any, keys: Rngs) -> tuple[Any, Any]:
        params = variables.get("params") if isinstance(variables, dict) else None
        if params is None or not jax.tree.leaves(params) or not all_floating(a):
            return apply(variables, a, keys)
        rest = {k: u for k, u in variables.items() if k != "params"}
        if convolves(lambda v, a: apply(v, a, keys), variables, a):
            params, a = _tie(params, a)
        if not orders_kernel_reads(rest, a):
            return apply({**rest, "params": params}, a, keys)
        return reads_after_cotangent(lambda p, x: apply({"params": p}, x, keys)[0], params, a), {}

    return tied


__all__ = ["tied_gradients"]
