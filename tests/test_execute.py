"""Executing schedules: gradients identical to plain autodiff, RNG and batch stats handled once."""

from __future__ import annotations

import dataclasses
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxremat as jr
from conftest import Noisy, TanhDense, plain_forward
from jaxremat.model.chain import Chain
from jaxremat.run.executor import execute
from jaxremat.core.tree import Leaf, Region, Store, parse
from jaxremat import profile
from jaxremat.profiling import Rates
from jaxremat.solvers import baselines


class Block(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        return nn.gelu(nn.Dense(self.width)(x))


def test_parse_reads_every_solver_schedule_as_a_tree():
    L = 6
    assert isinstance(parse(baselines.store_all(L), L), Store)
    tree = parse(baselines.every_stage(L), L)
    assert isinstance(tree, Region) and (tree.start, tree.stop) == (0, 1)
    assert isinstance(parse(baselines.recompute_all(L), L), Region)
    parse(baselines.revolve(L, 2), L)
    parse(baselines.sqrt_segments(L), L)
    assert parse(baselines.store_all(1), 1) == Store(0, Leaf(1))
    with pytest.raises(ValueError, match="not a persistent schedule"):
        parse([("Fck", 0), ("Fall", 1), ("Loss", 2), ("B", 1), ("Fall", 0), ("B", 0), ("Fall", 0)], 2)


def _grads(f, variables, x, rngs):
    def loss(params):
        v = [{**u, "params": p} for u, p in zip(variables, params)]
        out, updates = f(v, x, rngs)
        return jnp.mean(out**2), (out, updates)

    params = [u["params"] for u in variables]
    return jax.value_and_grad(loss, has_aux=True)(params)


@pytest.fixture(scope="module")
def noisy():
    """Six stages with parameters, batch statistics and dropout, profiled once for the module;
    the plain step's loss, output, updates and gradients."""
    chain = Chain.from_linen([Noisy() for _ in range(6)], mutable=("batch_stats",), rng_streams=("dropout",))
    x = jax.random.normal(jax.random.key(1), (8, 16))
    v = chain.init(jax.random.key(0), x)
    rngs = {"dropout": jax.random.key(7)}
    costs = profile(chain, v, x, method="xla", rates=Rates(1e10, 1e10), cache=False, quiet=True)
    ref = jax.jit(lambda v, x: _grads(plain_forward(chain), v, x, rngs))(v, x)
    return chain, x, v, rngs, costs, ref


# (ops, scan) of the schedules already run: budget-free ones (store_all, recompute_all, ...) and
# algorithms that agree are the same program, compiled once in this module
_RUN: set = set()


@pytest.mark.parametrize("share,scan", [(0.0, False), (0.5, False), (1.0, False), (0.0, True), (0.5, True)])
def test_gradients_dropout_and_batch_stats_match_plain_autodiff(noisy, share, scan):
    chain, x, v, rngs, costs, ((ref_loss, (ref_out, ref_upd)), ref_g) = noisy
    lo, hi = jr.min_budget(costs), jr.store_all_peak(costs)
    budget = int(lo + share * (hi - lo))
    ran = []
    for algorithm in jr.ALGORITHMS:
        try:
            sched = jr.solve(costs, budget, algorithm=algorithm)
        except jr.InfeasibleBudget:
            continue
        ran.append(algorithm)
        if (tuple(sched.ops), scan) in _RUN:
            continue
        _RUN.add((tuple(sched.ops), scan))
        f = execute(chain, sched, scan=scan)
        if scan and algorithm == "every_stage":
            with warnings.catch_warnings():  # traced outside jaxremat.jit on purpose
                warnings.simplefilter("ignore")
                assert "scan" in str(jax.make_jaxpr(lambda v: f(v, x, rngs))(v))
        step = jr.jit(lambda v, x: _grads(f, v, x, rngs))
        (loss, (out, upd)), g = step(v, x)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-6)  # same dropout masks
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), g, ref_g)
        assert sorted(upd) == sorted(ref_upd)  # batch_stats updated once per stage
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), upd, ref_upd)
    assert "optimal" in ran and len(ran) >= 2


def test_integer_inputs_and_pytree_activations():
    def embed(p, ids):
        return (p[ids], (ids > 0).astype(jnp.float32))

    def mix(p, hm):
        h, mask = hm
        return (jnp.tanh(h @ p) * mask[..., None], mask)

    def pool(p, hm):
        return hm[0].sum(axis=1) @ p

    pairs = [(embed, jnp.ones((10, 8)) * 0.1), (mix, jnp.eye(8)), (mix, jnp.eye(8) * 0.5), (pool, jnp.ones((8, 2)))]
    chain = Chain.from_functions(pairs)
    v = Chain.function_variables(pairs)
    ids = jnp.array([[1, 2, 0], [3, 4, 5]])
    costs = profile(chain, v, ids, method="xla", rates=Rates(1e10, 1e10), cache=False, quiet=True)
    ref = jax.grad(lambda v: jnp.sum(plain_forward(chain)(v, ids, None)[0] ** 2))(v)
    for algorithm in ("optimal", "every_stage", "recompute_all"):
        f = execute(chain, jr.solve(costs, None if algorithm == "optimal" else "100%", algorithm=algorithm))
        g = jr.jit(jax.grad(lambda v: jnp.sum(f(v, ids)[0] ** 2)))(v)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), g, ref)


def test_schedule_for_another_chain_is_refused():
    chain = Chain.from_linen([Block(4), Block(4)])
    other = jr.solve(jr.ChainCosts.uniform(3, x=4, xbar=8), None)
    with pytest.raises(ValueError, match="chain of 3 stages; this chain has 2"):
        execute(chain, other)


def _remat_warnings(run) -> list:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [w for w in caught if "undoes rematerialisation" in str(w.message)]


def test_cpu_warning_only_without_the_compile_option(monkeypatch):
    """The warning names three ways to compile with the option; each of them silences it
    (``jax.jit(..., compiler_options=jaxremat.compiler_options())`` used to warn all the same),
    and without any of them it warns."""
    chain = Chain.from_linen([Block(4), Block(4), Block(4)])
    x = jnp.ones((2, 4))
    v = chain.init(jax.random.key(0), x)
    f = execute(chain, jr.solve(jr.ChainCosts.uniform(3, x=32, xbar=64), None, algorithm="every_stage"))
    loss = lambda v: jnp.sum(f(v, x)[0])  # noqa: E731
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert not _remat_warnings(lambda: jr.jit(jax.grad(loss))(v))
    assert not _remat_warnings(lambda: jax.jit(jax.grad(loss), compiler_options=jr.compiler_options())(v))
    assert not _remat_warnings(lambda: jax.jit(jax.grad(loss), compiler_options=jr.compiler_options()).lower(v))
    warned = _remat_warnings(lambda: jax.jit(jax.grad(loss))(v))
    assert warned and all(w in str(warned[0].message) for w in ("jaxremat.jit", "compiler_options", "XLA_FLAGS"))
    assert _remat_warnings(lambda: jax.jit(jax.grad(loss), compiler_options={"xla_cpu_enable_fast_math": False})(v))
    monkeypatch.setenv(
        "XLA_FLAGS", "--xla_force_host_platform_device_count=1 --xla_disable_hlo_passes=cse_barrier_expander"
    )
    assert not _remat_warnings(lambda: jax.jit(jax.grad(loss))(v))


def _kernel_copies(compiled, n_params: int) -> int:
    """How many kernels (entry parameters of rank 2 or more among the first ``n_params``) the
    compiled step copies."""
    import re

    text = compiled.as_text()
    entry = text[text.index("ENTRY") :]
    found = re.findall(r"%(\S+) = \w+\[(\d+(?:,\d+)+)\]\S* parameter\((\d+)\)", entry)
    params = {n for n, _, k in found if int(k) < n_params}
    return sum(m.group(1) in params for m in re.finditer(r"= \S+ copy\(%([^\s,)]+)\)", entry))


class ConvBlock(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        return nn.relu(nn.Conv(self.width, (3, 3))(x))


def test_stored_convolutions_make_no_copies_of_donated_kernels():
    """In the update step (parameters donated), plain autodiff makes XLA copy the kernels a
    backward reads for its input gradient; the executor's stored stages that convolve tie the
    weight gradient to the input's cotangent, so none is copied, also under a policy in a plan
    that stores a stage whole or recomputes one. Where every stage is under a policy, the stages
    are left as ``jax.checkpoint`` makes them: the plan compiles to the hand-written strategy's
    step, its copies and its memory."""
    from jaxremat.api.calibrate import compile_schedule_step, compile_step
    from jaxremat.core.schedule import Schedule
    from jaxremat.tools import compare

    x = jnp.ones((4, 16, 16, 8))
    chain = Chain.from_linen([ConvBlock(16), ConvBlock(8), ConvBlock(16), ConvBlock(8)])
    v = chain.init(jax.random.key(0), x)
    per = chain.split(v)
    params = [u.get("params", {}) for u in per]
    n = len(jax.tree.leaves(params))
    plain = compile_step(compare.plain(chain), per, params, x)
    assert _kernel_copies(plain, n) > 0  # what the tie removes
    costs = profile(chain, v, x, method="xla", rates=Rates(1e10, 1e10), cache=False, quiet=True)
    L = len(chain)
    by_stage = [{"store_all": 0, **{o.name: k + 1 for k, o in enumerate(per)}} for per in costs.options]
    names = [name for name in by_stage[1] if all(name in b for b in by_stage)]
    assert len(names) > 1, "the stages have a store option in common"
    for name in names:
        ops = (
            [("Fall", i, by_stage[i][name]) for i in range(L)] + [("Loss", L)] + [("B", i) for i in reversed(range(L))]
        )
        step = compile_schedule_step(chain, v, x, Schedule.from_ops(costs, ops, budget=None, algorithm="candidate"))
        if name == "store_all":
            assert _kernel_copies(step, n) == 0
            continue
        hand = compile_step(compare.grouped(chain, 1, getattr(jax.checkpoint_policies, name)), per, params, x)
        assert _kernel_copies(hand, n) > 0, name
        assert _kernel_copies(step, n) == _kernel_copies(hand, n), name
        assert step.memory_analysis().temp_size_in_bytes <= hand.memory_analysis().temp_size_in_bytes, name
        mixed = [("Fall", 0, by_stage[0][name]), ("Fall", 1), *ops[2:]]  # stage 1 whole: the others tie
        step = compile_schedule_step(chain, v, x, Schedule.from_ops(costs, mixed, budget=None, algorithm="mixed"))
        assert _kernel_copies(step, n) == 0, name


def test_a_stage_stored_whole_after_one_under_a_policy_reads_its_input_as_made():
    """A residual block's output is element-wise in buffers of its own: XLA fuses it into every
    reader instead of making it. After a block under ``dots_saveable`` (which saves copies of its
    convolutions' outputs), a block stored whole would so keep the unsaved originals alive until
    its backward, bytes no measurement holds: on the README's ResNet, a plan alternating the two
    used 22.27 MiB where 20.80 were planned, 20.56 with its input through a barrier. The barrier
    is only where it is needed: storing every block whole, XLA's fusion of a block's output into
    the next one's saves memory instead (this chain: 4.18 MiB, 4.78 through barriers)."""
    from jaxremat.api.calibrate import step_temp
    from jaxremat.core.schedule import Schedule
    from jaxremat.tools.models import ResidualBlock, Stem

    x = jnp.ones((8, 16, 16, 3))
    chain = Chain.from_linen([Stem(16)] + [ResidualBlock(16) for _ in range(5)])
    v = chain.init(jax.random.key(0), x)
    costs = profile(chain, v, x, method="xla", rates=Rates(1e10, 1e10), cache=False, quiet=True)
    L, x0 = len(chain), int(costs.x[0])
    assert all(o and o[0].name == "dots_saveable" for o in costs.options)
    ratio = {}  # XLA temp / predicted
    for name, options in (("alternating", [1, 1, 0, 1, 0, 1]), ("store-all", [0] * L)):
        ops = [("Fall", i, k) for i, k in enumerate(options)] + [("Loss", L)] + [("B", i) for i in reversed(range(L))]
        plan = Schedule.from_ops(costs, ops, budget=None, algorithm=name)
        ratio[name] = step_temp(chain, v, x, plan) / (plan.peak - x0)
    assert ratio["alternating"] <= 1.0, ratio  # 1.003 without the barrier, 0.971 with it
    assert ratio["store-all"] <= 0.93, ratio  # 0.85 (0.97 with a barrier before every block)


def test_blocks_under_a_policy_match_plain_autodiff(noisy):
    """A :class:`~jaxremat.core.schedule.Block` (the user's block under a hand policy, run as one
    ``jax.checkpoint``): the same loss, dropout masks, batch statistics and gradients as plain
    autodiff; a block over stages the schedule does not store at the top level is refused."""
    from jaxremat.core.ops import store_all_ops
    from jaxremat.core.schedule import Block, Schedule

    chain, x, v, rngs, costs, ((ref_loss, (ref_out, ref_upd)), ref_g) = noisy
    L = len(chain)
    blocks = (Block(0, 3, "dots_saveable"), Block(3, 5, "nothing_saveable"))
    sched = Schedule.from_ops(costs, store_all_ops(L), budget=None, algorithm="blocks", blocks=blocks)
    assert sched.least_peak < sched.peak and "stages 0-2: one jax.checkpoint under dots_saveable" in sched.summary()
    f = execute(chain, sched)
    (loss, (out, upd)), g = jr.jit(lambda v, x: _grads(f, v, x, rngs))(v, x)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), g, ref_g)
    assert sorted(upd) == sorted(ref_upd)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), upd, ref_upd)
    with pytest.raises(ValueError, match="a block is a run of stages that the schedule stores"):
        Schedule.from_ops(
            costs, baselines.every_stage(L), budget=None, algorithm="x", blocks=(Block(1, 3, "dots_saveable"),)
        )


def test_a_region_handing_its_cotangent_over_reads_its_kernels_before_their_update():
    """A region that hands its input's cotangent to the region before it directly (not through
    its final barrier) still makes its weight gradients after that cotangent, so the reads of
    its kernels for it come before the kernels' update: on 16 ``tanh(x @ w)`` stages at 30%,
    XLA copied the kernels of the four regions' first stages without (temp 1.34x the plan,
    1.23x with none copied; measured 2026-12-04)."""
    from jaxremat.api.calibrate import compile_schedule_step

    x = jax.random.normal(jax.random.key(1), (128, 64))
    chain = Chain.from_linen([TanhDense() for _ in range(16)])
    v = chain.init(jax.random.key(0), x)
    costs = profile(chain, v, x, method="xla", rates=Rates(1e10, 1e10), cache=False, quiet=True)
    sched = jr.solve(costs, "30%")
    assert sum(op.kind == "Fck" for op in sched.ops) >= 4
    assert _kernel_copies(compile_schedule_step(chain, v, x, sched), 16) == 0


def test_a_stored_convolutions_backward_reads_its_kernels_after_the_cotangent(monkeypatch):
    """XLA makes a backward's layout copies of a kernel (a transposed convolution's transposed
    kernel) from the parameters alone and may make them in the forward, where they live until
    that backward: bytes no stage measurement holds. The executor passes a stored stage's kernel
    residuals through one barrier with its output's cotangent, so the copies are made in the
    backward (the conv autoencoder's plans: 1.02-1.04x their prediction before, 1.000-1.001x)."""
    import jaxremat.run._grad_tie as tie
    from jaxremat.api.calibrate import step_temp
    from jaxremat.profiling import Rates
    from jaxremat.tools import models as zoo

    x = zoo.sample_input((8, 32, 32, 3))
    chain = Chain.from_linen(zoo.autoencoder(width=16, depth=2))
    v = chain.init(jax.random.key(0), x)
    costs = jr.profile(chain, v, x, method="xla", rates=Rates(1e10, 1e10), cache=False, quiet=True)
    costs = dataclasses.replace(costs, options=None)  # stages stored whole: those the executor ties
    budgets = np.linspace(jr.min_budget(costs), jr.store_all_peak(costs), 6)[[1, 5]]
    plans = [jr.solve(costs, int(b), algorithm="optimal") for b in budgets]
    tied = [step_temp(chain, v, x, s) for s in plans]
    monkeypatch.setattr(tie, "reads_after_cotangent", lambda f, params, a: f(params, a))
    free = [step_temp(chain, v, x, s) for s in plans]
    for s, t in zip(plans, tied):
        assert t <= 1.01 * (s.peak - int(costs.x[0]))  # within the plan (1.003x at the first)
    assert all(t < f for t, f in zip(tied, free)), (tied, free)
