"""Measuring one stage: what XLA keeps for its backward, its transients, its times and flops."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jax_core

from jaxremat.core.compile import barriers_survive, compiler_options
from jaxremat.model.kernel_reads import orders_kernel_reads, reads_after_cotangent
from jaxremat.model.stage import Stage, convolves
from jaxremat.model.trees import abstract, is_sharded, sharding_of, tree_bytes, with_shardings
from jaxremat.profiling.rates import Rates
from jaxremat.profiling.timing import Program, StageTimes, option_time, roofline_floor
from jaxremat.profiling.xla_buffers import (
    HLO_TYPES, bytes_kept_across_barrier, fused_bytes, transient_bytes,
)


@dataclass(frozen=True)
class StageProfile:
    """What the profiler measured for one stage (bytes, seconds, flops)."""

    name: str
    kind: str
    out_shape: str
    x_out: int
    xbar: int
    fwd_tmp: int
    bwd_tmp: int
    fwd_flops: float
    bwd_flops: float
    fwd_bytes: float
    bwd_bytes: float
    fwd_time: float
    bwd_time: float
    fb_time: float = 0.0  # FB: the forward fused with the backward
    fb_tmp: int = 0
    fb_flops: float = 0.0
    options: tuple["OptionProfile", ...] = ()
    flags: tuple[str, ...] = ()  # measurements to doubt (a backward far below its flops' share)
    held: int = 0  # bytes its backward makes from constants alone: a training step makes them at its start
    fb_reuse: int = 0  # what fb_tmp saves by writing an output over the incoming cotangent
    unread: int = 0  # bytes of the output (in xbar) its backward does not read

    @classmethod
    def from_dict(cls, d: dict) -> "StageProfile":
        """From :func:`dataclasses.asdict` output (a cache entry)."""
        d = dict(d)
        d["options"] = tuple(OptionProfile(**o) for o in d.get("options", ()))
        d["flags"] = tuple(d.get("flags", ()))
        return cls(**d)


@dataclass(frozen=True)
class OptionProfile:
    """A stage measured under a checkpoint policy: a store option."""

    name: str
    xbar: int
    bwd_tmp: int
    bwd_flops: float
    bwd_bytes: float
    bwd_time: float
    unread: int = 0  # bytes of the output (in xbar) its backward does not read


def _split_params(v: dict) -> tuple[Any, dict]:
    return v.get("params", {}), {k: t for k, t in v.items() if k != "params"}


def hlo_shape(s: Any) -> str:
    """An array's per-device shape as HLO writes it (``f32[4,32,32,8]``)."""
    shape = tuple(s.shape)
    sharding = getattr(s, "sharding", None)
    if sharding is not None and hasattr(sharding, "shard_shape"):
        shape = tuple(sharding.shard_shape(shape))
    return f"{HLO_TYPES.get(str(s.dtype), (str(s.dtype), 0))[0]}[{','.join(map(str, shape))}]"


def _stage_fn(st: Stage):
    def g(params, a, rest, rng):
        rngs = {s: jax.random.fold_in(rng, k) for k, s in enumerate(st.rng_streams)} if st.rng_streams else None
        return st.apply({**rest, "params": params}, a, rngs)[0]

    return g


def _placed(x: jax.Array, like: Any) -> jax.Array:
    """``x`` laid out as ``like`` (a ShapeDtypeStruct), when that is over several devices."""
    sh = sharding_of(like)
    return x if sh is None else jax.device_put(x, sh)


def _sum_leaves(tree: Any) -> jax.Array:
    return sum(jnp.sum(leaf.astype(jnp.float32)) for leaf in jax.tree.leaves(tree))


def _cost(compiled: Any) -> tuple[float, float]:
    ca = compiled.cost_analysis()
    if isinstance(ca, list):
        ca = ca[0] if ca else {}
    # XLA:GPU reports -1 where it cannot count (a cuDNN convolution): 0 here, read as unknown
    return max(0.0, float(ca.get("flops", 0.0))), max(0.0, float(ca.get("bytes accessed", 0.0)))


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


def scan_residual_bytes(g: Callable, params: Any, a_shape: Any, rest: Any, rng: Any) -> int:
    """Bytes a ``lax.scan`` saves per iteration for a stage's backward, output included.

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


def _backward(g: Callable, params: Any, a_shape: Any, rest: Any, rng: Any, cot_shape: Any, input_grad: bool,
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
    return int(xbar), bwd_c, int(bwd_tmp), pullback, unread


def _with_loss(g: Callable, loss: Callable, params: Any, a_shape: Any, rest: Any, rng: Any, input_grad: bool,
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


def _from_residuals(pullback: Callable) -> Callable[..., Program]:
    """The backward as a program of its residuals and the cotangent: a function of the stage's
    concrete arguments ``(p, a, r, rng, cot)`` that returns it with concrete residuals, traced and
    compiled once however often it is called (the profiler times each stage several times)."""
    program: Callable | None = None

    def make(p: Any, a: Any, r: Any, rng: Any, cot: Any) -> Program:
        nonlocal program
        leaves, tree = jax.tree.flatten(pullback(p, a, r, rng))
        if program is None:
            program = jax.jit(lambda leaves, c: tree.unflatten(leaves)(c))
        return program, (leaves, cot)

    return make


def profile_stage(
    st: Stage, variables: dict, a_shape: Any, *, method: str, rates: Rates | None, repeats: int = 5,
    input_grad: bool = True, scanned: bool = False, policies: dict[str, Callable] | None = None,
    loss: Callable | None = None,
) -> tuple[StageProfile, StageTimes | None]:
    """Measure one stage: stored whole, under each checkpoint policy of ``policies`` (its store
    options), and fused forward-backward (``FB``). ``input_grad=False`` (the chain's first
    stage) leaves the input's gradient out of the backward, as a training step never computes it.
    ``scanned=True`` (a :class:`~jaxremat.Repeat`'s copies, stored inside a loop) counts in
    ``xbar`` at least what the loop saves (:func:`scan_residual_bytes`).

    ``FB``'s bytes are the transient bytes of the stage's forward and backward compiled as one
    program (beyond its inputs and outputs, inputs credited once XLA frees them but not for an
    output written over a dying input), its time that program's. With ``method="measure"`` every
    program is timed in interleaved rounds
    (:mod:`~jaxremat.profiling.timing`): the forward, the backward from its residuals, ``FB``, and
    each option's backward.

    ``loss`` (the chain's last stage only): the loss the training step applies to the stage's
    output. The backwards are then also measured with it (:func:`_with_loss`), as the whole step
    runs them.

    Returns the profile and, with ``method="measure"``, its programs to time
    (:class:`~jaxremat.profiling.timing.StageTimes`): the profile's times are zero until
    :func:`with_times` puts theirs in."""
    g = _stage_fn(st)
    params, rest = _split_params(abstract(variables))  # shapes only: works under a trace
    rng = jax.random.key(0)
    out_shape = jax.eval_shape(g, params, a_shape, rest, rng)
    fwd_c = jax.jit(g).lower(params, a_shape, rest, rng).compile(compiler_options() or None)
    if is_sharded((params, a_shape)):  # on a mesh: the output (and its cotangent) as XLA lays it out
        out_shape = with_shardings(out_shape, fwd_c.output_shardings)
    cot_shape = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding_of(s)), out_shape)
    xbar, bwd_c, bwd_tmp, pullback, unread = _backward(g, params, a_shape, rest, rng, cot_shape, input_grad, scanned)
    fwd_tmp = int(fwd_c.memory_analysis().temp_size_in_bytes)
    # FB's bytes with the credit for an output written over a dying input only where that input
    # is the incoming cotangent: a training step writes gelu'(h) * g over g (an MLP's every-stage
    # step: 36 MiB, as now predicted, where no credit predicted 40), but not over a dying stage
    # input (a residual block with every input credited: 1.11x the plan)
    before = len(jax.tree.leaves((params, a_shape, rest, rng)))
    cot_params = range(before, before + len(jax.tree.leaves(cot_shape)))
    fb_c, fb_tmp, fb_reuse, held = fused_bytes(
        lambda p, x, r, k, c: pullback(p, x, r, k)(c), params, a_shape, rest, rng, cot_shape, reuse=cot_params,
        constants=[hlo_shape(s) for s in jax.tree.leaves((a_shape, params) if input_grad else params)],
    )
    if scanned:
        # a Repeat's copy runs its FB inside a loop iteration, where XLA keeps the recomputed
        # residuals as JAX's autodiff saves them (as for xbar): at least what Fall; B costs there
        # (without this, every_stage over 48 transformer blocks used 1.39x its plan)
        fb_tmp = max(int(fb_tmp), xbar + max(fwd_tmp - tree_bytes(a_shape), bwd_tmp))
    opts, by_program = {}, {}
    for name, policy in (policies or {}).items():
        gk = jax.checkpoint(g, policy=policy)
        # policies that save the same residuals here (dots_saveable and
        # dots_with_no_batch_dims_saveable on a stage without batched matmuls) are measured once
        vjp = lambda p, x, r, k: jax.vjp(lambda p, x: gk(p, x, r, k), p, x)  # noqa: E731
        program = str(jax.make_jaxpr(vjp)(params, a_shape, rest, rng))
        if program not in by_program:
            by_program[program] = _backward(gk, params, a_shape, rest, rng, cot_shape, input_grad, scanned)
        opts[name] = by_program[program]
    ff, fbytes = _cost(fwd_c)
    bf, bb = _cost(bwd_c)
    fbf, fbb = _cost(fb_c)
    costs = {name: _cost(o[1]) for name, o in opts.items()}
    timer = None
    if method == "xla":
        assert rates is not None
        roof = lambda flops, nbytes: max(flops / rates.flops, nbytes / rates.bandwidth)  # noqa: E731
        ft, bt = roof(ff, fbytes), roof(bf, bb)
        # FB and the policies' backwards run the backward's work and more: never priced below
        # it; a policy's backward recomputes part of what FB does: never priced above FB
        fbt = roofline_floor(roof(fbf, fbb), bt, ft, fbf, ff, bf)
        opt_t = {
            name: option_time(roofline_floor(roof(*c), bt, ft, c[0], ff, bf), bt, fbt) for name, c in costs.items()
        }
    else:
        backwards = {"backward": _from_residuals(pullback)}
        backwards.update({f"backward under {name}": _from_residuals(o[3]) for name, o in opts.items()})

        def build() -> dict[str, Program]:
            concrete = lambda s: _placed(jnp.zeros(s.shape, s.dtype), s)  # noqa: E731
            a, p, r = jax.tree.map(concrete, (a_shape, params, rest))
            cot = jax.tree.map(lambda s: _placed(jnp.ones(s.shape, s.dtype), s), cot_shape)
            programs = {"forward": (fwd_c, (p, a, r, rng)), "FB": (fb_c, (p, a, r, rng, cot))}
            return programs | {name: make(p, a, r, rng, cot) for name, make in backwards.items()}

        flops = {"forward": ff, "backward": bf, "FB": fbf, **{f"backward under {n}": costs[n][0] for n in opts}}
        timer = StageTimes(build, flops)  # timed by the caller (with_times puts its times in)
        ft = bt = fbt = 0.0
        opt_t = {name: 0.0 for name in opts}
    # The parameter gradient: in the update step (parameters and optimizer state donated) every
    # backward of the stage holds it, a temporary the update reads; the programs above return it
    # (their transients leave it out, and XLA parks temporaries in it). An MLP layer's FB with an
    # update inside held exactly its gradient more (1 MiB), a transformer block's 0.58 of it.
    grad = tree_bytes(params)
    fb_tmp, bwd_tmp = int(fb_tmp) + grad, int(bwd_tmp) + grad
    opts = {name: (o[0], o[1], o[2] + grad, o[3], o[4]) for name, o in opts.items()}
    if loss is not None:
        fused = _with_loss(g, loss, params, a_shape, rest, rng, input_grad, tree_bytes(out_shape))

        def need(kept: int, tmp: int, unread: int, gk: Callable) -> tuple[int, int]:
            # B's need as fused with the loss, credited only down to that (a GPT head keeps its
            # logits there: 2-block store-all 1.034x with the whole credit; an autoencoder's not)
            with_loss = fused(gk) - kept
            return max(tmp, with_loss), min(unread, max(0, tmp - with_loss))

        bwd_tmp, unread = need(xbar, bwd_tmp, unread, g)
        # not fb_tmp: the GPT head's FB fused with the loss held 0.25 MiB more than alone, but an
        # MLP layer's alone held 4 MiB more than in the whole step (its 30% plan: XLA at 0.89)
        for name, o in list(opts.items()):
            tmp, unr = need(o[0], o[2], o[4], jax.checkpoint(g, policy=policies[name]))
            opts[name] = (o[0], o[1], tmp, o[3], unr)
    shape_txt = str(jax.tree.map(lambda s: tuple(s.shape), out_shape))
    prof = StageProfile(
        name=st.name, kind=st.kind, out_shape=shape_txt, x_out=tree_bytes(out_shape), xbar=xbar,
        fwd_tmp=fwd_tmp, bwd_tmp=bwd_tmp,
        fwd_flops=ff, bwd_flops=bf, fwd_bytes=fbytes, bwd_bytes=bb, fwd_time=ft, bwd_time=bt,
        fb_time=fbt, fb_tmp=int(fb_tmp), fb_flops=fbf, held=int(held), fb_reuse=int(fb_reuse), unread=unread,
        options=tuple(
            OptionProfile(name, o[0], o[2], *costs[name][:2], opt_t[name], o[4]) for name, o in opts.items()
        ),
    )
    return prof, timer


def with_times(prof: StageProfile, times: StageTimes) -> StageProfile:
    """``prof`` with the times (and flags) of ``times``."""
    options = tuple(dataclasses.replace(o, bwd_time=times.option(o.name)) for o in prof.options)
    return dataclasses.replace(prof, fwd_time=times.forward, bwd_time=times.backward, fb_time=times.fused,
                               options=options, flags=times.flags)


__all__ = [
    "OptionProfile", "StageProfile", "kept_bytes", "profile_stage", "scan_residual_bytes", "with_times",
]
