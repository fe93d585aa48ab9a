"""Contract version 2: store options under checkpoint policies and the fused forward-backward FB,
in the simulator, the solvers and the executor."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import Noisy, chains, plain_forward
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxremat as jr
from jaxremat.run import execute
from jaxremat.solvers import baselines
from jaxremat.solvers._discretise import discretise, least_memory
from jaxremat.solvers._dp_jax import table
from jaxremat.solvers._dp_numpy import reference_table
from test_exhaustive import exhaustive_best_time


def chain3(**v2) -> jr.ChainCosts:
    return jr.ChainCosts(
        x=[100, 10, 15, 20],
        xbar=[30, 35, 40],
        fwd=[1.0, 2.0, 3.0],
        bwd=[2.0, 3.0, 4.0],
        fwd_tmp=[5, 6, 7],
        bwd_tmp=[8, 9, 10],
        **v2,
    )


# -- the simulator ---------------------------------------------------------------------------------


def test_fb_defaults_cost_what_fall_then_b_costs():
    c = chain3()
    fall_b = [
        ("Fck", 0),
        ("Fck", 1),
        ("Fck", 2),
        ("Loss", 3),
        ("Fall", 2),
        ("B", 2),
        ("Fall", 1),
        ("B", 1),
        ("Fall", 0),
        ("B", 0),
    ]
    fused = [("Fck", 0), ("Fck", 1), ("Fck", 2), ("Loss", 3), ("FB", 2), ("FB", 1), ("FB", 0)]
    assert jr.simulate(c, fused) == jr.simulate(c, fall_b)


def test_fb_and_options_have_their_own_costs_and_rules():
    c = chain3(fb=[2.5, 4.0, 5.0], fb_tmp=[1, 2, 3], options=[[jr.StageOption("dots_saveable", 12, 2.5, 20)], [], []])
    ops = [("Fall", 0, 1), ("Fck", 1), ("Fck", 2), ("Loss", 3), ("FB", 2), ("FB", 1), ("B", 0)]
    # peaks while each op runs: 12+5, 12+15+6, 27+20+7, 47+20, FB 2: 47+15+3, FB 1: 27+10+2, B 0: 22+100+20
    assert jr.simulate(c, ops) == (100 + 142, 1.0 + 2.0 + 3.0 + 5.0 + 4.0 + 2.5)
    summary = jr.Schedule.from_ops(c, ops, budget=None, algorithm="optimal").summary()
    assert "stored under dots_saveable" in summary and "fused with its backward" in summary
    with pytest.raises(ValueError, match="no option 2"):
        jr.simulate(c, [("Fall", 0, 2)])
    with pytest.raises(ValueError, match=r"op #4 \('FB', 2\): abar_2 is live"):
        jr.simulate(c, [("Fall", 0), ("Fall", 1), ("Fall", 2), ("Loss", 3), ("FB", 2)])
    with pytest.raises(ValueError, match="standalone a_2 is live"):
        jr.simulate(c, [("Fck", 0), ("Fck", 1), ("Fck", 2), ("Loss", 3), ("FB", 2), ("Fck", 1), ("FB", 1)])
    with pytest.raises(ValueError, match="only 'Fall' takes a store option"):
        jr.simulate(c, [("Fck", 0, 1)])


def test_options_are_validated_and_travel_in_dicts_and_tables():
    c = chain3(options=[[("dots_saveable", 12, 2.5, 20)], (), None])
    assert c.options[0][0] == jr.StageOption("dots_saveable", 12, 2.5, 20) and c.option_count(1) == 1
    assert jr.ChainCosts.from_dict(c.to_dict()) == c
    assert "dots_saveable 12 B / 2500 / 20 B" in c.table()
    with pytest.raises(ValueError, match=r"options\[0\]\[0\] \(stage 0, option 1\)\.xbar = -1"):
        chain3(options=[[("dots", -1, 2.5, 20)], [], []])
    with pytest.raises(ValueError, match="options has 2 entries; expected L = 3"):
        chain3(options=[[], []])
    with pytest.raises(ValueError, match="names a policy twice"):
        chain3(options=[[("a", 1, 1.0, 1), ("a", 2, 1.0, 1)], [], []])
    with pytest.raises(ValueError, match="fb has 2 entries"):
        chain3(fb=[1.0, 2.0])


def test_output_bytes_a_backward_does_not_read_are_gone_when_it_runs():
    """``B i`` counts its bundle less ``unread``: the output bytes its backward does not read,
    freed once the next stage's backward (or the loss) has read them; checked and saved."""
    c = jr.ChainCosts(x=[8, 8, 8], xbar=[16, 16], fwd=[1, 1], bwd=[1, 1], fwd_tmp=[0, 0], bwd_tmp=[0, 0])
    ops = [("Fall", 0), ("Fall", 1), ("Loss", 2), ("B", 1), ("B", 0)]
    # peak at B 1: a_0 + both bundles + delta_2 + delta_1 = 56; without stage 1's output: 48
    credited = dataclasses.replace(c, unread=[0, 8])
    assert jr.simulate(c, ops).peak == 56 and jr.simulate(credited, ops).peak == 48
    assert jr.solve(credited, 48).peak == 48 and jr.store_all_peak(credited) == 48
    # a bundle made again after the loss has read a_2 was never read: it keeps its output
    again = [("Fall", 0), ("Fn", 1), ("Loss", 2), ("Fall", 1), ("B", 1), ("B", 0)]
    assert jr.simulate(credited, again).peak == jr.simulate(c, again).peak == 56
    with_option = dataclasses.replace(c, options=[(), [jr.StageOption("dots", 12, 1.0, 0, unread=8)]])
    assert jr.simulate(with_option, [("Fall", 0), ("Fall", 1, 1), ("Loss", 2), ("B", 1), ("B", 0)]).peak == 44
    for costs in (credited, with_option):
        assert jr.ChainCosts.from_dict(costs.to_dict()) == costs
    assert "unread" in credited.table() and "/ 8 B" in with_option.table()
    with pytest.raises(ValueError, match=r"unread\[1\] = 9 is more than stage 1's output"):
        dataclasses.replace(c, unread=[0, 9])
    with pytest.raises(ValueError, match=r"unread = 13 is more than its xbar"):
        jr.StageOption.of({"name": "dots", "xbar": 12, "bwd": 1.0, "bwd_tmp": 0, "unread": 13}, "the option")
    with pytest.raises(ValueError, match=r"options\[1\]\[0\] \(dots\): unread = 10 is more than stage 1's output"):
        dataclasses.replace(c, options=[(), [jr.StageOption("dots", 12, 1.0, 0, unread=10)]])


# -- the solvers -------------------------------------------------------------------------------------


@given(chains(max_len=7, v2=True), st.floats(0.0, 1.0), st.sampled_from((7, 23)))
def test_jax_table_equals_numpy_reference_with_options_and_fb(costs, share, slots):
    lo, hi = jr.min_budget(costs, algorithm="recompute_all"), jr.store_all_peak(costs)
    c = discretise(costs, int(lo + share * (hi - lo) * 1.2) if hi > lo else hi, slots)
    A, _ = table(c)
    for (s, t), want in reference_table(c).items():
        got = A[s, t - s, : slots + 1]
        np.testing.assert_array_equal(np.isinf(got), np.isinf(want), err_msg=f"C({s},{t}) feasibility")
        fin = np.isfinite(want)
        np.testing.assert_allclose(got[fin], want[fin], rtol=2e-6, atol=1e-5)
    assert (least_memory(c) <= slots) == bool(np.isfinite(A[0, c.L, slots]))


@given(chains(v2=True), st.floats(0.0, 1.0))
def test_optimal_with_options_fits_and_beats_every_baseline(costs, share):
    lo, hi = jr.min_budget(costs, algorithm="recompute_all"), jr.store_all_peak(costs)
    budget = int(lo + share * (hi - lo) * 1.2) if hi > lo else hi
    opt = jr.solve(costs, budget)
    assert opt.peak <= budget and jr.simulate(costs, opt.ops) == (opt.peak, opt.time)
    for algorithm in ("revolve", "sqrt", "every_stage", "store_all", "recompute_all"):
        try:
            base = jr.solve(costs, budget, algorithm=algorithm)
        except jr.InfeasibleBudget:
            continue
        assert opt.time <= base.time + 1e-9 * max(1.0, base.time), algorithm
    assert jr.solve(costs, jr.min_budget(costs)).peak <= jr.min_budget(costs)


@settings(max_examples=60)
@given(chains(v2=True, max_len=6), st.floats(0.0, 1.0))
def test_every_hand_written_policy_is_in_the_schedule_space(costs, share):
    """Storing every stage under one option (what jax.checkpoint(block, policy) around every block
    does) is a schedule; at its peak, optimal is never slower."""
    L = costs.length
    for k in range(1, costs.max_options):
        if any(costs.option_count(i) <= k for i in range(L)):
            continue
        ops = [("Fall", i, k) for i in range(L)] + [("Loss", L)] + [("B", i) for i in reversed(range(L))]
        peak, time = jr.simulate(costs, ops)
        opt = jr.solve(costs, peak)
        assert opt.peak <= peak and opt.time <= time + 1e-9 * max(1.0, time)


def test_near_ties_in_time_go_to_the_schedule_of_fewer_flops():
    """Profiled times carry noise that flops do not: a store option predicted 0.5% faster on the
    profile but running 1.25x the backward flops ties with storing whole (within
    ``FLOPS_TIE``), which wins on flops; 25% faster, the option wins. Without flops (hand-written
    costs), the fastest schedule as before."""
    from jaxremat.solvers.optimal import FLOPS_TIE

    def chain(option_bwd: float, flops: bool = True) -> jr.ChainCosts:
        counted = dict(fwd_flops=[10.0, 10.0], bwd_flops=[20.0, 20.0], fb_flops=[30.0, 30.0]) if flops else {}
        option = jr.StageOption("policy", 200, option_bwd, 0, 25.0 if flops else None)
        return jr.ChainCosts(
            x=[100, 100, 100],
            xbar=[300, 300],
            fwd=[1.0, 1.0],
            bwd=[2.0, 2.0],
            fwd_tmp=[0, 0],
            bwd_tmp=[0, 0],
            options=[[option], [option]],
            **counted,
        )

    def options_used(s: jr.Schedule) -> list[int]:
        return sorted({op.option for op in s.ops if op.kind == "Fall"})

    near = chain(1.99)
    whole = jr.solve(near, None, algorithm="store_all")
    s = jr.solve(near, whole.peak)
    assert options_used(s) == [0] and s.time <= (1 + FLOPS_TIE) * jr.solve(chain(1.99, flops=False), whole.peak).time
    assert "fewer flops" in s.summary()
    assert options_used(jr.solve(chain(1.99, flops=False), whole.peak)) == [1]
    assert options_used(jr.solve(chain(1.5), whole.peak)) == [1]


def test_exhaustive_search_with_options_and_fb_never_beats_the_dp_from_below():
    rng = np.random.default_rng(5)
    total = 0
    for _ in range(25):
        L = int(rng.integers(1, 4))
        xbar = rng.integers(2, 30, L) * 8
        costs = jr.ChainCosts(
            x=rng.integers(1, 12, L + 1) * 8,
            xbar=xbar,
            fwd=rng.integers(1, 5, L).astype(float),
            bwd=rng.integers(1, 8, L).astype(float),
            fwd_tmp=rng.integers(0, 3, L) * 8,
            bwd_tmp=rng.integers(0, 3, L) * 8,
            fb=rng.integers(1, 10, L).astype(float),
            fb_tmp=rng.integers(0, 20, L) * 8,
            options=[
                [jr.StageOption("p", int(xbar[i] // 2), float(rng.integers(2, 10)), int(rng.integers(0, 3)) * 8)]
                for i in range(L)
            ],
        )
        lo, hi = jr.min_budget(costs), jr.store_all_peak(costs)
        for budget in sorted({lo, (lo + hi) // 2, hi}):
            opt = jr.solve(costs, budget)
            best = exhaustive_best_time(costs, budget)
            assert best <= opt.time + 1e-9
            total += 1
    assert total >= 40


def test_baselines_fuse_the_last_stage_of_each_segment():
    ops = baselines.every_stage(3)
    assert [op for op in ops if op[0] in ("B", "FB")] == [("FB", 2), ("FB", 1), ("FB", 0)]
    assert [op for op in baselines.sqrt_segments(4) if op[0] == "FB"] == [("FB", 3), ("FB", 1)]
    c = chain3(fb=[0.5, 0.5, 0.5], fb_tmp=[0, 0, 0])
    assert jr.solve(c, None, algorithm="every_stage").time == 1 + 2 + 3 + 1.5


# -- the executor ------------------------------------------------------------------------------------


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(16)(nn.gelu(nn.Dense(32)(x)))


def test_options_and_fb_run_exactly_with_dropout_and_batch_stats():
    chain = jr.Chain.from_linen(
        [Block(), Noisy(), Block(), Noisy(), Block()], mutable=("batch_stats",), rng_streams=("dropout",)
    )
    x = jax.random.normal(jax.random.key(0), (8, 16))
    v = chain.init(jax.random.key(1), x)
    rngs = {"dropout": jax.random.key(2)}
    L = len(chain)
    opts = [[jr.StageOption("dots_saveable", 4, 1.0, 0), jr.StageOption("nothing_saveable", 2, 1.0, 0)]] * L
    costs = jr.ChainCosts.uniform(L, x=1, xbar=8)
    costs = jr.ChainCosts(
        **{f: getattr(costs, f) for f in ("x", "xbar", "fwd", "bwd", "fwd_tmp", "bwd_tmp")}, options=opts
    )

    def grads(f):
        def loss(v):
            out, upd = f(v, x, rngs)
            return jnp.mean(out**2), upd

        return jr.jit(jax.value_and_grad(loss, has_aux=True))(v)

    (ref_l, ref_u), ref_g = grads(plain_forward(chain))
    schedules = [
        [
            ("Fall", 0, 1),
            ("Fall", 1, 2),
            ("Fck", 2),
            ("Fn", 3),
            ("Fall", 4, 1),
            ("Loss", 5),
            ("B", 4),
            ("Fall", 2, 1),
            ("FB", 3),
            ("B", 2),
            ("B", 1),
            ("B", 0),
        ],
        baselines.every_stage(L),
        baselines.sqrt_segments(L),
    ]
    for ops in schedules:
        f = execute(chain, jr.Schedule.from_ops(costs, ops, budget=None, algorithm="optimal"))
        (value, u), g = grads(f)
        np.testing.assert_allclose(value, ref_l, rtol=1e-6)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), g, ref_g)
        for i, new in ref_u.items():
            jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), u[i], new)


def test_an_option_keeps_what_its_policy_saves():
    """Under dots_saveable the stored stage keeps its matmul outputs, not its element-wise work: the
    step's jaxpr holds fewer saved values for the backward than stored whole."""
    chain = jr.Chain.from_linen([Block(), Block()])
    x = jnp.ones((64, 16))
    v = chain.init(jax.random.key(0), x)
    costs = jr.ChainCosts(
        x=[1, 1, 1],
        xbar=[8, 8],
        fwd=[1, 1],
        bwd=[1, 1],
        fwd_tmp=[0, 0],
        bwd_tmp=[0, 0],
        options=[[jr.StageOption("nothing_saveable", 1, 2.0, 0)]] * 2,
    )

    def residual_bytes(ops):
        f = execute(chain, jr.Schedule.from_ops(costs, ops, budget=None, algorithm="optimal"))
        _, pull = jax.vjp(lambda v: f(v, x)[0], v)
        leaves = [r for r in jax.tree.leaves(pull) if hasattr(r, "nbytes")]
        return sum(int(r.nbytes) for r in leaves)

    whole = residual_bytes([("Fall", 0), ("Fall", 1), ("Loss", 2), ("B", 1), ("B", 0)])
    policy = residual_bytes([("Fall", 0, 1), ("Fall", 1, 1), ("Loss", 2), ("B", 1), ("B", 0)])
    assert policy < whole


def test_unknown_and_bad_policies_are_named():
    chain = jr.Chain.from_linen([Block(), Block()])
    costs = jr.ChainCosts(
        x=[1, 1, 1],
        xbar=[8, 8],
        fwd=[1, 1],
        bwd=[1, 1],
        fwd_tmp=[0, 0],
        bwd_tmp=[0, 0],
        options=[[jr.StageOption("qkv", 1, 2.0, 0)]] * 2,
    )
    sched = jr.Schedule.from_ops(
        costs, [("Fall", 0, 1), ("Fall", 1), ("Loss", 2), ("B", 1), ("B", 0)], budget=None, algorithm="optimal"
    )
    with pytest.raises(
        ValueError, match=r"stage 0 \(0:Block\), option 1, is stored under policy 'qkv'.*policies=\{'qkv'"
    ):
        execute(chain, sched)
    f = execute(chain, sched, policies={"qkv": jax.checkpoint_policies.save_only_these_names("q")})
    assert f(chain.init(jax.random.key(0), jnp.ones((2, 16))), jnp.ones((2, 16)))[0].shape == (2, 16)
    with pytest.raises(ValueError, match="looks like a policy factory"):
        execute(chain, sched, policies={"qkv": jax.checkpoint_policies.save_only_these_names})
    with pytest.raises(ValueError, match="unknown policy name"):
        jr.remat_chain("50%", policies=["dots_savable"])
    with pytest.raises(ValueError, match="not a jax.checkpoint policy"):
        jr.remat_chain("50%", policies={"x": 3})


# -- the profiler --------------------------------------------------------------------------------------


def test_profile_measures_store_options_and_fb():
    chain = jr.Chain.from_linen([Block(), Block(), nn.Dense(4)])
    x = jnp.ones((64, 16))
    v = chain.init(jax.random.key(0), x)
    rates = jr.profiling.Rates(1e10, 1e10)
    costs = jr.profile(chain, v, x, method="xla", rates=rates, quiet=True)
    assert costs.options is not None
    names = {o.name for per in costs.options for o in per}
    assert names and names <= {"dots_saveable", "dots_with_no_batch_dims_saveable"}
    for i, per in enumerate(costs.options):
        for o in per:  # kept: not beaten by store-all on every count
            assert o.xbar < costs.xbar[i] or o.bwd < costs.bwd[i] or o.bwd_tmp < costs.bwd_tmp[i]
    # a block under dots_saveable keeps its two matmul outputs but not gelu's work
    assert costs.options[0] and costs.options[0][0].xbar < costs.xbar[0]
    assert np.all(costs.fb <= costs.fwd + costs.bwd + 1e-12)
    none = jr.profile(chain, v, x, method="xla", rates=rates, quiet=True, policies=())
    assert none.options is None and np.array_equal(none.xbar, costs.xbar)
    mine = jr.profile(
        chain,
        v,
        x,
        method="xla",
        rates=rates,
        quiet=True,
        policies={"nothing": jax.checkpoint_policies.nothing_saveable},
    )
    assert "nothing" in {o.name for per in mine.options for o in per}


def test_plans_save_and_load_options_and_fb(tmp_path):
    chain = jr.Chain.from_linen([Block(), Block(), nn.Dense(4)])
    x = jnp.ones((64, 16))
    v = chain.init(jax.random.key(0), x)
    costs = jr.profile(chain, v, x, method="xla", quiet=True)
    budget = (jr.min_budget(costs) + jr.store_all_peak(costs)) // 2
    p = jr.plan(chain, v, x, budget, costs=costs)
    assert p.costs.options is not None
    p.save(tmp_path / "plan.json")
    q = jr.load_plan(tmp_path / "plan.json")
    assert (
        q.schedule.ops == p.schedule.ops
        and q.costs == p.costs
        and (q.schedule.peak, q.schedule.time) == (p.schedule.peak, p.schedule.time)
    )


def test_a_repeat_layer_stored_under_a_policy_runs_as_a_loop_exactly():
    from jaxremat.core.compile import as_planned

    chain = jr.Chain.from_linen(nn.Sequential([nn.Dense(16), jr.Repeat(Block(), 6), nn.Dense(4)]))
    x = jax.random.normal(jax.random.key(0), (8, 16))
    v = chain.init(jax.random.key(1), x)
    L = len(chain)
    costs = jr.ChainCosts(
        x=[1] * (L + 1),
        xbar=[8] * L,
        fwd=[1] * L,
        bwd=[1] * L,
        fwd_tmp=[0] * L,
        bwd_tmp=[0] * L,
        options=[[jr.StageOption("dots_saveable", 4, 1.5, 0)]] * L,
    )
    ops = [("Fall", 0)] + [("Fall", i, 1) for i in range(1, L - 1)] + [("Fall", L - 1), ("Loss", L)]
    ops += [("B", i) for i in reversed(range(L))]
    f = execute(chain, jr.Schedule.from_ops(costs, ops, budget=None, algorithm="optimal"))
    loss = lambda f: lambda v: jnp.mean(f(v, x, None)[0] ** 2)  # noqa: E731
    g = jr.jit(jax.grad(loss(f)))(v)
    ref = jr.jit(jax.grad(loss(plain_forward(chain))))(v)
    # float32: a recomputation inside the loop rounds a few entries differently (3e-6 seen)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), g, ref)
    step = str(jax.make_jaxpr(as_planned(jax.grad(loss(f))))(v))
    assert "scan" in step and "remat" in step  # one loop over the copies, each under its policy


def test_fb_time_is_at_most_fall_and_b_with_the_forward_it_still_runs():
    from jaxremat.profiling.timing import fused_time

    # timed alone, FB came out slower than Fall; B while running 0.91 of their flops (a GPT block:
    # forward 0.24, backward 0.477 GFLOP): its bound keeps the backward and 0.73 of the forward
    assert fused_time(8.5, 2.7, 5.4, 0.6525, 0.24, 0.477) == pytest.approx(5.4 + 2.7 * 0.1755 / 0.24)
    assert fused_time(6.0, 2.7, 5.4, 0.6525, 0.24, 0.477) == 6.0  # a faster measurement stands
    assert fused_time(9.0, 2.7, 5.4, 1.2, 0.24, 0.477) == pytest.approx(8.1)  # never above Fall; B
    assert fused_time(9.0, 2.7, 5.4, 0.3, 0.24, 0.477) == pytest.approx(5.4)  # nor below B's own time
    assert fused_time(9.0, 2.7, 5.4, 0.0, 0.0, 0.0) == pytest.approx(8.1)  # flops unknown: Fall; B


def test_an_option_that_recomputes_less_is_kept_whatever_its_timing():
    """Two policies' backwards can time within noise of each other (a GPT block's under
    ``dots_saveable`` and ``dots_with_no_batch_dims_saveable``): the one with fewer flops stays an
    option even where the other measured no slower, smaller and with no more transient bytes."""
    from jaxremat.profiling.profiler import useful_options
    from jaxremat.profiling.stage import OptionProfile, StageProfile

    stage = dict(
        name="b",
        kind="Block",
        out_shape="(4,)",
        x_out=4,
        xbar=100,
        fwd_tmp=0,
        bwd_tmp=10,
        fwd_flops=1.0,
        bwd_flops=2.0,
        fwd_bytes=0.0,
        bwd_bytes=0.0,
        fwd_time=1.0,
        bwd_time=2.0,
    )
    # OptionProfile(name, xbar, bwd_tmp, bwd_flops, bwd_bytes, bwd_time)
    fewer = OptionProfile("dots_saveable", 40, 12, 2.5, 0.0, 2.6)  # recomputes less, timed slower
    smaller = OptionProfile("dots_with_no_batch_dims_saveable", 20, 12, 3.0, 0.0, 2.5)
    kept = useful_options(StageProfile(**stage, options=(fewer, smaller)))
    assert [o.name for o in kept] == ["dots_saveable", "dots_with_no_batch_dims_saveable"]
    # as many flops, slower and bigger: never better, dropped
    same = OptionProfile("dots_saveable", 40, 12, 3.0, 0.0, 2.6)
    kept = useful_options(StageProfile(**stage, options=(same, smaller)))
    assert [o.name for o in kept] == ["dots_with_no_batch_dims_saveable"]


def test_an_options_backward_time_is_at_most_fbs():
    """The backward under a policy recomputes part of what FB recomputes: timed slower than FB (a
    GPT's LM head: 1.91 ms against 1.38 for FB and 1.37 for its backward), it is taken as FB's."""
    from jaxremat.profiling.timing import option_time

    assert option_time(1.91, 1.37, 1.38) == 1.38
    assert option_time(5.28, 4.52, 6.21) == 5.28  # below FB: as measured
    assert option_time(5.0, 4.5, 4.0) == 4.5  # FB measured under the backward: the backward's time
    assert option_time(4.0, 4.5, 6.0) == 4.0  # a measurement under the backward's stands


def test_a_policy_candidate_takes_the_least_kept_option_where_a_stage_lacks_the_policy():
    """The profiler drops an option no better than another (a patch embedding's
    ``dots_with_no_batch_dims_saveable`` keeps what its ``dots_saveable`` keeps); the candidate
    "every stage under" that policy then takes the stage's option that keeps the fewest bytes, as
    the hand-written strategy does, not store-all."""
    from jaxremat.solvers.optimal import candidates

    dots = jr.StageOption("dots_saveable", 150, 2.0, 0)
    nobatch = jr.StageOption("dots_with_no_batch_dims_saveable", 120, 2.5, 0)
    costs = jr.ChainCosts(
        x=[100, 100, 100],
        xbar=[300, 300],
        fwd=[1.0, 1.0],
        bwd=[2.0, 2.0],
        fwd_tmp=[0, 0],
        bwd_tmp=[0, 0],
        options=[[dots], [dots, nobatch]],
    )
    ops = candidates(costs)["every stage under dots_with_no_batch_dims_saveable"]
    assert [op.option for op in ops if op.kind == "Fall"] == [1, 2]
    peak, time = jr.simulate(costs, ops)
    opt = jr.solve(costs, peak)
    assert opt.peak <= peak and opt.time <= time
