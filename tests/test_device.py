"""Device budgets: the whole training step (parameters, optimizer state, inputs and temporaries)
within a device's memory, as XLA's memory analysis of the user's step says."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from outside_models import loop_mlp, step_total

import jaxremat as jr


def test_a_device_budget_says_what_is_wrong():
    with pytest.raises(ValueError, match="headroom"):
        jr.Device("1GiB", headroom=1.5)
    with pytest.raises(ValueError, match="16GiB"):
        jr.Device("lots")
    with pytest.raises(ValueError, match="positive"):
        jr.Device(0)
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError, match=r"give the size, e.g. jaxremat.Device\('16GiB'\)"):
            jr.Device().limit()
    assert jr.Device("1GiB", headroom=0.25).usable() == 3 * 2**28
    with pytest.raises(ValueError, match="jaxremat.remat"):
        jr.remat_chain(jr.Device("1GiB"))


def test_the_whole_step_fits_the_device_as_xla_measures_it():
    """Parameters, Adam's state and the batch (10 MiB here) are taken from the device's memory;
    the step the user compiles then uses at most what is left of it (less the headroom), and its
    gradients are plain autodiff's."""
    case = loop_mlp(layers=6, width=256)
    plain = step_total(case.loss, case.args)
    device = jr.Device(int(0.6 * plain), headroom=0.02)
    f = jr.remat(case.loss, device, quiet=True)
    plan = f.plan(*case.args)
    used = step_total(f, case.args)
    assert used <= device.usable() < plain
    assert "the step holds in parameters, optimizer state and inputs" in plan.report()
    want = jax.grad(case.loss)(*case.args)
    got = jr.jit(jax.grad(f))(*case.args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)


def test_the_optimizers_state_is_the_users_and_too_small_a_device_names_the_least():
    case = loop_mlp(layers=4, width=256)
    sgd = optax.sgd(1e-2)
    plain = step_total(case.loss, case.args, sgd)
    # without Adam's two moments the step holds 4 MiB less: the budget that fits with SGD
    device = jr.Device(int(0.7 * plain), headroom=0.0, optimizer=sgd)
    f = jr.remat(case.loss, device, quiet=True)
    f.plan(*case.args)
    assert step_total(f, case.args, sgd) <= device.usable()
    with pytest.raises(jr.InfeasibleBudget, match="the step needs at least") as e:
        jr.remat(case.loss, jr.Device(int(0.2 * plain), headroom=0.0, optimizer=sgd), quiet=True).plan(*case.args)
    params = sum(leaf.nbytes for leaf in jax.tree.leaves(case.args))
    assert e.value.min_budget > params and e.value.budget == int(0.2 * plain)
    assert jnp.isfinite(jr.jit(jax.grad(f))(*case.args)[0][0]).all()
