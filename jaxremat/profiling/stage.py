"""Measuring one stage: what XLA keeps for its backward, its transients, its times and flops."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxremat.core.compile import measuring_options
from jaxremat.model.cuts import holds_loop
from jaxremat.model.stage import Stage
from jaxremat.model.trees import abstract, is_sharded, sharding_of, tree_bytes, with_shardings
from jaxremat.profiling.buffer_dump import HLO_TYPES
from jaxremat.profiling.rates import ESTIMATED, Rates, estimated_time
from jaxremat.profiling.stage_memory import backward_memory, loop_transients, same_shapes, with_loss
from jaxremat.profiling.timing import Program, StageTimes, option_time, roofline_floor
from jaxremat.profiling.xla_buffers import fused_bytes


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


def _cost(compiled: Any) -> tuple[float, float]:
    ca = compiled.cost_analysis()
    if isinstance(ca, list):
        ca = ca[0] if ca else {}
    # XLA:GPU reports -1 where it cannot count (a cuDNN convolution): 0 here, read as unknown
    return max(0.0, float(ca.get("flops", 0.0))), max(0.0, float(ca.get("bytes accessed", 0.0)))


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


#: What :func:`saves_as` names a policy that saves everything (the stage stored) or nothing (the
#: stage checkpointed, recomputed whole in its backward).
STORE, CHECKPOINT = "store", "checkpoint"


def saves_as(g: Callable, params: Any, a_shape: Any, rest: Any, rng: Any, policies: dict[str, Callable]) -> dict:
    """Per policy, what it saves for ``g``'s backward, from the traced autodiff alone (no compile):
    :data:`STORE` where that is everything, :data:`CHECKPOINT` where nothing, else the program
    (policies of the same program save the same). A ResNet cut before each convolution saves
    everything or nothing under ``dots_saveable`` at every stage: its convolution's output is the
    stage's first value, which no backward reads."""

    def program(policy: Callable) -> str:
        gk = jax.checkpoint(g, policy=policy)
        vjp = lambda p, x, r, k: jax.vjp(lambda p, x: gk(p, x, r, k), p, x)  # noqa: E731
        return str(jax.make_jaxpr(vjp)(params, a_shape, rest, rng))

    if not policies:
        return {}
    ends = {
        program(jax.checkpoint_policies.everything_saveable): STORE,
        program(jax.checkpoint_policies.nothing_saveable): CHECKPOINT,
    }
    return {name: ends.get(text, text) for name, text in ((n, program(p)) for n, p in policies.items())}


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
    timed = method == "measure"  # the forward and FB are run by the timing: compiled as the step is
    fwd_l = jax.jit(g).lower(params, a_shape, rest, rng)
    fwd_c = fwd_l.compile(measuring_options(timed, fwd_l) or None)
    if is_sharded((params, a_shape)):  # on a mesh: the output (and its cotangent) as XLA lays it out
        out_shape = with_shardings(out_shape, fwd_c.output_shardings)
    cot_shape = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding_of(s)), out_shape)
    # a stage holding a loop (a jaxpr chain's lax.scan over stacked layers, never cut) keeps at
    # least the residuals its loop stacks, as a Repeat's copies do: the barrier's live buffers
    # missed them (a 12-layer scan MLP's store-all plan: 18.5 MiB predicted, 43.25 used)
    loop = holds_loop(jax.make_jaxpr(g)(params, a_shape, rest, rng).jaxpr)
    scanned = scanned or loop
    backward = backward_memory(g, params, a_shape, rest, rng, cot_shape, input_grad, scanned)
    xbar, bwd_c, bwd_tmp, pullback, unread = backward
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
        run=timed,
    )
    if loop:
        # what its backward makes from constants is the zeros its loop stacks residuals into,
        # counted in xbar already (an RNN's scan over 64 steps, store-all: 12.17 MiB predicted,
        # 10.19 used, 2 MiB of it the broadcast the stacked buffers start from; CPU, 2026-12-06)
        held = 0
    if scanned:
        # a Repeat's copy runs its FB inside a loop iteration, where XLA keeps the recomputed
        # residuals as JAX's autodiff saves them (as for xbar): at least what Fall; B costs there
        # (without this, every_stage over 48 transformer blocks used 1.39x its plan)
        fb_tmp = max(int(fb_tmp), xbar + max(fwd_tmp - tree_bytes(a_shape), bwd_tmp))
    opts, same = {}, saves_as(g, params, a_shape, rest, rng, policies or {})
    by_program: dict[str, Any] = {STORE: backward}  # a policy saving everything is the stage stored
    for name, policy in (policies or {}).items():
        # policies that save the same residuals here (dots_saveable and
        # dots_with_no_batch_dims_saveable on a stage without batched matmuls) are measured once
        if same[name] not in by_program:
            gk = jax.checkpoint(g, policy=policy)
            by_program[same[name]] = backward_memory(gk, params, a_shape, rest, rng, cot_shape, input_grad, scanned)
        opts[name] = by_program[same[name]]
    ff, fbytes = _cost(fwd_c)
    bf, bb = _cost(bwd_c)
    fbf, fbb = _cost(fb_c)
    costs = {name: _cost(o.compiled) for name, o in opts.items()}
    timer = None
    if method in ESTIMATED:
        assert rates is not None
        roof = lambda flops, nbytes: estimated_time(method, rates, flops, nbytes)  # noqa: E731
        ft, bt = roof(ff, fbytes), roof(bf, bb)
        # FB and the policies' backwards run the backward's work and more: never priced below
        # it; a policy's backward recomputes part of what FB does: never priced above FB
        fbt = roofline_floor(roof(fbf, fbb), bt, ft, fbf, ff, bf)
        opt_t = {
            name: option_time(roofline_floor(roof(*c), bt, ft, c[0], ff, bf), bt, fbt) for name, c in costs.items()
        }
    else:
        backwards = {"backward": _from_residuals(pullback)}
        backwards.update({f"backward under {name}": _from_residuals(o.pullback) for name, o in opts.items()})

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
    opts = {name: o._replace(tmp=o.tmp + grad) for name, o in opts.items()}
    if scanned and not loop and same_shapes(out_shape, a_shape) and not is_sharded((params, a_shape)):
        # a layer of a loop (a Repeat's copy, a scanned stack's layer): its backwards' transients
        # as the loop runs them (the stacked gradient is the loop's, loop_costs)
        inside = loop_transients(g, params, a_shape, rest, rng, {n: policies[n] for n in opts}, same)
        bwd_tmp, fb_tmp = inside["store"], inside["checkpoint"]
        opts = {name: o._replace(tmp=inside[name]) for name, o in opts.items()}
    if loss is not None:
        fused = with_loss(g, loss, params, a_shape, rest, rng, input_grad, tree_bytes(out_shape))

        def need(kept: int, tmp: int, unread: int, gk: Callable) -> tuple[int, int]:
            # B's need as fused with the loss, credited only down to that (a GPT head keeps its
            # logits there: 2-block store-all 1.034x with the whole credit; an autoencoder's not)
            with_loss = fused(gk) - kept
            return max(tmp, with_loss), min(unread, max(0, tmp - with_loss))

        bwd_tmp, unread = need(xbar, bwd_tmp, unread, g)
        # not fb_tmp: the GPT head's FB fused with the loss held 0.25 MiB more than alone, but an
        # MLP layer's alone held 4 MiB more than in the whole step (its 30% plan: XLA at 0.89)
        for name, o in list(opts.items()):
            tmp, unr = need(o.kept, o.tmp, o.unread, jax.checkpoint(g, policy=policies[name]))
            opts[name] = o._replace(tmp=tmp, unread=unr)
    shape_txt = str(jax.tree.map(lambda s: tuple(s.shape), out_shape))
    prof = StageProfile(
        name=st.name, kind=st.kind, out_shape=shape_txt, x_out=tree_bytes(out_shape), xbar=xbar,
        fwd_tmp=fwd_tmp, bwd_tmp=bwd_tmp,
        fwd_flops=ff, bwd_flops=bf, fwd_bytes=fbytes, bwd_bytes=bb, fwd_time=ft, bwd_time=bt,
        fb_time=fbt, fb_tmp=int(fb_tmp), fb_flops=fbf, held=int(held), fb_reuse=int(fb_reuse), unread=unread,
        options=tuple(
            OptionProfile(name, o.kept, o.tmp, *costs[name][:2], opt_t[name], o.unread) for name, o in opts.items()
        ),
    )
    return prof, timer


def with_times(prof: StageProfile, times: StageTimes) -> StageProfile:
    """``prof`` with the times (and flags) of ``times``."""
    options = tuple(dataclasses.replace(o, bwd_time=times.option(o.name)) for o in prof.options)
    return dataclasses.replace(prof, fwd_time=times.forward, bwd_time=times.backward, fb_time=times.fused,
                               options=options, flags=times.flags)


__all__ = ["OptionProfile", "StageProfile", "profile_stage", "with_times"]
