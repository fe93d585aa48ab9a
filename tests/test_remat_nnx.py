"""remat_nnx: an NNX Sequential trains under a plan with the plain model's gradients and updates."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxremat as jr


def make(seed: int = 0) -> nnx.Sequential:
    r = nnx.Rngs(seed)
    return nnx.Sequential(
        nnx.Linear(16, 64, rngs=r),
        nnx.gelu,
        nnx.Linear(64, 64, rngs=r),
        nnx.BatchNorm(64, rngs=r),
        nnx.gelu,
        nnx.Linear(64, 64, rngs=r),
        nnx.gelu,
        nnx.Linear(64, 4, rngs=r),
    )


def loss(model, x):
    return jnp.mean(model(x) ** 2)


def test_gradients_and_batch_stats_match_the_plain_model_under_jit():
    x = jax.random.normal(jax.random.key(0), (32, 16))
    plain, wrapped = make(), jr.remat_nnx("50%", method="xla")(make())
    ref_loss, ref_g = nnx.jit(lambda m, x: nnx.value_and_grad(loss)(m, x))(plain, x)
    graphdef, state = nnx.split(wrapped)

    @jr.jit  # the functional NNX API under jax.jit with the CPU remat option
    def step(state, x):
        m = nnx.merge(graphdef, state)
        value, grads = nnx.value_and_grad(loss)(m, x)
        return value, grads, nnx.state(m)

    got_loss, g, state = step(state, x)
    nnx.update(wrapped, state)
    np.testing.assert_allclose(got_loss, ref_loss, rtol=1e-6)
    ref_leaves = jax.tree.leaves(nnx.state(ref_g, nnx.Param))
    got_leaves = jax.tree.leaves(nnx.state(g, nnx.Param))
    assert len(got_leaves) == len(ref_leaves) > 0
    for a, b in zip(got_leaves, ref_leaves):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # batch statistics updated once, as in the plain model
    np.testing.assert_allclose(wrapped.layers[3].mean[...], plain.layers[3].mean[...], rtol=1e-6, atol=1e-7)
    assert not np.allclose(wrapped.layers[3].mean[...], 0)
    p = wrapped.plan(x)
    assert p.schedule.peak <= p.schedule.budget and "budget" in p.report()


def test_trains_with_nnx_optimizer_like_the_plain_model():
    x = jax.random.normal(jax.random.key(1), (32, 16))
    losses = {}
    for name, model in (("plain", make()), ("remat", jr.remat_nnx("60%", method="xla")(make()))):
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        graphdef, state = nnx.split((model, opt))

        @jr.jit
        def train_step(state, x):
            model, opt = nnx.merge(graphdef, state)
            value, grads = nnx.value_and_grad(loss)(model, x)
            opt.update(model, grads)
            return value, nnx.state((model, opt))

        losses[name] = []
        for _ in range(5):
            value, state = train_step(state, x)
            losses[name].append(float(value))
    np.testing.assert_allclose(losses["remat"], losses["plain"], rtol=1e-5)


def test_not_a_sequence_is_a_clear_error():
    with pytest.raises(ValueError, match="nnx.Sequential, an nnx.List or a non-empty list"):
        jr.remat_nnx("50%")(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))


def test_offload_plans_train_an_nnx_model_with_the_plain_gradients():
    x = jax.random.normal(jax.random.key(0), (32, 16))
    plain = make()
    wrapped = jr.remat_nnx("60%", method="xla", algorithm="optimal_offload", bandwidth=1e12)(make())
    ref_loss, ref_g = nnx.jit(lambda m, x: nnx.value_and_grad(loss)(m, x))(plain, x)
    graphdef, state = nnx.split(wrapped)

    @jr.jit
    def step(state, x):
        m = nnx.merge(graphdef, state)
        return nnx.value_and_grad(loss)(m, x)

    got_loss, g = step(state, x)
    np.testing.assert_allclose(got_loss, ref_loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(nnx.state(g, nnx.Param)), jax.tree.leaves(nnx.state(ref_g, nnx.Param))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert wrapped.plan(x).schedule.offloads
    with pytest.raises(ValueError, match="needs bandwidth= on the CPU"):
        jr.remat_nnx("40%", algorithm="optimal_offload")(make())
