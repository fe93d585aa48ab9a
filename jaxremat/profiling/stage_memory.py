"""Measuring one stage's memory: what XLA keeps for its backward (:func:`kept_bytes`, the bytes
live across an optimisation barrier between forward and backward), what a loop keeps
(:func:`scan_residual_bytes`), the backward's transients (:func:`backward_memory`) and the
backward fused with the loss (:func:`with_loss`). Timing and flops are :mod:`~jaxremat.profiling.stage`'s."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jax_core

from jaxremat.core.compile import barriers_survive, measuring_options
from jaxremat.model.kernel_reads import orders_kernel_reads, reads_after_cotangent
from jaxremat.model.stage import convolves
from jaxremat.model.trees import is_sharded, tree_bytes, with_shardings
from jaxremat.profiling.parallel import side_by_side
from jaxremat.profiling.xla_buffers import bytes_kept_across_barrier, transient_bytes


def _sum_leaves(tree: Any) -> jax.Array:
    return sum(jnp.sum(leaf.astype(jnp.float32)) for leaf in jax.tree.leaves(tree))


def kept_bytes(g, params, a_shape, rest, rng, cot_shape, step_input: bool = False, with_output: bool = True) -> int:
    """``xbar``: the bytes XLA keeps from the stage's forward for its backward, plus its output.

    Compiled as forward, an optimisation barrier on (output, cotangent), backward, and read from
    the buffers live across it (:func:`~jaxremat.profiling.xla_buffers.live_across_barrier`; the stage
    input's leaves are the
    activations there, and its parameters the kernels where the executor does not order their
    reads after the cotangent). ``step_input``: the stage is the chain's first, its input the
    step's argument (copies of it count).

    Where the barrier does not survive into the buffer assignment (XLA:GPU), the residuals
    ``jax.vjp`` hands the backward, as :func:`scan_residual_bytes` counts them: JAX's choice
    before XLA's fusion, which may keep less.

    ``with_output=False``: the output only summed before the barrier, what the backward reads.
    """
    if not barriers_survive():
        return scan_residual_bytes(g, params, a_shape, rest, rng)

    def kept(params, a, rest, rng, cot):
        out, vjp = jax.vjp(lambda p, x: g(p, x, rest, rng), params, a)
        if not with_output:
            done, cot = lax.optimization_barrier((_sum_leaves(out), cot))
            return done, vjp(cot)
        done, cot, out = lax.optimization_barrier((_sum_leaves(out), cot, out))
        return done, vjp(cot), out

    n_params, n_input = len(jax.tree.leaves(params)), len(jax.tree.leaves(a_shape))
    acts = range(n_params, n_params + n_input)
    # copies of a kernel (a reshaped attention kernel) count where the executor does not prevent
    # them: the step users run makes them at its start, unless the stage's kernel reads wait for
    # its cotangent (a stage after the first with only parameters and a floating input), or its
    # weight gradient is tied to its input's (it convolves); see jaxremat.run._grad_tie
    ordered = not step_input and orders_kernel_reads(rest, a_shape)
    kernels = () if ordered or convolves(g, params, a_shape, rest, rng) else range(n_params)
    return bytes_kept_across_barrier(
        kept, params, a_shape, rest, rng, cot_shape, activations=acts, parameters=kernels, step_input=step_input
    )[1]


def same_shapes(a: Any, b: Any) -> bool:
    """Whether two trees of arrays (or shapes) have the same structure, shapes and dtypes: a
    stage whose output is shaped as its input can run as a loop's body."""
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        (x.shape, x.dtype) == (y.shape, y.dtype) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def scan_residual_bytes(g: Callable, params: Any, a_shape: Any, rest: Any, rng: Any) -> int:
    """Bytes a ``lax.scan`` saves per iteration for a stage's backward, output included: for a
    stage whose output is shaped as its input (a layer of a stack), what a scan over two copies of
    it stacks (:func:`loop_residual_bytes`); for another (a stage holding a loop), what its own
    autodiff keeps (:func:`vjp_residual_bytes`)."""
    out = jax.eval_shape(g, params, a_shape, rest, rng)
    if same_shapes(out, a_shape) and not is_sharded((params, a_shape)):
        return loop_residual_bytes(g, params, a_shape, rest, rng)
    return vjp_residual_bytes(g, params, a_shape, rest, rng)


def loop_residual_bytes(g: Callable, params: Any, a_shape: Any, rest: Any, rng: Any) -> int:
    """Bytes per iteration that a ``lax.scan`` of two copies of ``g`` (its parameters stacked)
    stacks for its backward: each copy's input, and every residual as JAX's scan autodiff makes
    them, once per stacked buffer. It can keep one value twice: a 12-layer ``tanh(h @ w)`` scan
    stacks its inputs and its outputs twice (three buffers of ``[12, 1024, 256]``), 3 MiB a layer
    where a stage's own autodiff keeps 2 (CPU, 2026-12-06)."""
    two = jax.tree.map(lambda s: jax.ShapeDtypeStruct((2, *s.shape), s.dtype), params)

    def residuals(ps: Any, x: Any, r: Any, k: Any) -> list:
        run = lambda ps, x: lax.scan(lambda c, p: (g(p, c, r, k), None), x, ps, length=2)[0]  # noqa: E731
        return jax.tree.leaves(jax.vjp(run, ps, x)[1])

    closed = jax.make_jaxpr(residuals)(two, a_shape, rest, rng)
    inputs = set(closed.jaxpr.invars)
    stacked = {
        v: v.aval
        for v in closed.jaxpr.outvars
        if isinstance(v, jax_core.Var) and v not in inputs and getattr(v.aval, "shape", ())[:1] == (2,)
    }
    return tree_bytes([jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in stacked.values()])


def loop_transients(
    g: Callable, params: Any, a_shape: Any, rest: Any, rng: Any, policies: dict[str, Callable],
    same: dict[str, str] | None = None,
) -> dict[str | None, int]:
    """A layer's backward transients as XLA runs them inside a loop, by how the layer is kept:
    ``"store"`` (nothing recomputed: ``B``'s), ``"checkpoint"`` (its input only: ``FB``'s) and
    each policy's name. Each is the intercept of XLA's temp over the loop's length (a scan of 2
    and of 4 copies, the gradient of the copies' parameters and of the input): what the loop
    holds beyond what it stacks per copy.

    Why: compiled alone, a layer's backward holds far more than an iteration of the loop does. A
    decoder layer (width 128, 4 x 128 tokens) alone: 20.4 MiB for ``B``, 33.2 for ``FB``, 24.7
    under ``dots_with_no_batch_dims_saveable``; in a loop, 7.5, 10.8 and 7.8, so that the least
    loop schedule of a 24-layer stack was predicted at 70.3 MiB and measured at 34.5 (CPU,
    2026-12-06).

    ``same`` (:func:`~jaxremat.profiling.stage.saves_as`): per policy, ``"store"``, ``"checkpoint"``
    or the program it makes: each program compiled once, whichever kinds make it (a layer whose
    two policies save the same: 6 compiles, not 8; whose policies save nothing: 4).
    """
    same = same or {}
    kinds: dict[str | None, Any] = {"store": "store", "checkpoint": None, **policies}

    def temp(n: int, policy: Any) -> int:
        stacked = jax.tree.map(lambda s: jax.ShapeDtypeStruct((n, *s.shape), s.dtype), params)

        def backward(ps: Any, x: Any, ct: Any, r: Any, k: Any) -> Any:
            def body(c: Any, p: Any) -> tuple[Any, None]:
                return g(p, c, r, k), None

            layer = body if isinstance(policy, str) else jax.checkpoint(body, policy=policy)
            return jax.vjp(lambda ps, x: lax.scan(layer, x, ps)[0], ps, x)[1](ct)

        lowered = jax.jit(backward).lower(stacked, a_shape, a_shape, rest, rng)
        compiled = lowered.compile(measuring_options(lowered=lowered) or None)
        return int(compiled.memory_analysis().temp_size_in_bytes)

    program = {name: same.get(name, name) for name in kinds}
    first = {p: name for name, p in reversed(program.items())}  # each program by its first kind
    jobs = [(n, kinds[name]) for name in first.values() for n in (2, 4)]
    temps = iter(side_by_side(lambda job: temp(*job), jobs))
    measured = {}
    for name in first.values():
        two, four = next(temps), next(temps)
        measured[name] = max(0, two - (four - two))  # T(n) = intercept + n * per-copy
    return {name: measured[first[program[name]]] for name in kinds}


def vjp_residual_bytes(g: Callable, params: Any, a_shape: Any, rest: Any, rng: Any) -> int:
    """Bytes a loop saves per iteration for a stage's backward, output included, as the stage's
    own autodiff keeps them.

    A loop keeps its body's residuals as JAX's autodiff chooses them (stacked outputs of the
    forward loop), not as XLA would after fusing the backward: these are the residuals of
    ``jax.vjp`` that are not the stage's inputs (parameters are scanned inputs, handed to the
    backward loop as they are; the input is the previous stage's output), plus the output.
    """
    def residuals(p, x, r, k):
        out, pull = jax.vjp(lambda p, x: g(p, x, r, k), p, x)
        return jax.tree.leaves(pull), out

    closed = jax.make_jaxpr(residuals)(params, a_shape, rest, rng)
    inputs = set(closed.jaxpr.invars)
    kept: dict = {}  # output position of each residual that is not an input, once per variable
    for n, v in enumerate(closed.jaxpr.outvars):
        if isinstance(v, jax_core.Var) and v not in inputs and v not in kept:
            kept[v] = n
    shapes = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.outvars]
    if is_sharded((params, a_shape)):  # on a mesh: per device, as the forward lays them out
        laid_out = jax.jit(lambda *a: jax.tree.leaves(residuals(*a))).lower(params, a_shape, rest, rng).compile()
        shapes = with_shardings(shapes, list(laid_out.output_shardings))
    return tree_bytes([shapes[n] for n in kept.values()])


class Backward(NamedTuple):
    """A stage's backward as :func:`backward_memory` measures it."""

    kept: int  # bytes kept for it, output included (xbar)
    compiled: Any  # the backward compiled from its residuals and the cotangent
    tmp: int  # its transient bytes
    pullback: Callable  # (p, x, r, k) -> the stage's vjp
    unread: int  # output bytes it does not read


def backward_memory(g: Callable, params: Any, a_shape: Any, rest: Any, rng: Any, cot_shape: Any, input_grad: bool,
              scanned: bool):
    """For ``g`` (the stage, or the stage under a checkpoint policy): the bytes kept for its
    backward (output included), the compiled backward (from the residuals and the cotangent), its
    transient bytes, the pullback, and the output bytes the backward does not read."""
    xbar, unread = kept_bytes(g, params, a_shape, rest, rng, cot_shape, step_input=not input_grad), 0
    if scanned:  # a loop keeps its carry (the output) for the backward loop whatever that reads
        xbar = max(xbar, scan_residual_bytes(g, params, a_shape, rest, rng))
    elif barriers_survive() and xbar > (out := tree_bytes(jax.eval_shape(g, params, a_shape, rest, rng))) + 16:
        # only where it reads anything kept beyond the probe's 4-byte sum (docs/cost_model.md,
        # "Output bytes a backward does not read": one keeping nothing recomputes the stage whole)
        read = kept_bytes(g, params, a_shape, rest, rng, cot_shape, step_input=not input_grad, with_output=False)
        unread = max(0, min(xbar - read, out)) if read > 16 else 0

    def pullback(p, x, r, k):
        if input_grad:
            return jax.vjp(lambda p, x: g(p, x, r, k), p, x)[1]
        return jax.vjp(lambda p: g(p, x, r, k), p)[1]

    vjp_shape = jax.eval_shape(pullback, params, a_shape, rest, rng)
    if is_sharded((params, a_shape)):  # on a mesh: the residuals as the forward lays them out
        laid_out = jax.jit(pullback).lower(params, a_shape, rest, rng).compile().output_shardings
        vjp_shape = with_shardings(vjp_shape, laid_out)
    # as for FB (below), an output written over a dying input is credited only where that input
    # is the incoming cotangent: crediting a dying residual too had the least-budget plan of a
    # 12-block GPT (blocks stored under dots_with_no_batch_dims_saveable) at 1.18x in the update step
    n_res = len(jax.tree.leaves(vjp_shape))
    bwd_c, bwd_tmp = transient_bytes(
        lambda f, c: f(c), vjp_shape, cot_shape, reuse=range(n_res, n_res + len(jax.tree.leaves(cot_shape)))
    )
    return Backward(int(xbar), bwd_c, int(bwd_tmp), pullback, unread)


def with_loss(g: Callable, loss: Callable, params: Any, a_shape: Any, rest: Any, rng: Any, input_grad: bool,
               out_bytes: int) -> Callable[[Callable], int]:
    """For the chain's last stage: ``fused(gk)``, the bytes that the stage ``gk`` (the stage, or the
    stage under a checkpoint policy) followed by ``loss`` needs in one program, its forward, the
    loss and its backward, beyond the stage input and parameters, ``delta_L`` and ``delta_{L-1}``:
    at least its bundle plus its ``bwd_tmp`` when the stage is stored, since ``Loss`` and the
    backward run with those live.

    XLA fuses the loss with the last stage's forward and backward, which it schedules together in
    every schedule. Measured on a 12-block GPT (an LM head, then the mean-square loss): the loss
    alone needs nothing beyond its input and gradient, but with the head's forward and backward
    XLA keeps five logit-sized buffers at once (the logits before and after the bias, the loss
    gradient in two layouts, one more copy), 1.5 MiB more than the head's ``Fall; Loss; B`` costs
    measured apart; the store-all and every plan storing the head were 1.7-3.4% under XLA.
    Parameter gradients and ``delta_{L-1}`` count over their live ranges (outputs here,
    temporaries of the step).
    """
    counted = out_bytes + (tree_bytes(a_shape) if input_grad else 0)  # delta_L and delta_{L-1}

    # the executor runs a stored last stage with its kernel reads after its cotangent: so here
    # too (with the barrier the GPT's LM head and loss keep fewer logit-sized buffers)
    ordered = input_grad and orders_kernel_reads(rest, a_shape)

    def fused(gk: Callable) -> int:
        def program(p, a, r, k):
            def stage(p, a):
                return reads_after_cotangent(lambda p, x: gk(p, x, r, k), p, a) if ordered else gk(p, a, r, k)

            return jax.value_and_grad(lambda p, a: loss(stage(p, a)), argnums=(0, 1) if input_grad else 0)(p, a)

        _, extra = transient_bytes(program, params, a_shape, rest, rng, outputs=True, reuse=False)
        return max(0, int(extra) - counted)

    return fused


__all__ = ["Backward", "backward_memory", "kept_bytes", "scan_residual_bytes", "with_loss"]
