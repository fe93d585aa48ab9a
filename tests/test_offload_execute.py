"""Executing offload schedules: gradients, dropout and batch statistics exact; the traced step
holds exactly the planned transfers; lowered for a GPU, XLA is handed them."""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxremat as jr
from jaxremat.core.ops import OpKind
from conftest import Noisy, plain_forward
from jaxremat import profile
from jaxremat.model.chain import Chain
from jaxremat.profiling import Rates
from jaxremat.core.compile import as_planned
from jaxremat.core.loops import REGION, STORE, Part
from jaxremat.core.ops import Op
from jaxremat.core.tree import to_ops
from jaxremat.run.executor import execute
from jaxremat.run.loop_plan import CopyKind
from jaxremat.run.offload_loop import offload_scan
from jaxremat.solvers.periodic import periodic_tree


class Wide(nn.Module):
    """A stage whose backward keeps a residual bigger than its output (a hidden layer)."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(16)(nn.gelu(nn.Dense(64)(x)))


def _grads(f, variables, x, rngs):
    def loss(params):
        v = [{**u, "params": p} for u, p in zip(variables, params)]
        out, updates = f(v, x, rngs)
        return jnp.mean(out**2), (out, updates)

    return jax.value_and_grad(loss, has_aux=True)([u["params"] for u in variables])


def _offload_schedules(chain, v, x):
    """``optimal_offload`` schedules at a range of budgets that move something (a fast link)."""
    costs = profile(chain, v, x, method="xla", rates=Rates(1e10, 1e10), cache=False, quiet=True)
    lo = jr.min_budget(costs, algorithm="optimal_offload", bandwidth=1e12)
    hi = jr.store_all_peak(costs)
    found = []
    for share in np.linspace(0, 0.9, 19):
        s = jr.solve(costs, int(lo + share * (hi - lo)), algorithm="optimal_offload", bandwidth=1e12)
        if s.offloads and s.ops not in [f.ops for f in found]:
            found.append(s)
    assert found, "no budget made optimal_offload move anything"
    return costs, found


@pytest.fixture(scope="module")
def noisy():
    chain = Chain.from_linen(
        [Noisy() if i % 2 else Wide() for i in range(6)], mutable=("batch_stats",), rng_streams=("dropout",)
    )
    x = jax.random.normal(jax.random.key(1), (8, 16))
    v = chain.init(jax.random.key(0), x)
    costs, schedules = _offload_schedules(chain, v, x)
    return chain, x, v, costs, schedules


def test_gradients_dropout_and_batch_stats_are_exact(noisy):
    chain, x, v, costs, schedules = noisy
    rngs = {"dropout": jax.random.key(7)}
    ref = jax.jit(lambda v, x: _grads(plain_forward(chain), v, x, rngs))(v, x)
    kinds = set()
    for s in schedules:
        kinds |= {op.buffer for op in s.offloads}
        f = execute(chain, s)
        got = jr.jit(lambda v, x: _grads(f, v, x, rngs))(v, x)
        # bit for bit: the same arithmetic, the residuals only moved
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert kinds == {"a", "abar"}, kinds  # both kinds of buffer were exercised


def _transfers(jaxpr, per_iteration: bool = False) -> list[tuple[str, int]]:
    """(destination, bytes) of every ``device_put`` in a jaxpr, sub-jaxprs included, in order;
    one inside a ``scan`` counted once per iteration (once with ``per_iteration``: the sites)."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "device_put":
            dest = {str(d) for d in eqn.params["devices"]}
            nbytes = sum(int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize for v in eqn.invars)
            out.append(("host" if any("Host" in d for d in dest) else "device", nbytes))
        times = 1 if per_iteration or eqn.primitive.name != "scan" else int(eqn.params["length"])
        for sub in _subs(eqn):
            out += _transfers(sub, per_iteration) * times
    return out


def _subs(eqn):
    for p in eqn.params.values():
        for q in p if isinstance(p, (tuple, list)) else (p,):
            if hasattr(q, "jaxpr") and hasattr(q.jaxpr, "eqns"):
                yield q.jaxpr
            elif hasattr(q, "eqns"):
                yield q


TRACED = pytest.mark.filterwarnings("ignore:jaxremat. on the CPU")  # traced to a jaxpr on purpose, not compiled


@TRACED
def test_the_step_holds_exactly_the_planned_transfers(noisy):
    chain, x, v, costs, schedules = noisy
    rngs = {"dropout": jax.random.key(7)}
    for s in schedules:
        f = execute(chain, s)
        step = lambda v, x: _grads(f, v, x, rngs)  # noqa: E731
        moves = _transfers(jax.make_jaxpr(step)(v, x).jaxpr)
        offloads = [op for op in s.ops if op.kind is OpKind.OFFLOAD]
        prefetches = [op for op in s.ops if op.kind is OpKind.PREFETCH]
        to_host = [b for d, b in moves if d == "host"]
        to_device = [b for d, b in moves if d == "device"]
        assert len(to_host) == len(offloads) and len(to_device) == len(prefetches)
        # each buffer comes back whole; a standalone a_i is exactly x[i] bytes
        assert sorted(to_host) == sorted(to_device)
        for op in offloads:
            if op.buffer == "a":
                assert int(costs.x[op.stage]) in to_host


@TRACED
def test_a_stage_whose_input_and_bundle_are_both_offloaded_moves_them_apart(noisy):
    """The schedule's ``Offload 1 a`` and ``Offload 1 abar`` are two transfers (each returns
    under its own ``Prefetch``): two ``device_put`` to the host, not one holding both. A solver
    schedule of this shape appeared when a profile changed; the executor then moved them as one."""
    chain, x, v, costs, _ = noisy
    ops = [
        ("Fck", 0),
        ("Offload", 1, "a"),
        ("Fall", 1),
        ("Offload", 1, "abar"),
        ("Fck", 2),
        ("Fall", 3),
        ("Fall", 4),
        ("Fall", 5),
        ("Loss", 6),
        ("B", 5),
        ("B", 4),
        ("Prefetch", 1, "abar"),
        ("B", 3),
        ("Prefetch", 1, "a"),
        ("FB", 2),
        ("B", 1),
        ("FB", 0),
    ]
    s = jr.Schedule.from_ops(costs, ops, budget=None, algorithm="x", bandwidth=1e12)
    rngs = {"dropout": jax.random.key(7)}
    f = execute(chain, s)
    moves = _transfers(jax.make_jaxpr(lambda v, x: _grads(f, v, x, rngs))(v, x).jaxpr)
    assert sorted(d for d, _ in moves) == ["device", "device", "host", "host"], moves
    ref = jax.jit(lambda v, x: _grads(plain_forward(chain), v, x, rngs))(v, x)
    got = jr.jit(lambda v, x: _grads(f, v, x, rngs))(v, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@TRACED
def test_lowered_for_a_gpu_xla_is_handed_the_transfers(noisy):
    chain, x, v, costs, schedules = noisy
    rngs = {"dropout": jax.random.key(7)}
    s = schedules[0]
    f = execute(chain, s)
    step = jax.jit(lambda v, x: _grads(f, v, x, rngs))
    text = step.trace(v, x).lower(lowering_platforms=("cuda",)).as_text()
    moves = _transfers(jax.make_jaxpr(lambda v, x: _grads(f, v, x, rngs))(v, x).jaxpr)
    leaves_host = text.count('_xla_buffer_placement = "pinned_host"')
    leaves_device = text.count('_xla_buffer_placement = "device"')
    assert leaves_host >= len(s.offloads) and leaves_host == leaves_device
    assert leaves_host > 0 and len(moves) == 2 * len(s.offloads)


def test_executor_refuses_offloads_it_cannot_run():
    chain = Chain.from_linen([Wide() for _ in range(3)])
    costs = jr.ChainCosts(x=[4] * 4, xbar=[8] * 3, fwd=[1] * 3, bwd=[2] * 3, fwd_tmp=[0] * 3, bwd_tmp=[0] * 3)
    inner = [
        ("Fck", 0),
        ("Fn", 1),
        ("Fn", 2),
        ("Loss", 3),
        ("Fck", 0),
        ("Offload", 1, "a"),
        ("Fall", 1),
        ("Fall", 2),
        ("B", 2),
        ("Prefetch", 1, "a"),
        ("B", 1),
        ("FB", 0),
    ]
    s = jr.Schedule.from_ops(costs, inner, budget=None, algorithm="by hand", bandwidth=1.0)
    with pytest.raises(ValueError, match="top level"):
        execute(chain, s)


def test_remat_chain_plans_offload_and_says_what_the_cpu_cannot_measure(tmp_path):
    layers = lambda: nn.Sequential([Wide() for _ in range(6)])  # noqa: E731
    with pytest.raises(ValueError, match="needs bandwidth= on the CPU"):
        jr.remat_chain("50%", algorithm="optimal_offload")(layers())
    with pytest.raises(ValueError, match="moves nothing to host memory"):
        jr.remat_chain("50%", bandwidth=1e9)(layers())
    model = jr.remat_chain("50%", algorithm="optimal_offload", bandwidth=1e12, method="xla")(layers())
    x = jax.random.normal(jax.random.key(1), (32, 16))
    v = model.init(jax.random.key(0), x)
    p = jr.plan(model, v, x)
    assert p.schedule.offloads and "host memory" in p.report()
    grads = jr.jit(jax.grad(lambda v: jnp.mean(model.apply(v, x) ** 2)))(v)
    ref = jax.grad(lambda v: jnp.mean(layers().apply(v, x) ** 2))(v)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    p.save(tmp_path / "plan.json")
    loaded = jr.load_plan(tmp_path / "plan.json")
    assert loaded.schedule.ops == p.schedule.ops and loaded.schedule.bandwidth == p.schedule.bandwidth
    assert (loaded.schedule.time, loaded.schedule.host_peak) == (p.schedule.time, p.schedule.host_peak)


def _stacked_gpt():
    from jaxremat.tools.models import gpt, sample_input

    return gpt(blocks=4, width=32, heads=2, vocab=64, stacked=True), sample_input((2, 16), "int32", high=64)


def test_a_repeat_layer_with_offloads_runs_as_loops():
    m, x = _stacked_gpt()
    # 80%: parameters dominate this tiny model, and each backward holds its stage's gradient
    model = jr.remat_chain("80%", algorithm="optimal_offload", bandwidth=1e12, method="xla")(m)
    v = model.init(jax.random.key(0), x)
    sched = jr.plan(model, v, x).schedule
    assert any(1 <= op.stage <= 4 for op in sched.offloads)  # something of the Repeat's copies moves
    step = jax.grad(lambda v: jnp.mean(model.apply(v, x) ** 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "runs unrolled" warning
        grads = jr.jit(step)(v)
        assert " scan[" in str(jax.make_jaxpr(as_planned(step))(v))
    ref = jax.jit(jax.grad(lambda v: jnp.mean(m.apply(v, x) ** 2)))(v)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_repeat_whose_copies_are_not_each_alone_runs_unrolled_and_says_so():
    """Offloads with a region over two copies: no loop runs that, so the layer is unrolled."""
    _, chain, v, x = _noisy_repeat(4)
    costs = profile(chain, v, x, method="xla", rates=Rates(1e10, 1e10), cache=False, quiet=True)
    L = len(chain)
    ops = _with_transfers(to_ops(periodic_tree(L, [(1, 4)], {1: (STORE, Part("region", 2), STORE)}), L), [(1, "abar")])
    f = execute(chain, jr.Schedule.from_ops(costs, ops, budget=None, algorithm="by hand", bandwidth=1e12))
    rngs = {"dropout": jax.random.key(7)}
    with pytest.warns(UserWarning, match="does not store or checkpoint each of its copies alone"):
        got = jr.jit(lambda v, x: _rgrads(f, v, x, rngs))(v, x)
    ref = jax.jit(lambda v, x: _rgrads(plain_forward(chain), v, x, rngs))(v, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


# -- a Repeat layer's offload loops --------------------------------------------------------------------


def _rgrads(f, v, x, rngs):
    def loss(p):
        out, up = f({**v, "params": p}, x, rngs)
        return jnp.mean(out**2), (out, up)

    return jax.value_and_grad(loss, has_aux=True)(v["params"])


def _noisy_repeat(n: int):
    model = nn.Sequential([nn.Dense(16), jr.Repeat(Noisy(), n), nn.Dense(3)])
    chain = Chain.from_linen(model, mutable=("batch_stats",), rng_streams=("dropout",))
    x = jax.random.normal(jax.random.key(1), (8, 5))
    v = model.init({"params": jax.random.key(0), "dropout": jax.random.key(3)}, x)
    return model, chain, v, x


def _with_transfers(ops, moves):
    """``ops`` with ``Offload`` right after the forward op of each ``(stage, buffer)`` and
    ``Prefetch`` right before the first backward op that reads it."""
    ops = list(ops)
    for i, buf in moves:
        loss = next(n for n, o in enumerate(ops) if o.kind is OpKind.LOSS)
        n = next(n for n, o in enumerate(ops[:loss]) if o.stage == i and o.kind in (OpKind.FALL, OpKind.FCK))
        ops.insert(n + 1, Op(OpKind.OFFLOAD, i, buf))
        readers = (i, i + 1) if buf == "abar" else (i,)  # a stored stage's bundle holds the next one's input
        m = next(m for m in range(loss + 2, len(ops)) if ops[m].stage in readers and ops[m].kind is not OpKind.PREFETCH)
        ops.insert(m, Op(OpKind.PREFETCH, i, buf))
    return ops


# copies 1..8 stored, checkpointed alone, stored under dots_saveable; bundles and inputs moved,
# in runs of alike copies (seven segments) and in a run of two (copies 1 and 2)
COPIES = (STORE, STORE, REGION, REGION, Part("store", 1, 1), STORE, REGION, STORE)
MOVES = [(1, "abar"), (2, "abar"), (4, "a"), (5, "a"), (5, "abar"), (6, "abar"), (8, "a")]


@pytest.fixture(scope="module")
def repeat_offloads():
    _, chain, v, x = _noisy_repeat(8)
    costs = profile(chain, v, x, method="xla", rates=Rates(1e10, 1e10), cache=False, quiet=True)
    assert all(costs.options[i] for i in range(1, 9)), "the copies need a store option"
    L = len(chain)
    ops = _with_transfers(to_ops(periodic_tree(L, [(1, 8)], {1: COPIES}), L), MOVES)
    s = jr.Schedule.from_ops(costs, ops, budget=None, algorithm="by hand", bandwidth=1e12)
    return chain, v, x, costs, s


def test_offload_loops_are_exact_with_dropout_and_batch_stats(repeat_offloads):
    chain, v, x, costs, s = repeat_offloads
    rngs = {"dropout": jax.random.key(7)}
    f = execute(chain, s)
    step = lambda v, x: _rgrads(f, v, x, rngs)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # runs as loops: no "runs unrolled" warning
        jaxpr = str(jax.make_jaxpr(as_planned(step))(v, x))
    assert jaxpr.count(" scan[") == 2 * 7  # a forward and a backward loop per segment
    (loss, (out, upd)), got = jr.jit(step)(v, x)
    (rl, (ro, ru)), ref = jax.jit(lambda v, x: _rgrads(plain_forward(chain), v, x, rngs))(v, x)
    np.testing.assert_allclose(loss, rl, rtol=1e-6)
    np.testing.assert_allclose(out, ro, rtol=1e-6, atol=1e-7)  # the same dropout masks
    plain_out, plain_upd = jr.jit(lambda v, x: f(v, x, rngs))(v, x)  # no gradient: one forward loop
    np.testing.assert_allclose(plain_out, ro, rtol=1e-6, atol=1e-7)
    assert sorted(plain_upd) == sorted(ru)
    assert sorted(upd) == sorted(ru)  # batch_stats updated once per copy
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), (upd, got), (ru, ref))


def test_an_offload_loop_only_moves_its_buffers():
    """The same copies with and without their buffers in host memory: bit for bit."""
    _, chain, v, x = _noisy_repeat(6)
    stacked = chain.layer_variables(v)[1]
    stage = chain.stages[1]

    def step_for(option):
        return lambda p, keys, a, u: stage.apply({c: t["body"] for c, t in p.items()}, a, jax.random.fold_in(keys, u))

    moved = (
        CopyKind(True, 0, False, True),
        CopyKind(True, 0, False, True),
        CopyKind(False, 0, True),
        CopyKind(True, 0, True, False),
        CopyKind(False, 0, False),
        CopyKind(True, 0, True, True),
    )
    kept = tuple(CopyKind(k.stored) for k in moved)
    a0 = jax.random.normal(jax.random.key(2), (8, 16))

    def loss(stacked, a, kinds):
        out, updates = offload_scan(step_for, kinds, stacked, a, jax.random.key(5))
        return jnp.sum(out**2), updates

    got = jr.jit(jax.grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)(stacked, a0, moved)
    ref = jr.jit(jax.grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)(stacked, a0, kept)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@TRACED
def test_an_offload_loop_holds_exactly_the_planned_transfers(repeat_offloads):
    chain, v, x, costs, s = repeat_offloads
    rngs = {"dropout": jax.random.key(7)}
    step = lambda v, x: _rgrads(execute(chain, s), v, x, rngs)  # noqa: E731
    moves = _transfers(jax.make_jaxpr(step)(v, x).jaxpr)  # a transfer in a loop, once per iteration
    to_host = [b for d, b in moves if d == "host"]
    to_device = [b for d, b in moves if d == "device"]
    assert len(to_host) == len(s.offloads) == len(MOVES) and len(to_device) == len(MOVES)
    assert sorted(to_host) == sorted(to_device)
    assert sorted(b for b in to_host if b == int(costs.x[1])) == [int(costs.x[i]) for i, buf in MOVES if buf == "a"]
    # lowered for a GPU, XLA is handed each transfer site of the loops
    sites = _transfers(jax.make_jaxpr(step)(v, x).jaxpr, per_iteration=True)
    text = jax.jit(step).trace(v, x).lower(lowering_platforms=("cuda",)).as_text()
    leaves_host = text.count('_xla_buffer_placement = "pinned_host"')
    host_sites = [d for d, _ in sites if d == "host"]
    assert 0 < len(host_sites) < len(to_host) and leaves_host >= len(host_sites)
    assert leaves_host == text.count('_xla_buffer_placement = "device"')
