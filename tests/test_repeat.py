"""Repeat layers: stacked parameters, periodic schedules run as one scan, exact gradients, planned memory."""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxremat as jr
from conftest import Noisy, plain_forward
from jaxremat.api.calibrate import compile_schedule_step
from jaxremat.model.chain import Chain
from jaxremat.core.compile import as_planned
from jaxremat.run.executor import execute
from jaxremat.tools.models import gpt
from jaxremat import profile
from jaxremat.profiling import Rates
from jaxremat.core.schedule import Schedule
from jaxremat.solvers import baselines
from jaxremat.core.loops import compile_rank, is_selective
from jaxremat.solvers.periodic import (
    COMPILE_TOLERANCE,
    patterns,
    periodic_schedules,
    periodic_tree,
    selective,
    solve_periodic,
)
from jaxremat.solvers.regular import MAX_KINDS_PERMUTED, regularise
from jaxremat.core.tree import StoreUnit, parse, to_ops, units


def _kind(u):
    """A top-level unit as (kind, stages)."""
    return ("store" if isinstance(u, StoreUnit) else "region", u.stop - u.start)


class Block(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        return x + nn.Dense(self.width)(nn.gelu(nn.Dense(4 * self.width)(h)))


def _noisy_model(n: int = 12):
    model = nn.Sequential([nn.Dense(16), jr.Repeat(Noisy(), n), nn.Dense(3)])
    chain = Chain.from_linen(model, mutable=("batch_stats",), rng_streams=("dropout",))
    x = jax.random.normal(jax.random.key(1), (8, 5))
    v = model.init({"params": jax.random.key(0), "dropout": jax.random.key(3)}, x)
    return model, chain, v, x


def test_repeat_is_a_scanned_stack_and_a_chain_of_its_copies():
    model, chain, v, x = _noisy_model(5)
    assert len(chain) == 7 and [(g.layer, g.start, g.length) for g in chain.stacked] == [(1, 1, 5)]
    assert v["params"]["layers_1"]["body"]["Dense_0"]["kernel"].shape == (5, 16, 16)
    per = chain.split(v)
    assert len(per) == 7 and per[3]["params"]["Dense_0"]["kernel"].shape == (16, 16)
    jax.tree.map(np.testing.assert_array_equal, chain.merge(per), dict(v))
    assert jax.tree.map(jnp.shape, chain.init(jax.random.key(0), x)) == jax.tree.map(jnp.shape, dict(v))
    plain = nn.Sequential([nn.Dense(8), jr.Repeat(Block(8), 4)])
    pv = plain.init(jax.random.key(0), x)
    np.testing.assert_allclose(Chain.from_linen(plain).apply(pv, x), plain.apply(pv, x), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="length must be a positive int"):
        jr.Repeat(Block(8), 0)


def _grads(f, v, x, rngs):
    def loss(p):
        out, up = f({**v, "params": p}, x, rngs)
        return jnp.mean(out**2), (out, up)

    return jax.value_and_grad(loss, has_aux=True)(v["params"])


S, R = ("store", 1), ("region", 1)
# the last two are selective loops (copies stored or checkpointed alone in a mix that repeats no
# pattern of up to 4 copies: one loop body); (R, S) and (R, R, S, R) run as loops over the pattern
PATTERNS = [
    (S,),
    (("region", 2), S),
    (S, ("nested", 3)),
    (("nested", 4),),
    (R, S),
    (R, R, S, R),
    (S, S, R, S, R, R, R, S, R, S, S, R),
    (S,) * 5 + (R,) * 7,
]


def test_periodic_schedules_match_plain_autodiff_with_dropout_and_batch_stats():
    _, chain, v, x = _noisy_model(12)
    rngs = {"dropout": jax.random.key(7)}
    (rl, (ro, ru)), rg = jax.jit(lambda v: _grads(plain_forward(chain), v, x, rngs))(v)
    costs = profile(chain, v, x, method="xla", rates=Rates(1e10, 1e10), cache=False, quiet=True)
    for pattern in PATTERNS:
        ops = to_ops(periodic_tree(len(chain), [(1, 12)], {1: pattern}), len(chain))
        f = execute(chain, Schedule.from_ops(costs, ops, budget=None, algorithm="optimal"))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a periodic layer runs without the copies warning
            jaxpr = str(jax.make_jaxpr(as_planned(lambda v: _grads(f, v, x, rngs)))(v))
        assert jaxpr.count(" scan[") == 2  # the layer's forward loop and its backward loop
        (loss, (out, upd)), g = jr.jit(lambda v: _grads(f, v, x, rngs))(v)
        np.testing.assert_allclose(loss, rl, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out, ro, rtol=1e-5, atol=1e-6)  # same dropout masks
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), g, rg)
        assert sorted(upd) == sorted(ru)  # batch_stats updated once per copy
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), upd, ru)


class Masked(nn.Module):
    """A block whose activation is a pytree with integer leaves (token ids and a mask)."""

    @nn.compact
    def __call__(self, a):
        h, ids, mask = a
        h = h + jnp.tanh(nn.Dense(h.shape[-1])(h)) * mask[..., None] + 0.01 * ids[..., None]
        return h, ids, mask


def test_selective_loop_takes_pytree_activations_with_integer_leaves():
    model = nn.Sequential([jr.Repeat(Masked(), 6)])
    chain = Chain.from_linen(model)
    h = jax.random.normal(jax.random.key(1), (4, 8))
    a = (h, jnp.arange(4, dtype=jnp.int32), jnp.array([1, 0, 1, 1], jnp.int32))
    v = model.init(jax.random.key(0), a)
    costs = jr.ChainCosts.uniform(len(chain), x=4, xbar=12)
    ops = to_ops(periodic_tree(6, [(0, 6)], {0: selective(2, 6)}), 6)
    f = execute(chain, Schedule.from_ops(costs, ops, budget=None, algorithm="optimal"))
    loss = lambda fwd: lambda v, h: jnp.sum(fwd(v, (h, *a[1:]), None)[0][0] ** 2)  # noqa: E731
    got = jr.jit(jax.grad(loss(f), argnums=(0, 1)))(v, h)
    ref = jax.jit(jax.grad(loss(plain_forward(chain)), argnums=(0, 1)))(v, h)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6), got, ref)


class RematDropout(nn.Module):
    """A block whose dropout runs under its own ``nn.remat``: its backward redraws the mask, so
    it keeps the PRNG key as a residual."""

    @nn.compact
    def __call__(self, x):
        inner = nn.remat(lambda m, h: nn.Dropout(0.3, deterministic=False)(jnp.tanh(nn.Dense(16)(h))))
        return inner(self, x)


def test_a_selective_loop_keeps_prng_key_residuals():
    model = nn.Sequential([nn.Dense(16), jr.Repeat(RematDropout(), 6)])
    chain = Chain.from_linen(model, rng_streams=("dropout",))
    x = jax.random.normal(jax.random.key(1), (8, 5))
    v = model.init({"params": jax.random.key(0), "dropout": jax.random.key(3)}, x)
    costs = jr.ChainCosts.uniform(len(chain), x=4, xbar=12)
    ops = to_ops(periodic_tree(len(chain), [(1, 6)], {1: selective(2, 6)}), len(chain))
    f = execute(chain, Schedule.from_ops(costs, ops, budget=None, algorithm="optimal"))
    rngs = {"dropout": jax.random.key(7)}
    (loss, _), got = jr.jit(lambda v: _grads(f, v, x, rngs))(v)
    (rl, _), ref = jax.jit(lambda v: _grads(plain_forward(chain), v, x, rngs))(v)
    np.testing.assert_allclose(loss, rl, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, ref)


def test_a_selective_loop_compiles_one_block_body_whatever_its_pattern():
    """The step's jaxpr holds as many matrix products for any mix of stored and checkpointed
    copies (one block forward, its recomputation, its backward), where a repeated pattern of
    ``p`` copies holds ``p`` times as many."""
    _, chain, v, x = _noisy_model(12)
    costs = jr.ChainCosts.uniform(len(chain), x=4, xbar=12)

    def dots(pattern):
        ops = to_ops(periodic_tree(len(chain), [(1, 12)], {1: pattern}), len(chain))
        f = execute(chain, Schedule.from_ops(costs, ops, budget=None, algorithm="optimal"))
        step = as_planned(jax.grad(lambda v: jnp.mean(f(v, x, {"dropout": jax.random.key(0)})[0] ** 2)))
        return str(jax.make_jaxpr(step)(v)).count("dot_general")

    one = dots(selective(5, 12))
    assert dots(selective(9, 12)) == dots(PATTERNS[-2]) == one
    assert dots((S, R, S)) > one and dots((("region", 2), S)) > one  # loops over a pattern


def test_every_pattern_is_a_valid_schedule():
    L = 14
    costs = jr.ChainCosts.uniform(L, x=4, xbar=12)
    for p in (1, 2, 3, 4):
        for pattern in patterns(p):
            if 12 % p == 0:
                for outside in ("store", "region"):
                    jr.simulate(costs, to_ops(periodic_tree(L, [(1, 12)], {1: pattern}, outside), L))


def test_a_schedule_that_does_not_repeat_a_pattern_warns_and_stays_exact():
    _, chain, v, x = _noisy_model(6)
    rngs = {"dropout": jax.random.key(7)}
    costs = profile(chain, v, x, method="xla", rates=Rates(1e10, 1e10), cache=False, quiet=True)
    f = execute(chain, Schedule.from_ops(costs, baselines.revolve(len(chain), 2), budget=None, algorithm="revolve"))
    with pytest.warns(UserWarning, match="does not repeat one pattern over Repeat layer 1"):
        (loss, _), g = jr.jit(lambda v: _grads(f, v, x, rngs))(v)
    (rl, _), rg = jax.jit(lambda v: _grads(plain_forward(chain), v, x, rngs))(v)
    np.testing.assert_allclose(loss, rl, rtol=1e-5, atol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), g, rg)


def test_remat_chain_trains_a_repeat_model_like_the_plain_one():
    model = nn.Sequential([nn.Dense(16), jr.Repeat(Block(16), 8), nn.Dense(1)])
    x = jax.random.normal(jax.random.key(1), (32, 4))
    wrapped = jr.remat_chain("40%", method="xla")(model)
    v = wrapped.init(jax.random.key(0), x)
    assert jax.tree.structure(v) == jax.tree.structure(model.init(jax.random.key(0), x))
    p = wrapped.plan(v, x)
    assert p.schedule.note == "periodic" and p.predicted_peak <= p.schedule.budget
    # the share is of the loop's store-all peak, and the report names it
    assert p.schedule.asked.startswith("40% of the store-all peak with each Repeat run as one loop")
    loss = lambda apply, v: jnp.mean((apply(v, x) - 1.0) ** 2)  # noqa: E731
    g = jr.jit(jax.grad(lambda v: loss(wrapped.apply, v)))(v)
    ref = jax.jit(jax.grad(lambda v: loss(model.apply, v)))(v)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), g, ref)


def test_repeat_transformer_step_stays_within_its_plan():
    """XLA's temp memory of the whole step <= 1.10x the plan (loop transients counted), at 30%,
    50% and 75% of the store-all peak; the layer runs as one loop (no copies warning)."""
    model = gpt(blocks=12, width=64, heads=4, vocab=128, stacked=True)
    x = jax.random.randint(jax.random.key(1), (4, 64), 0, 128)
    chain = Chain.from_linen(model)
    v = model.init(jax.random.key(0), x)
    costs = profile(chain, v, x, method="xla", rates=Rates(1e10, 1e10), cache=False, quiet=True)
    for share in ("30%", "50%", "75%"):
        p = jr.plan(chain, v, x, share, costs=costs)
        assert p.schedule.note == "periodic"
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            temp = compile_schedule_step(chain, v, x, p.schedule).memory_analysis().temp_size_in_bytes
        assert temp <= 1.10 * (p.predicted_peak - int(p.costs.x[0])), share


def _uniform_with_group(L: int, start: int, n: int, xbar: int) -> tuple[jr.ChainCosts, list[tuple[int, int]]]:
    return jr.ChainCosts.uniform(L, x=4, xbar=xbar, fwd_tmp=1, bwd_tmp=2), [(start, n)]


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 12), st.integers(0, 3), st.integers(0, 3), st.integers(5, 40), st.floats(0.2, 1.0))
def test_periodic_solver_fits_runs_as_a_loop_and_is_the_fastest_loop(n, before, after, xbar, share):
    """Within budget; the group runs as one loop (a selective loop, or a pattern of at most 4
    stages); within the compile tolerance of the fastest of every loop schedule (all patterns,
    every number of stored copies) and of the baselines; of those, the least to compile."""
    L = before + n + after
    costs, groups = _uniform_with_group(L, before, n, xbar)
    budget = int(share * jr.store_all_peak(costs))
    sched = solve_periodic(costs, budget, groups)
    every = periodic_schedules(costs, groups, selective_steps=n)
    fitting = [c for c in every if c.peak <= budget]
    if sched is None:
        assert not fitting and all(
            jr.simulate(costs, ops)[0] > budget for ops in (baselines.store_all(L), baselines.every_stage(L))
        )
        return
    assert sched.peak <= budget and jr.simulate(costs, sched.ops) == (sched.peak, sched.time)
    pattern = _group_pattern(sched, before, n)
    assert is_selective(pattern, n) or sum(k for _, k in pattern) <= 4
    fastest = min(c.time for c in fitting)
    for ops in (baselines.store_all(L), baselines.every_stage(L)):  # candidates too
        peak, time = jr.simulate(costs, ops)
        if peak <= budget:
            assert fastest <= time + 1e-9
    assert sched.time <= fastest * (1 + COMPILE_TOLERANCE) + 1e-9
    near = [c for c in fitting if c.time <= fastest * (1 + COMPILE_TOLERANCE) + 1e-9]
    rank = lambda c: compile_rank(_group_pattern(c, before, n), n)  # noqa: E731
    assert rank(sched) <= min(rank(c) for c in near)


def _group_pattern(sched, start, n):
    """The shortest pattern of units (kind, stages) repeated over stages ``start .. start+n-1``."""
    shapes = [_kind(u) for u in units(parse(sched.ops, sched.costs.length))[0] if start <= u.start < start + n]
    m = next(m for m in range(1, len(shapes) + 1) if shapes == shapes[:m] * (len(shapes) // m))
    return tuple(shapes[:m])


@settings(max_examples=40, deadline=None)
@given(st.integers(3, 24), st.floats(0.05, 1.0), st.integers(0, 2))
def test_regularise_never_worsens_and_groups_alike_units(L, share, first_differs):
    xbar = [12] * L
    for i in range(first_differs):
        xbar[i] = 7
    costs = jr.ChainCosts(x=[4] * (L + 1), xbar=xbar, fwd=[1.0] * L, bwd=[2.0] * L, fwd_tmp=[1] * L, bwd_tmp=[2] * L)
    budget = int(max(share * jr.store_all_peak(costs), jr.min_budget(costs)))
    sched = jr.solve(costs, budget)
    out = regularise(sched)
    assert out.peak <= sched.peak and out.time <= sched.time * (1 + 1e-9)
    assert sorted(k for k, _ in out.ops) == sorted(k for k, _ in sched.ops)
    kinds = [u.structure() for u in units(parse(out.ops, L))[0] if u.start >= first_differs]
    runs = [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]
    if len(set(kinds)) <= MAX_KINDS_PERMUTED:  # every order of the kinds tried (more: a few orders)
        assert len(runs) == len(set(kinds))  # each kind of unit in one run


def test_regularise_groups_the_dp_interleaving_on_identical_stages():
    costs = jr.ChainCosts.uniform(48, x=65536, xbar=2_700_000, fwd_tmp=300_000, bwd_tmp=600_000)
    sched = jr.solve(costs, "50%")
    out = regularise(sched)
    kinds = [_kind(u) for u in units(parse(out.ops, 48))[0]]
    runs = [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]
    assert len(runs) == len(set(kinds))  # every kind of unit in one run
    assert out.peak <= sched.peak and out.time <= sched.time * (1 + 1e-9)


def test_calibrated_pick_takes_the_fastest_candidate_that_measures_within_budget():
    from jaxremat.api.calibrate import calibrated_pick
    from jaxremat.solvers.periodic import periodic_schedules

    costs = jr.ChainCosts.uniform(14, x=4, xbar=40, fwd_tmp=1, bwd_tmp=2)
    cands = periodic_schedules(costs, [(1, 12)])
    assert [s.time for s in cands] == sorted(s.time for s in cands)
    budget = int(0.5 * jr.store_all_peak(costs))
    measured = []

    def measure(s):  # a stand-in for XLA: 90% of the prediction, less the input
        measured.append(s)
        return int(0.9 * s.peak) - int(costs.x[0])

    got = calibrated_pick(cands, budget, measure, optimistic=lambda s: int(0.85 * s.peak), tries=50)
    fits = [s for s in cands if int(0.9 * s.peak) <= budget]
    assert got is not None and got.schedule.ops == fits[0].ops and got.measured_peak <= budget
    assert all(int(0.85 * s.peak) <= budget for s in measured)  # the hopeless are not compiled
    assert calibrated_pick(cands, 1, measure, optimistic=lambda s: 0, tries=3) is None


def test_a_budget_below_every_loop_names_the_least_budget():
    """Below what any loop over the Repeat needs, slicing its parameters would copy them: the
    plan counts the copies, and when that does not fit either says the least budget."""
    _, chain, v, x = _noisy_model(12)
    costs = jr.ChainCosts.uniform(len(chain), x=4, xbar=12)
    with pytest.raises(jr.InfeasibleBudget, match="runs as one loop from") as info:
        jr.plan(chain, v, x, 10, costs=costs)
    assert 10 < info.value.min_budget
    p = jr.plan(chain, v, x, info.value.min_budget, costs=costs)  # the least budget named is enough
    assert p.predicted_peak <= info.value.min_budget


def test_periodic_patterns_store_copies_under_their_options():
    """A store option that keeps less at a slightly slower backward is a pattern the loop solver
    picks: it fits budgets that whole stored copies do not, and is never slower than without it."""
    import dataclasses

    L, start, n = 10, 1, 8
    costs, groups = _uniform_with_group(L, start, n, 20)
    option = jr.StageOption("dots_saveable", xbar=8, bwd=float(costs.bwd[0]) * 1.1, bwd_tmp=2)
    with_options = dataclasses.replace(costs, options=tuple((option,) for _ in range(L)))
    picked = []
    for share in (0.5, 0.7, 0.9):
        budget = int(share * jr.store_all_peak(costs))
        plain, better = solve_periodic(costs, budget, groups), solve_periodic(with_options, budget, groups)
        assert better is not None and better.peak <= budget
        assert jr.simulate(with_options, better.ops) == (better.peak, better.time)
        assert plain is None or better.time <= plain.time + 1e-9
        stored = [
            u for u in units(parse(better.ops, L))[0] if isinstance(u, StoreUnit) and start <= u.stage < start + n
        ]
        picked.append(sum(u.option == 1 for u in stored))
    assert picked[0] > 0, picked  # at half the store-all peak the copies are stored under the option


def test_a_loop_pattern_keeps_each_copys_store_option():
    """Copies stored under different store options are not alike (a loop would run them all under
    the first one's policy), and a pattern of several stages never stores one under an option: its
    iteration's checkpoint would save that stage whole (measured: 156 MiB for 50 planned)."""
    from jaxremat.run.loop_plan import Alike, find_pattern

    alike = object.__new__(Alike)
    alike.ids = ["block"] * 6
    same = [StoreUnit(i, 1) for i in range(1, 5)]
    assert find_pattern(same, 1, 5, alike).period == 1
    mixed = [StoreUnit(i, i % 2) for i in range(1, 5)]
    assert not alike(mixed[0], mixed[1])
    assert find_pattern(mixed, 1, 5, alike) is None
    assert find_pattern([StoreUnit(i) for i in range(1, 5)], 1, 5, alike).period == 1
