"""Executing offload schedules: gradients, dropout and batch statistics exact; the traced step
holds exactly the planned transfers; lowered for a GPU, XLA is handed them."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxremat as jr
from conftest import Noisy, plain_forward
from jaxremat import profile
from jaxremat.model.chain import Chain
from jaxremat.profiling import Rates
from jaxremat.run.executor import execute


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
    for share in np.linspace(0, 0.9, 10):
        s = jr.solve(costs, int(lo + share * (hi - lo)), algorithm="optimal_offload", bandwidth=1e12)
        if s.offloads and s.ops not in [f.ops for f in found]:
            found.append(s)
    assert found, "no budget made optimal_offload move anything"
    return costs, found


@pytest.fixture(scope="module")
def noisy():
    chain = Chain.from_linen([Noisy() if i % 2 else Wide() for i in range(6)], mutable=("batch_stats",),
                             rng_streams=("dropout",))
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


def _transfers(jaxpr) -> list[tuple[str, int]]:
    """(destination, bytes) of every ``device_put`` in a jaxpr, sub-jaxprs included, in order."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "device_put":
            dest = {str(d) for d in eqn.params["devices"]}
            nbytes = sum(int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize for v in eqn.invars)
            out.append(("host" if any("Host" in d for d in dest) else "device", nbytes))
        for sub in _subs(eqn):
            out += _transfers(sub)
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
        offloads = [op for op in s.ops if op.kind is jr.OpKind.OFFLOAD]
        prefetches = [op for op in s.ops if op.kind is jr.OpKind.PREFETCH]
        to_host = [b for d, b in moves if d == "host"]
        to_device = [b for d, b in moves if d == "device"]
        assert len(to_host) == len(offloads) and len(to_device) == len(prefetches)
        # each buffer comes back whole; a standalone a_i is exactly x[i] bytes
        assert sorted(to_host) == sorted(to_device)
        for op in offloads:
            if op.buffer == "a":
                assert int(costs.x[op.stage]) in to_host


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
    inner = [("Fck", 0), ("Fn", 1), ("Fn", 2), ("Loss", 3), ("Fck", 0), ("Offload", 1, "a"), ("Fall", 1), ("Fall", 2),
             ("B", 2), ("Prefetch", 1, "a"), ("B", 1), ("FB", 0)]
    s = jr.Schedule.from_ops(costs, inner, budget=None, algorithm="by hand", bandwidth=1.0)
    with pytest.raises(ValueError, match="top level"):
        execute(chain, s)


def test_remat_chain_plans_offload_and_says_what_the_cpu_cannot_measure(tmp_path):
    layers = lambda: nn.Sequential([Wide() for _ in range(6)])  # noqa: E731
    with pytest.raises(ValueError, match="needs bandwidth= on the CPU"):
        jr.remat_chain("50%", algorithm="optimal_offload")(layers())
    with pytest.raises(ValueError, match="moves nothing to host memory"):
        jr.remat_chain("50%", bandwidth=1e9)(layers())
    model = jr.remat_chain("40%", algorithm="optimal_offload", bandwidth=1e12, method="xla")(layers())
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


def test_a_repeat_layer_with_offloads_runs_unrolled_and_says_so():
    from jaxremat.tools.models import gpt, sample_input

    m = gpt(blocks=4, width=32, heads=2, vocab=64, stacked=True)
    x = sample_input((2, 16), "int32", high=64)
    model = jr.remat_chain("40%", algorithm="optimal_offload", bandwidth=1e12, method="xla")(m)
    v = model.init(jax.random.key(0), x)
    sched = jr.plan(model, v, x).schedule
    assert any(1 <= op.stage <= 4 for op in sched.offloads)  # something of the Repeat's copies moves
    with pytest.warns(UserWarning, match="loops do not offload yet"):
        grads = jr.jit(jax.grad(lambda v: jnp.mean(model.apply(v, x) ** 2)))(v)
    ref = jax.grad(lambda v: jnp.mean(m.apply(v, x) ** 2))(v)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
