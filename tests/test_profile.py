"""Chain building and the XLA-measured per-stage costs (issue 3, first part)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TanhDense

from jaxremat.model.chain import Chain
from jaxremat.model.trees import tree_bytes
from jaxremat.profiling import Rates, profile_stages, report
from jaxremat import profile

RATES = Rates(flops=1e10, bandwidth=1e10)  # fixed, so "xla" times are deterministic


class Block(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        return nn.gelu(nn.Dense(self.width)(x))


def test_sequential_layout_round_trips():
    seq = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(4)])
    x = jnp.ones((2, 5))
    chain = Chain.from_linen(seq)
    v = chain.init(jax.random.key(0), x)
    plain = seq.init(jax.random.key(0), x)
    assert jax.tree.structure(v) == jax.tree.structure(plain)
    assert jax.tree.map(jnp.shape, v) == jax.tree.map(jnp.shape, plain)
    np.testing.assert_allclose(chain.apply(v, x), seq.apply(v, x), rtol=1e-6)


def test_from_functions_and_pytree_activations():
    def first(p, x):
        return (x @ p, jnp.ones(x.shape[0], jnp.int32))

    def second(p, hm):
        h, mask = hm
        return h * mask[:, None] * p

    pairs = [(first, jnp.ones((3, 4))), (second, jnp.float32(2.0))]
    chain = Chain.from_functions(pairs)
    shapes = chain.shapes(Chain.function_variables(pairs), jnp.ones((2, 3)))
    assert tree_bytes(shapes[1]) == 2 * 4 * 4 + 2 * 4
    costs = profile(chain, Chain.function_variables(pairs), jnp.ones((2, 3)), method="xla", rates=RATES)
    assert list(costs.x) == [24, 40, 32]


def test_bad_chains_say_what_is_wrong():
    with pytest.raises(ValueError, match="needs at least one"):
        Chain.from_linen([])
    with pytest.raises(ValueError, match="needs at least one"):
        Chain.from_functions([])
    chain = Chain.from_functions([(lambda p, x: x @ p, jnp.ones((3, 4))), (lambda p, x: x @ p, jnp.ones((5, 2)))])
    with pytest.raises(ValueError, match=r"stage 1 \(1:<lambda>\) cannot take the output of stage 0"):
        chain.shapes([{"params": jnp.ones((3, 4))}, {"params": jnp.ones((5, 2))}], jnp.ones((2, 3)))
    odd = Chain.from_functions([(lambda p, x: (x, "tag"), None)])
    with pytest.raises(ValueError, match="non-array leaf"):
        odd.shapes([{"params": None}], jnp.ones((2, 3)))
    with pytest.raises(ValueError, match="list of linen modules or an nn.Sequential"):
        Chain.from_linen(Block(4))


def test_xbar_is_what_xla_keeps_for_dense_gelu():
    # XLA keeps the pre-activation, tanh(...) of the gelu and the output: three activations,
    # the same three buffers per block that the whole training step keeps (checked in the dump).
    chain = Chain.from_linen([Block(256) for _ in range(3)])
    x = jnp.ones((512, 256))
    v = chain.init(jax.random.key(0), x)
    costs, stages = profile_stages(chain, v, x, method="xla", rates=RATES)
    act = 512 * 256 * 4
    assert list(costs.x) == [act] * 4
    for xb in costs.xbar:
        assert 3 * act <= xb <= 3 * act + 64  # plus the 4-byte scalar the probe sums
    assert all(s.fwd_flops > 2 * 512 * 256 * 256 for s in stages)
    assert all(s.bwd_flops > s.fwd_flops for s in stages)
    # a training step never computes the chain input's gradient: one matmul fewer in stage 0
    assert stages[0].bwd_flops == pytest.approx(stages[1].bwd_flops - 2 * 512 * 256 * 256, rel=0.02)
    assert costs.fwd[0] == pytest.approx(max(stages[0].fwd_flops, stages[0].fwd_bytes) / 1e10)


def test_profiling_does_not_touch_the_callers_variables():
    chain = Chain.from_linen([Block(32), Block(32)])
    x = jnp.ones((8, 32))
    v = chain.init(jax.random.key(1), x)
    before = jax.tree.map(np.array, v)
    profile(chain, v, x, method="measure", repeats=1)
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.array, v))


def _count_profiles(monkeypatch):
    import jaxremat.profiling.profiler as prof

    calls = []
    real = prof.profile_stage

    def counting(*a, **k):
        calls.append(a[0].name)
        return real(*a, **k)

    monkeypatch.setattr(prof, "profile_stage", counting)
    return calls


def test_identical_stages_once_and_disk_cache(monkeypatch, tmp_path):
    calls = _count_profiles(monkeypatch)
    chain = Chain.from_linen([Block(64), Block(64), Block(64), Block(32)])
    x = jnp.ones((16, 64))
    v = chain.init(jax.random.key(0), x)
    first = profile(chain, v, x, method="xla", rates=RATES)
    # the first block (whose input gradient no step computes), the two identical others once,
    # and the narrower one
    assert len(calls) == 3
    second = profile(chain, v, x, method="xla", rates=RATES)
    assert len(calls) == 3 and second == first  # served from disk
    profile(chain, v, x, method="xla", rates=RATES, cache=False)
    assert len(calls) == 6  # no disk cache (identical stages still measured once)
    profile(chain, v, jnp.ones((8, 64)), method="xla", rates=RATES)
    assert len(calls) == 9  # another input shape is another entry


def test_every_stage_is_timed_several_times_once_all_are_compiled(monkeypatch):
    """A slow spell of the machine can outlast a stage's rounds (a ResNet's stem and first block
    15-20% slower in a process's first profile than in its second, most often right after the
    stage's compile): every stage is timed ``TIMINGS`` times once all are compiled, each
    program's fastest time kept, and the disk cache holds that."""
    from jaxremat.profiling import timing

    events = _count_profiles(monkeypatch)
    timings = [  # per program, seconds: what each timing of a stage finds (the last one again after)
        {"forward": 4e-3, "backward": 6e-3, "FB": 9e-3},
        {"forward": 3e-3, "backward": 7e-3, "FB": 9e-3},
        {"forward": 3.5e-3, "backward": 8e-3, "FB": 8e-3},
    ]
    timed: dict[int, int] = {}

    def fake(programs, rounds, seed=0):
        key = id(programs["forward"][0])  # the stage's compiled forward
        n = timed.setdefault(key, 0)
        timed[key] += 1
        events.append(f"timing {n}")
        return {name: timings[min(n, 2)][name] for name in programs}

    monkeypatch.setattr(timing, "interleaved_times", fake)
    chain = Chain.from_linen([Block(32), Block(16)])
    x = jnp.ones((8, 32))
    v = chain.init(jax.random.key(0), x)
    costs, stages = profile_stages(chain, v, x, method="measure", quiet=True, policies=())
    names = [st.name for st in chain.stages]
    # the stages measured side by side (in threads: in any order), then timed
    assert sorted(events[: len(names)]) == sorted(names)
    assert events[len(names) :] == [f"timing {n}" for n in range(timing.TIMINGS) for _ in names]
    for s in stages:
        assert (s.fwd_time, s.bwd_time) == (3e-3, 6e-3)
        assert s.fb_time == timing.fused_time(8e-3, 3e-3, 6e-3, s.fb_flops, s.fwd_flops, s.bwd_flops) <= 8e-3
    again, _ = profile_stages(chain, v, x, method="measure", quiet=True, policies=())
    assert again == costs and len(events) == 2 + 2 * timing.TIMINGS  # from disk


def test_corrupt_cache_entry_is_ignored_with_a_warning(monkeypatch):
    from jaxremat.profiling import cache

    calls = _count_profiles(monkeypatch)
    chain = Chain.from_linen([Block(16)])
    x = jnp.ones((4, 16))
    v = chain.init(jax.random.key(0), x)
    profile(chain, v, x, method="xla", rates=RATES)
    (entry,) = list(cache.cache_dir().glob("*.json"))
    entry.write_text('{"format": "jaxremat-stage-profile-v1", "key": ')  # truncated
    with pytest.warns(UserWarning, match="ignoring cache entry"):
        profile(chain, v, x, method="xla", rates=RATES)
    assert len(calls) == 2
    entry.write_text('{"format": "something else"}')
    with pytest.warns(UserWarning, match="ignoring cache entry"):
        profile(chain, v, x, method="xla", rates=RATES)
    assert not list(cache.cache_dir().glob(".tmp-*"))


def test_dropout_and_batch_stats_stages_profile():
    class Noisy(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(32)(x)
            x = nn.BatchNorm(use_running_average=False)(x)
            return nn.Dropout(0.5, deterministic=False)(x)

    chain = Chain.from_linen([Noisy(), Noisy()], mutable=("batch_stats",), rng_streams=("dropout",))
    x = jnp.ones((8, 32))
    v = chain.init(jax.random.key(0), x)
    assert "batch_stats" in v[0] and "params" in v[0]
    before = jax.tree.map(np.array, v)
    costs, stages = profile_stages(chain, v, x, method="xla", rates=RATES)
    assert all(xb > 0 for xb in costs.xbar)
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.array, v))
    text = report(stages)
    assert "Noisy" in text and "(8, 32)" in text and "KiB" in text


def test_nnx_chain_matches_the_module_and_profiles():
    from flax import nnx

    seq = nnx.Sequential(
        nnx.Linear(16, 32, rngs=nnx.Rngs(0)),
        nnx.relu,
        nnx.BatchNorm(32, rngs=nnx.Rngs(1)),
        nnx.Linear(32, 8, rngs=nnx.Rngs(2)),
    )
    chain = Chain.from_nnx(seq)
    x = jnp.ones((4, 16))
    v = chain.init(jax.random.key(0), x)
    np.testing.assert_allclose(chain.apply(v, x), seq(x), rtol=1e-5, atol=1e-6)
    costs = profile(chain, v, x, method="xla", rates=RATES)
    assert list(costs.x) == [4 * 16 * 4, 4 * 32 * 4, 4 * 32 * 4, 4 * 32 * 4, 4 * 8 * 4]
    with pytest.raises(ValueError, match="an nnx.Sequential, an nnx.List or a list of NNX modules"):
        Chain.from_nnx(seq.layers[0])


def test_xla_method_without_rates_measures_them_once(monkeypatch):
    import jaxremat.profiling.rates as prof

    measured = []
    monkeypatch.setattr(prof, "measure_rates", lambda: measured.append(1) or Rates(2e10, 1e10))
    chain = Chain.from_linen([Block(16)])
    x = jnp.ones((4, 16))
    v = chain.init(jax.random.key(0), x)
    a = profile(chain, v, x, method="xla")
    b = profile(chain, v, x, method="xla")
    assert measured == [1] and a == b  # the rates come from the cache the second time
    # "flops": each program's compiled flops at the flop rate, bytes not counted
    f = profile(chain, v, x, method="flops")
    np.testing.assert_allclose(f.fwd, f.fwd_flops / 2e10)
    np.testing.assert_allclose(f.bwd, f.bwd_flops / 2e10)
    assert measured == [1] and np.all(f.fwd <= a.fwd) and np.all(f.bwd <= a.bwd)
    with pytest.raises(ValueError, match="method must be 'measure', 'flops' or 'xla'"):
        profile(chain, v, x, method="guess")


def test_short_programs_are_timed_over_several_calls_per_round():
    """A program of microseconds runs back to back within a round, and its time is per call."""
    from jaxremat.profiling import timing

    tiny = jax.jit(lambda x: x + 1.0)
    x = jnp.ones(8)
    jax.block_until_ready(tiny(x))  # compiled: what the warm-up call does
    assert timing._calls(tiny, (x,)) > 1
    t = timing.interleaved_times({"tiny": (tiny, (x,))}, rounds=3)["tiny"]
    assert 0 < t < timing.ROUND_SECONDS


def test_function_keys_are_the_same_in_every_process_and_tell_functions_apart():
    """Stage and loss keys (the disk cache's, a plan's signature) come from a function's code: a
    lambda or comprehension inside it is compiled anew per process with a new address in its
    ``repr``, so the key must not read that; and two functions whose bytecode differs only in the
    names they call (``jnp.sum`` against ``jnp.mean``) must not share one."""
    from jaxremat.model.identity import closure_key, function_key

    source = "def loss(out):\n    return sum(jnp.mean(leaf ** 2) for leaf in jax.tree.leaves(out))\n"

    def fresh(src):  # the same source compiled again: what another process sees
        scope = {"jnp": jnp, "jax": jax}
        exec(compile(src, "<model>", "exec"), scope)
        return scope["loss"]

    a, b = fresh(source), fresh(source)
    assert a.__code__ is not b.__code__ and function_key(a) == function_key(b) and closure_key(a) == closure_key(b)
    assert function_key(fresh(source.replace("jnp.mean", "jnp.sum"))) != function_key(a)
    assert function_key(lambda x: jnp.tanh(x)) != function_key(lambda x: jnp.sin(x))


def test_the_first_stage_counts_the_copies_of_the_step_input_it_keeps():
    """A strided convolution's weight gradient reads its input as patches, which XLA copies in
    the forward and keeps. For a later stage the step keeps that copy *instead of* the input, so
    it is left out of ``xbar``; but the chain input ``a_0`` is the step's argument, live anyway,
    and the copy is kept beside it (the Mixer's patch embedding: 192 KiB, 52.83 against 52.64 MiB
    for the schedule storing every stage under ``dots_saveable`` with the embedding stored
    whole)."""
    from jaxremat.profiling.stage import _split_params, _stage_fn
    from jaxremat.profiling.stage_memory import kept_bytes
    from jaxremat.tools.models import MixerBlock, PatchEmbed

    x = jnp.ones((4, 16, 16, 3))
    chain = Chain.from_linen(nn.Sequential([PatchEmbed(4, 16), MixerBlock(32, 64)]))
    v = chain.init(jax.random.key(0), x)
    costs = profile(chain, v, x, method="xla", rates=RATES, cache=False, quiet=True, policies={})
    out = int(costs.x[1])
    assert costs.xbar[0] == out + x.size * 4 + 4  # the output, the patches, the probe's scalar
    # the same stage measured as a later stage's would be: the copy replaces its input there
    g = _stage_fn(chain.stages[0])
    params, rest = _split_params(chain.split(v)[0])
    a = jax.ShapeDtypeStruct(x.shape, x.dtype)
    cot = jax.eval_shape(g, params, a, rest, jax.random.key(0))
    assert kept_bytes(g, params, a, rest, jax.random.key(0), cot) == out + 4


def test_an_output_written_over_a_dying_temporary_shares_its_bytes():
    """Live ranges include both ends, so at an element-wise fusion that writes its output over an
    operand dying there both are live; the buffer assignment gives them one slot, and the bytes
    they share count once. A GPT block's fused forward-backward measured 1 MiB more without this."""
    from jaxremat.profiling.buffer_dump import _Slot
    from jaxremat.profiling.xla_buffers import _peak

    seq = ["a", "b", "c", "d"]
    ranges = {"a{}": (0, 2), "b{}": (2, 3), "c{}": (1, 3)}
    slots = {"a{}": _Slot(0, 0, 100), "b{}": _Slot(0, 0, 100), "c{}": _Slot(0, 100, 50)}
    assert _peak(seq, ranges, slots)[:4] == [100, 150, 150, 150]  # b over a at 2: counted once
    moved = {**slots, "b{}": _Slot(1, 0, 100)}  # another allocation: both live at 2
    assert _peak(seq, ranges, moved)[:4] == [100, 150, 250, 150]
    apart = {**slots, "b{}": _Slot(0, 160, 100)}  # same allocation, bytes apart
    assert _peak(seq, ranges, apart)[:4] == [100, 150, 250, 150]


def test_without_a_barrier_in_the_buffers_xbar_is_jaxs_residuals(monkeypatch):
    # XLA:GPU expands optimisation barriers before its buffer assignment (and fails to compile
    # one kept): there, a stage keeps what jax.vjp hands its backward. Forced here on the CPU.
    from jaxremat.profiling import stage_memory as stage_mod

    monkeypatch.setattr(stage_mod, "barriers_survive", lambda: False)

    def no_barrier(*a, **k):
        raise AssertionError("read the buffers across a barrier the backend does not keep")

    monkeypatch.setattr(stage_mod, "bytes_kept_across_barrier", no_barrier)
    chain = Chain.from_linen([Block(128) for _ in range(2)])
    x = jnp.ones((64, 128))
    v = chain.init(jax.random.key(0), x)
    costs = profile(chain, v, x, method="xla", rates=RATES, cache=False, quiet=True)
    act = 64 * 128 * 4
    # gelu's residuals as JAX chooses them (pre-activation and its pieces), the output on top
    assert all(2 * act <= xb <= 6 * act for xb in costs.xbar)


def test_flops_xla_cannot_count_read_as_unknown():
    # XLA:GPU's cost analysis says -1 for a cuDNN convolution (seen on an H200, jax 0.11.2)
    from jaxremat.profiling.stage import _cost

    class Compiled:
        def cost_analysis(self):
            return {"flops": -1.0, "bytes accessed": 2048.0}

    assert _cost(Compiled()) == (0.0, 2048.0)


class ReluDense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.relu(nn.Dense(64, use_bias=False)(x))


def test_unread_is_the_output_bytes_a_backward_does_not_read():
    """A ReLU's backward reads the pre-activation (or a mask of it), never the output: XLA frees
    the output once the next stage's backward has read it. A tanh's backward reads its output.
    An option that keeps nothing but the output (``nothing_saveable``) gets no credit: its
    backward recomputes the whole stage. Nor does the last stage (read by the loss)."""
    chain = Chain.from_linen([ReluDense(), TanhDense(), ReluDense(), ReluDense()])
    x = jnp.ones((128, 64))
    v = chain.init(jax.random.key(0), x)
    policies = {"dots": jax.checkpoint_policies.dots_saveable, "nothing": jax.checkpoint_policies.nothing_saveable}
    costs, stages = profile_stages(chain, v, x, method="xla", rates=RATES, policies=policies)
    act = 128 * 64 * 4
    # the last stage's output is read by the loss, which XLA fuses with it: no credit there
    assert list(costs.unread) == [act, 0, act, 0]
    for p in stages:
        by_name = {o.name: o for o in p.options}
        assert by_name["nothing"].unread == 0
        # under dots_saveable the backward recomputes tanh from the kept x @ w: its output unread
        assert by_name["dots"].unread == (0 if p is stages[-1] else act)
    # B's need below its bundle's, as the solvers read it
    assert costs.option(2, 0).bwd_need == costs.bwd_tmp[2] - act


def test_the_progress_bar_shows_only_after_two_seconds_on_a_terminal(monkeypatch):
    """Profiling shows a bar on a terminal once it has taken longer than ``AFTER`` seconds, with
    the distinct stages measured beside the count; never when quiet or for quick work."""
    import sys

    import rich.progress

    from jaxremat.profiling.progress import progress

    made = []

    class Bar:
        def __init__(self, *args, **kwargs):
            self.updates = []
            made.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def add_task(self, label, total, completed):
            self.start = (label, total, completed)
            return 0

        def update(self, task, completed, description):
            self.updates.append((completed, description))

    monkeypatch.setattr(rich.progress, "Progress", Bar)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    for quiet, after in ((True, 0.0), (False, 100.0)):
        with progress(3, "profiling stages", quiet, after=after) as advance:
            for _ in range(3):
                advance("1 distinct")
    assert not made
    with progress(3, "profiling stages", False, after=0.0) as advance:
        for n in range(3):
            advance(f"{n + 1} distinct: {n + 1} measured, 0 from the cache")
    (bar,) = made
    assert bar.start == ("profiling stages", 3, 0)
    assert bar.updates[-1] == (3, "profiling stages (3 distinct: 3 measured, 0 from the cache)")


def test_stages_that_slice_their_inputs_in_different_places_are_measured_once():
    """Blocks that differ only by which row of an input they read (each block of an equinox list
    draws its dropout keys from its own row of one split) are different stages, one cost."""
    from jaxremat.model.identity import stage_identity
    from jaxremat.model.jaxpr_chain import JaxprChain, trace

    def f(ws, x, rows):
        h = x
        for i in range(6):
            h = jnp.tanh(h @ ws[i]) * (rows[i] > 0)
        return jnp.mean(h**2)

    ws, x, rows = jnp.ones((6, 16, 16)), jnp.ones((8, 16)), jnp.ones((6, 16), jnp.int32)
    traced = JaxprChain.of(trace(f, (ws, x, rows))[0])  # cut before each matmul: 2-4 alike
    stages = traced.chain.stages[2:5]
    shapes = traced.chain.split(traced.variable_shapes([ws, x, rows]))[2:5]
    assert len({stage_identity(st, v) for st, v in zip(stages, shapes)}) == 3
    assert len({stage_identity(st, v, costs=True) for st, v in zip(stages, shapes)}) == 1


def test_stages_measured_side_by_side_measure_as_one_after_another(monkeypatch):
    """Compiling the distinct stages in threads changes no figure of the profile."""
    from jaxremat.profiling import parallel

    chain = Chain.from_linen([Block(64), Block(32), Block(16)])
    x = jnp.ones((16, 64))
    v = chain.init(jax.random.key(0), x)
    side = profile(chain, v, x, method="xla", rates=RATES, cache=False)
    monkeypatch.setattr(parallel, "COMPILE_THREADS", 1)
    assert parallel.threads() == 1 and parallel.side_by_side(lambda n: 2 * n, range(4)) == [0, 2, 4, 6]
    assert profile(chain, v, x, method="xla", rates=RATES, cache=False) == side


def test_policies_that_save_everything_or_nothing_are_named_before_any_compile():
    from jaxremat.profiling.stage import CHECKPOINT, STORE, saves_as

    cp = jax.checkpoint_policies
    policies = {"all": cp.everything_saveable, "none": cp.nothing_saveable, "dots": cp.dots_saveable,
                "dots2": cp.dots_with_no_batch_dims_saveable}
    args = (jax.ShapeDtypeStruct((8, 8), jnp.float32), jax.ShapeDtypeStruct((4, 8), jnp.float32), {}, None)

    def dense_tanh(p, x, r, k):  # tanh's backward reads what the dot made: dots_saveable saves it
        return jnp.tanh(x @ p)

    def dot_first(p, x, r, k):  # a linear contraction's backward reads only its inputs
        return x @ p

    same = saves_as(dense_tanh, *args, policies)
    assert (same["all"], same["none"]) == (STORE, CHECKPOINT)
    assert same["dots"] not in (STORE, CHECKPOINT) and same["dots"] == same["dots2"]
    assert saves_as(dot_first, *args, policies)["dots"] == CHECKPOINT
    assert saves_as(dense_tanh, *args, {}) == {}


class ConvBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.relu(nn.GroupNorm(num_groups=4)(nn.Conv(8, (3, 3))(x)))


def test_programs_compiled_to_be_measured_measure_as_the_step_compiles(monkeypatch):
    """The profile's programs are compiled with LLVM at its lowest level on the CPU (a third of
    the compile time) and, holding no gather or scatter, without XLA's fusion emitters (half of
    the rest): every byte and flop of the profile, and a whole step's temp and flops, are what
    the step's own options give."""
    from jaxremat.core import compile as compile_options

    assert compile_options.measuring_options(run=True) == compile_options.compiler_options()
    chain = Chain.from_linen([ConvBlock(), ConvBlock(), nn.Dense(4)])
    x = jnp.ones((2, 8, 8, 3))
    v = chain.init(jax.random.key(0), x)

    def step(v, x):
        return jax.grad(lambda v: jnp.sum(chain.apply(v, x) ** 2))(v)

    lowered = jax.jit(step).lower(v, x)
    assert compile_options.PLAIN_EMITTER_OPTIONS.items() <= compile_options.measuring_options(lowered=lowered).items()

    def measured() -> tuple:
        c = lowered.compile(compile_options.measuring_options(lowered=lowered) or None)
        cost = c.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        costs = profile(chain, v, x, method="xla", rates=RATES, cache=False)
        return c.memory_analysis().temp_size_in_bytes, cost["flops"], costs

    fast = measured()
    monkeypatch.setattr(compile_options, "MEASURING_OPTIONS", {})
    monkeypatch.setattr(compile_options, "PLAIN_EMITTER_OPTIONS", {})
    assert measured() == fast


def test_a_program_with_a_gather_or_scatter_keeps_the_fusion_emitters():
    """XLA:CPU simplifies gathers and scatters for its fusion emitters: a program holding one is
    measured with them, as the step compiles it (a GPT's embedding backward measured 2.36 MiB
    without them, where the step holds 2.88)."""
    from jaxremat.core import compile as compile_options

    table, ids = jnp.ones((64, 8)), jnp.arange(4)
    for fn in (lambda t, i: jnp.take(t, i, axis=0), lambda t, i: t.at[i].add(1.0)):
        lowered = jax.jit(jax.grad(lambda t, i: jnp.sum(fn(t, i) ** 2))).lower(table, ids)
        assert "xla_cpu_use_fusion_emitters" not in compile_options.measuring_options(lowered=lowered)
