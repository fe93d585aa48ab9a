"""remat_chain and plans: same variables and gradients as the plain model, re-planning rules, files."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxremat as jr


def mlp():
    return nn.Sequential([nn.Dense(64), nn.gelu, nn.Dense(64), nn.gelu, nn.Dense(64), nn.gelu, nn.Dense(4)])


def loss_fn(apply):
    return lambda v, x: jnp.mean(apply(v, x) ** 2)


def test_wrapped_sequential_matches_the_plain_model_under_jit():
    model = mlp()
    wrapped = jr.remat_chain("60%", method="xla")(model)
    x = jax.random.normal(jax.random.key(0), (32, 16))
    v = wrapped.init(jax.random.key(1), x)
    ref_v = model.init(jax.random.key(1), x)
    jax.tree.map(np.testing.assert_array_equal, v, ref_v)
    g = jr.jit(jax.grad(loss_fn(wrapped.apply)))(v, x)
    ref = jax.jit(jax.grad(loss_fn(model.apply)))(v, x)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), g, ref)
    p = wrapped.plan(v, x)
    assert p.schedule.budget == jr.parse_budget("60%", p.costs) and any(d.recomputed for d in p.schedule.decisions())
    assert "budget" in p.report()


def test_budget_change_replans_shape_change_reprofiles(monkeypatch):
    import sys

    rc_mod = sys.modules["jaxremat.api.plans"]  # where plans are made

    calls = []
    real = rc_mod.profile
    monkeypatch.setattr(rc_mod, "profile", lambda *a, **k: calls.append(1) or real(*a, **k))
    wrapped = jr.remat_chain("80%", method="xla")(mlp())
    x = jnp.ones((32, 16))
    v = wrapped.init(jax.random.key(0), x)
    first = wrapped.plan(v, x)
    tighter = wrapped.with_budget("50%")
    second = tighter.plan(v, x)
    assert len(calls) == 1 and second.schedule.budget < first.schedule.budget
    assert second.predicted_overhead >= first.predicted_overhead
    tighter.plan(v, jnp.ones((64, 16)))
    assert len(calls) == 2


def test_plan_save_load_and_refuse_other_models(tmp_path):
    model = mlp()
    chain = jr.Chain.from_linen(model)
    x = jnp.ones((8, 16))
    v = chain.init(jax.random.key(0), x)
    p = jr.plan(chain, v, x, "70%", method="xla")
    p.save(tmp_path / "plan.json")
    q = jr.load_plan(tmp_path / "plan.json")
    assert q.schedule.ops == p.schedule.ops and q.costs == p.costs and q.predicted_peak == p.predicted_peak
    f = q.executor(chain, v, x)
    np.testing.assert_allclose(f(v, x)[0], model.apply(v, x), rtol=1e-6)
    with pytest.raises(ValueError, match="another model or input shape"):
        q.executor(chain, v, jnp.ones((4, 16)))
    other = jr.Chain.from_linen(
        nn.Sequential([nn.Dense(64), nn.relu, nn.Dense(64), nn.gelu, nn.Dense(64), nn.gelu, nn.Dense(4)])
    )
    with pytest.raises(ValueError, match="another model"):
        q.check(other, v, x)
    (tmp_path / "bad.json").write_text('{"format": "something"}')
    with pytest.raises(ValueError, match="is not a jaxremat plan"):
        jr.load_plan(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="cannot read a jaxremat plan"):
        jr.load_plan(tmp_path / "missing.json")


def test_class_decorator_and_bad_budgets():
    @jr.remat_chain("100%", method="xla")
    class Net(nn.Sequential):
        pass

    net = Net([nn.Dense(8), nn.tanh, nn.Dense(2)])
    x = jnp.ones((4, 3))
    v = net.init(jax.random.key(0), x)
    np.testing.assert_allclose(
        net.apply(v, x), nn.Sequential([nn.Dense(8), nn.tanh, nn.Dense(2)]).apply(v, x), rtol=1e-6
    )
    with pytest.raises(ValueError, match="expected an int of bytes"):
        jr.remat_chain("lots", method="xla")(nn.Sequential([nn.Dense(8), nn.tanh, nn.Dense(2)])).apply(v, x)
    tiny = jr.remat_chain(16, method="xla")(nn.Sequential([nn.Dense(8), nn.tanh, nn.Dense(2)]))
    with pytest.raises(jr.InfeasibleBudget, match="at least"):
        tiny.apply(v, x)
    with pytest.raises(ValueError, match="list of linen modules or an nn.Sequential"):
        jr.remat_chain("50%")(nn.Dense(3))


def test_calibrated_remat_chain_keeps_its_memory_promise_under_jit():
    from jaxremat.api.calibrate import step_temp

    model = mlp()
    wrapped = jr.remat_chain("50%", method="xla", calibrate=True)(model)
    x = jax.random.normal(jax.random.key(0), (64, 16))
    v = wrapped.init(jax.random.key(1), x)
    g = jr.jit(jax.grad(loss_fn(wrapped.apply)))(v, x)  # planned while the step is traced
    ref = jax.jit(jax.grad(loss_fn(model.apply)))(v, x)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), g, ref)
    p = wrapped.plan(v, x)
    measured = step_temp(wrapped.chain, v, x, p.schedule) + int(p.costs.x[0])
    assert measured <= p.schedule.budget
