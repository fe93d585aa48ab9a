"""Every algorithm's schedules replay within budget; optimal beats the baselines; DP == reference."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import chains, random_chain
from hypothesis import given
from hypothesis import strategies as st

import jaxremat as jr
from jaxremat.solvers import baselines
from jaxremat.solvers._discretise import discretise, least_memory
from jaxremat.solvers._dp_jax import compile_count, table
from jaxremat.solvers._dp_numpy import reference_table

BASELINES = ("revolve", "sqrt", "every_stage", "store_all", "recompute_all")
SLOTS = (500, 50)  # a few fixed values keep the number of compiled table programs small


def budget_between(costs: jr.ChainCosts, share: float) -> int:
    lo = jr.min_budget(costs, algorithm="recompute_all")
    hi = jr.store_all_peak(costs)
    return int(lo + share * (hi - lo) * 1.2) if hi > lo else hi


@given(chains(), st.floats(0.0, 1.0), st.sampled_from(SLOTS))
def test_every_algorithm_replays_within_budget(costs, share, slots):
    budget = budget_between(costs, share)
    for algorithm in jr.ALGORITHMS:
        try:
            s = jr.solve(costs, budget, algorithm=algorithm, slots=slots)
        except jr.InfeasibleBudget as e:
            assert e.min_budget > budget
            assert e.min_budget == jr.min_budget(costs, algorithm=algorithm, slots=slots)
            assert jr.solve(costs, e.min_budget, algorithm=algorithm, slots=slots).peak <= e.min_budget
            continue
        peak, time = jr.simulate(costs, s.ops)
        assert peak == s.peak <= budget
        assert time == s.time
        assert s.budget == budget and s.algorithm == algorithm


@given(chains(), st.floats(0.0, 1.0), st.sampled_from(SLOTS))
def test_optimal_never_slower_than_a_baseline(costs, share, slots):
    budget = budget_between(costs, share)
    opt = jr.solve(costs, budget, slots=slots)  # recompute_all always fits these budgets
    for algorithm in BASELINES:
        try:
            base = jr.solve(costs, budget, algorithm=algorithm)
        except jr.InfeasibleBudget:
            continue
        assert opt.time <= base.time + 1e-9 * max(1.0, base.time), algorithm


@given(chains())
def test_ample_budget_stores_everything(costs):
    s = jr.solve(costs, 10 * jr.store_all_peak(costs) + 10**6)
    assert s.time == pytest.approx(costs.fwd.sum() + costs.bwd.sum())
    assert all(d.first_pass == "stored" and d.recomputed == 0 for d in s.decisions())


@given(chains(max_len=7), st.floats(0.0, 1.0), st.sampled_from((7, 1, 23)))
def test_jax_table_equals_numpy_reference(costs, share, slots):
    c = discretise(costs, budget_between(costs, share), slots)
    A, _ = table(c)
    ref = reference_table(c)
    for (s, t), want in ref.items():
        got = A[s, t - s, : slots + 1]
        np.testing.assert_array_equal(np.isinf(got), np.isinf(want), err_msg=f"C({s},{t}) feasibility")
        fin = np.isfinite(want)
        np.testing.assert_allclose(got[fin], want[fin], rtol=2e-6, atol=1e-5)
    # the least-memory recursion agrees with the table on feasibility
    assert (least_memory(c) <= slots) == bool(np.isfinite(A[0, c.L, slots]))


def test_single_stage_chain():
    c = jr.ChainCosts(x=[8, 4], xbar=[12], fwd=[1.0], bwd=[2.0], fwd_tmp=[0], bwd_tmp=[0])
    for algorithm in jr.ALGORITHMS:
        s = jr.solve(c, None, algorithm=algorithm)
        assert s.ops[-1] in (("B", 0), ("FB", 0)) and ("Loss", 1) in s.ops
        assert ("Fall", 0) in s.ops or s.ops[-1] == ("FB", 0)  # stored, or recomputed right before its backward
        assert jr.simulate(c, s.ops) == (s.peak, s.time)


def test_sizes_that_round_to_zero_slots():
    # activations of 1 byte in slots of 4000 bytes: every size rounds up to one slot or is 0
    # (delta_0, the size of the 1 MB input, takes 250 slots)
    c = jr.ChainCosts(
        x=[10**6, 1, 0, 1, 1],
        xbar=[1, 1, 0, 2],
        fwd=[1, 1, 1, 1],
        bwd=[2, 2, 2, 2],
        fwd_tmp=[0, 0, 0, 0],
        bwd_tmp=[0, 0, 0, 0],
    )
    s = jr.solve(c, 3 * 10**6)
    assert s.time == 12 and s.peak <= 3 * 10**6
    ref = reference_table(discretise(c, 3 * 10**6, 500))
    assert ref[(0, 4)][500] == 12


def test_the_report_says_what_the_budget_was_asked_as():
    c = jr.ChainCosts(fwd=[1.0] * 4, bwd=[2.0] * 4, x=[1024] * 5, xbar=[3072] * 4, fwd_tmp=[0] * 4, bwd_tmp=[0] * 4)
    peak = jr.simulate(c, jr.solve(c, None).ops).peak
    share = jr.solve(c, "60%")
    assert share.budget == int(0.6 * peak) and share.asked == f"60% of the store-all peak, {jr.format_bytes(peak)}"
    assert f"(60% of the store-all peak, {jr.format_bytes(peak)})" in share.summary()
    assert jr.solve(c, None).asked.startswith("the store-all peak") and jr.solve(c, 10**6).asked == ""


def test_min_budget_is_exact_for_optimal():
    rng = np.random.default_rng(3)
    for L in (1, 3, 6, 12):
        c = random_chain(rng, L)
        for slots in (500, 50, 1):
            mb = jr.min_budget(c, slots=slots)
            s = jr.solve(c, mb, slots=slots)
            assert s.peak <= mb
            with pytest.raises(jr.InfeasibleBudget) as e:
                jr.solve(c, mb - 1, slots=slots)
            assert e.value.min_budget == mb
            assert f"{mb:,} bytes" in str(e.value)


def test_slots_one_and_huge_budgets():
    rng = np.random.default_rng(4)
    c = random_chain(rng, 8)
    s = jr.solve(c, jr.store_all_peak(c), slots=1)
    assert s.peak <= jr.store_all_peak(c)
    huge = jr.solve(c, 10**18)
    assert huge.time == pytest.approx(c.fwd.sum() + c.bwd.sum())
    assert jr.solve(c, "1TiB").time == huge.time


def test_rotor_alias_and_unknown_algorithm():
    c = random_chain(np.random.default_rng(5), 5)
    assert jr.solve(c, "60%", algorithm="rotor").ops == jr.solve(c, "60%").ops
    assert jr.solve(c, "60%", algorithm="rotor").algorithm == "rotor"
    with pytest.raises(ValueError, match="unknown algorithm 'dp'; choose one of 'optimal'"):
        jr.solve(c, "60%", algorithm="dp")
    with pytest.raises(ValueError, match="slots must be an int >= 1"):
        jr.solve(c, "60%", slots=0)
    with pytest.raises(TypeError, match="expected ChainCosts"):
        jr.solve({"x": [1]}, "60%")


def test_revolve_uses_more_snapshots_with_more_memory():
    c = jr.ChainCosts.uniform(16, x=10, xbar=30)
    tight = jr.solve(c, jr.min_budget(c, algorithm="revolve"), algorithm="revolve")
    loose = jr.solve(c, jr.store_all_peak(c), algorithm="revolve")
    assert tight.note == "0 snapshot(s)" and tight.ops == jr.solve(c, None, algorithm="recompute_all").ops
    assert loose.time < tight.time


def test_revolve_is_binomially_optimal_on_uniform_chains():
    # unit steps: revolve's forward count equals Griewank's optimum for its snapshot count
    for L, snaps in ((10, 2), (20, 3), (7, 1)):
        ops = baselines.revolve(L, snaps)
        c = jr.ChainCosts.uniform(L, x=1, xbar=1, fwd=1.0, bwd=0.0)
        _, time = jr.simulate(c, ops)
        fwd_ops = sum(1 for k, i in ops if k != "B" and k != "Loss")
        assert time == fwd_ops
        assert fwd_ops == int(baselines.revolve_forwards(np.array([L + 1]), snaps)[0]) - 1  # the loss step is free


def test_sqrt_has_about_sqrt_l_checkpoints():
    ops = baselines.sqrt_segments(16)
    assert [i for k, i in ops if k == "Fck"] == [0, 4, 8, 12]


def test_pareto_front():
    c = random_chain(np.random.default_rng(6), 10)
    front = jr.pareto(c, algorithm="optimal", points=8)
    assert len(front) == 8
    assert [s.budget for s in front] == sorted(s.budget for s in front)
    assert front[0].budget == jr.min_budget(c)
    assert all(s.peak <= s.budget for s in front)
    assert front[-1].time == pytest.approx(c.fwd.sum() + c.bwd.sum())
    some = jr.pareto(c, algorithm="sqrt", budgets=["50%", "100%", 1])
    assert [s.budget for s in some] == [jr.store_all_peak(c)]


def test_similar_depth_reuses_the_compiled_table():
    rng = np.random.default_rng(7)
    jr.solve(random_chain(rng, 40), "50%")
    before = compile_count()
    jr.solve(random_chain(rng, 38), "45%")
    jr.solve(random_chain(rng, 44), "30%")
    assert compile_count() == before


@pytest.mark.parametrize("L, share", [(23, 0.1), (23, 0.5), (41, 0.3), (41, 0.9)])
def test_pruning_leaves_the_table_unchanged(L, share):
    """The fill skips splits that cannot win; every entry must equal the unpruned fill's, bit for bit."""
    costs = random_chain(np.random.default_rng(L), L)
    c = discretise(costs, budget_between(costs, share), 500)
    pruned, _ = table(c)
    full, _ = table(c, prune=False)
    np.testing.assert_array_equal(pruned, full)


@given(chains(), st.floats(0.0, 1.0))
def test_leanest_is_the_least_memory_within_the_tie_of_the_fastest(costs, share):
    """The plan jr.remat keeps: no slower than the fastest by more than LEAN_TIE, no larger, and
    no schedule the solver finds a DP step below it is as fast (the bisection's resolution)."""
    from jaxremat.solvers.lean import LEAN_TIE, leanest, preferred

    budget = budget_between(costs, share)
    fastest = jr.solve(costs, budget, slots=50)
    lean = leanest(costs, fastest, slots=50)
    assert lean.peak <= fastest.peak and lean.budget == fastest.budget
    assert lean.time <= fastest.time * (1 + LEAN_TIE) + 1e-12
    assert jr.simulate(costs, lean.ops) == (lean.peak, lean.time)
    below = lean.peak - 2 * max(1, fastest.peak // 50)
    if below > 0:
        try:
            assert jr.solve(costs, below, slots=50).time > fastest.time * (1 + LEAN_TIE)
        except jr.InfeasibleBudget:
            pass
    # the ranking it follows: cheaper beyond the tie, else tied and leaner
    assert preferred(0.98, 10, 1.0, 5) and preferred(1.005, 4, 1.0, 5)
    assert not preferred(1.005, 6, 1.0, 5) and not preferred(1.02, 1, 1.0, 5)
