"""The public API's promises: the defects a review found, each with the test that pins its fix."""

from __future__ import annotations

import inspect
import pickle
import typing

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxremat as jr
from jaxremat.api.nnx_model import RematSequential


def mlp():
    return nn.Sequential([nn.Dense(32), nn.gelu, nn.Dense(32), nn.gelu, nn.Dense(4)])


def test_infeasible_budget_pickles_with_its_note():
    e = jr.InfeasibleBudget("optimal", 100, 250, note="a Repeat layer runs as one loop from 300 B")
    back = pickle.loads(pickle.dumps(e))
    assert str(back) == str(e) and back.note == e.note and back.min_budget == 250
    assert "runs as one loop" in str(back)


def test_parse_budget_share_needs_a_reference_and_takes_costs():
    costs = jr.ChainCosts.uniform(4, x=10, xbar=30)
    with pytest.raises(ValueError, match="pass the chain's costs or that peak in bytes"):
        jr.parse_budget("40%")
    peak = jr.store_all_peak(costs)
    assert jr.parse_budget("40%", costs) == jr.parse_budget("40%", peak) == int(0.4 * peak)
    assert jr.parse_budget(None, costs) == peak and jr.parse_budget("1KiB") == 1024


def test_pareto_options_are_keyword_only():
    costs = jr.ChainCosts.uniform(4, x=10, xbar=30)
    with pytest.raises(TypeError):
        jr.pareto(costs, "optimal")  # noqa
    front = jr.pareto(costs, algorithm="revolve", points=4)
    assert front and all(s.algorithm == "revolve" for s in front)


def test_public_signatures_say_what_they_take():
    hints = typing.get_type_hints
    assert hints(jr.solve)["budget"] == jr.Budget and hints(jr.parse_budget)["budget"] == jr.Budget
    assert hints(jr.remat_chain)["budget"] == jr.Budget and "return" in hints(jr.remat_chain)
    assert hints(jr.remat_nnx)["return"] is not None
    for fn in (jr.profile, jr.plan, jr.RematChain.plan, RematSequential.plan):
        assert "sample" in inspect.signature(fn).parameters, fn  # one name for the sample input
    for name in ("x", "xs", "inputs"):
        assert name not in inspect.signature(jr.plan).parameters


def test_one_name_for_the_profiling_method():
    x = jnp.ones((8, 16))
    model = jr.remat_chain("80%", method="xla")(mlp())
    assert model.planner.options.method == "xla"
    assert (
        jr.remat_nnx("80%", method="xla", max_period=1)(
            nnx.Sequential(nnx.Linear(16, 4, rngs=nnx.Rngs(0)))
        ).planner.options.method
        == "xla"
    )
    with pytest.raises(TypeError, match="unknown option"):
        jr.remat_chain("80%", profile="xla")  # method='s name before the first release
    with pytest.raises(ValueError, match="method must be 'measure', 'flops' or 'xla'"):
        jr.remat_chain("60%", method="wallclock")
    with pytest.raises(TypeError, match="unknown option"):
        jr.remat_chain("60%", metod="xla")
    v = model.init(jax.random.key(0), x)
    assert jr.plan(mlp(), v, x, "80%", method="xla").costs == model.plan(v, x).costs


def test_plan_of_a_wrapped_model_uses_its_own_budget():
    x = jnp.ones((8, 16))
    model = jr.remat_chain("85%", method="xla")(mlp())
    v = model.init(jax.random.key(0), x)
    p = jr.plan(model, v, x)
    assert p is model.plan(v, x)
    assert p.schedule.budget == jr.parse_budget("85%", p.costs)
    other = jr.plan(model, v, x, "90%")
    assert other.schedule.budget == jr.parse_budget("90%", p.costs)
    with pytest.raises(TypeError, match="needs a budget"):
        jr.plan(mlp(), v, x)


def test_a_decorated_class_stays_a_class():
    @jr.remat_chain("100%", method="xla")
    class Net(nn.Sequential):
        """A docstring."""

    assert isinstance(Net, type) and issubclass(Net, jr.RematChain) and Net.__doc__ == "A docstring."
    assert issubclass(Net.__wrapped__, nn.Sequential)
    net = Net([nn.Dense(8), nn.tanh, nn.Dense(2)])
    assert isinstance(net, Net) and isinstance(net.model, Net.__wrapped__)
    x = jnp.ones((4, 3))
    v = net.init(jax.random.key(0), x)
    np.testing.assert_allclose(net.apply(v, x), net.model.apply(v, x), rtol=1e-6)
    assert isinstance(net.with_budget("50%"), Net)


def test_remat_nnx_takes_the_same_options_and_builds_its_chain_once(monkeypatch):
    rngs = nnx.Rngs(0)
    model = jr.remat_nnx("100%", method="xla", max_period=1, slots=200)(
        nnx.Sequential(nnx.Linear(16, 32, rngs=rngs), nnx.gelu, nnx.Linear(32, 4, rngs=rngs))
    )
    assert model.planner.options.max_period == 1 and model.planner.options.slots == 200
    built = []
    real = jr.Chain.from_nnx.__func__
    monkeypatch.setattr(jr.Chain, "from_nnx", classmethod(lambda cls, m: built.append(1) or real(cls, m)))
    x = jnp.ones((8, 16))
    first = model(x)
    second = model(x)
    assert not built  # the chain was built once, in the constructor
    np.testing.assert_array_equal(first, second)
