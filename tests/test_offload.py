"""Offloading: the simulator's transfer rules, the ``optimal_offload`` DP against an exhaustive
search over its class, and the solver's guarantees against ``optimal``."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxremat as jr
from conftest import random_chain
from jaxremat.solvers import OFFLOAD_ALGORITHMS
from jaxremat.core.ops import Op
from jaxremat.core.transfers import Bandwidth
from jaxremat.solvers.offload import offload_ops


def chain4(x=10, xbar=30, fwd=1.0, bwd=2.0, L=4):
    return jr.ChainCosts(
        fwd=[fwd] * L, bwd=[bwd] * L, x=[x] * (L + 1), xbar=[xbar] * L, fwd_tmp=[0] * L, bwd_tmp=[0] * L
    )


# -- the simulator ---------------------------------------------------------------------------------

OFFLOADED = [
    ("Fck", 0),
    ("Fck", 1),
    ("Offload", 2, "a"),
    ("Fall", 2),
    ("Loss", 3),
    ("Prefetch", 2, "a"),
    ("B", 2),
    ("FB", 1),
    ("FB", 0),
]


def test_transfers_run_beside_compute_and_stall_when_late():
    c = chain4(L=3)
    plain = jr.simulate(c, [op for op in OFFLOADED if op[0] not in ("Offload", "Prefetch")])
    # 10 bytes at 5 per unit: the offload (issued at 2) ends at 4, so Fall 2 (2..3) still holds
    # a_2; the prefetch is queued behind it (4..6), and B 2 waits from 3 to 6
    r = jr.simulate(c, OFFLOADED, bandwidth=5)
    assert (r.peak, r.time, r.stall, r.host_peak) == (plain.peak, plain.time + 3, 3.0, 10)
    fast = jr.simulate(c, OFFLOADED, bandwidth=20)  # offload 2..2.5, prefetch 3..3.5
    assert fast.time == pytest.approx(plain.time + 0.5)
    # two directions: a slow link back only
    assert jr.simulate(c, OFFLOADED, bandwidth=(1000, 5)).time == pytest.approx(plain.time + 2)


def test_offloaded_bytes_leave_at_the_first_op_after_the_copy():
    c = chain4(L=3)
    ops = [
        ("Fck", 0),
        ("Fck", 1),
        ("Offload", 1, "a"),
        ("Fck", 2),
        ("Loss", 3),
        ("FB", 2),
        ("Prefetch", 1, "a"),
        ("FB", 1),
        ("FB", 0),
    ]
    # the copy of a_1 (2 units) ends during Fck 2's... no: Fck 1 ended at 2, copy 2..4; Fck 2 runs
    # 2..3 with a_1 counted; the Loss at 3 too; FB 2 at 3 too
    slow = jr.simulate(c, ops, bandwidth=5)
    fast = jr.simulate(c, ops, bandwidth=1e9)
    keep = jr.simulate(c, [op for op in ops if op[0] not in ("Offload", "Prefetch")])
    assert slow.peak == keep.peak
    assert fast.peak == keep.peak - 10  # released before Fck 2 starts (its copy ended at 2 + 1e-8)


@pytest.mark.parametrize(
    "ops, bandwidth, message",
    [
        (OFFLOADED, None, "needs a bandwidth"),
        ([op for op in OFFLOADED if op[0] != "Prefetch"], 1e9, "not prefetched"),
        ([op for op in OFFLOADED if op[0] != "Offload"], 5, "not on the host"),
        (OFFLOADED[:3] + [("Offload", 2, "a")] + OFFLOADED[3:], 5, "already offloaded"),
        ([("Offload", 1, "a")] + OFFLOADED, 5, "nothing to offload"),
    ],
)
def test_bad_transfers_name_the_op(ops, bandwidth, message):
    with pytest.raises(ValueError, match=message) as e:
        jr.simulate(chain4(L=3), ops, bandwidth=bandwidth)
    assert "op #" in str(e.value)


def test_transfer_ops_and_bandwidth_records():
    assert Op("Offload", 3, "a").buffer == "a" and Op("Fall", 2, 1).buffer is None
    with pytest.raises(ValueError, match="'a' .* or 'abar'"):
        Op("Prefetch", 1, "b")
    with pytest.raises(ValueError, match="only 'Offload' and 'Prefetch'"):
        Op("Fall", 1, "a")
    assert Bandwidth.of(4) == Bandwidth(4.0, 4.0) and Bandwidth.of((1, 2)).to_device == 2.0
    for bad in (0, -1, math.nan, math.inf, "fast", (1,), True):
        with pytest.raises(ValueError, match="bandwidth"):
            Bandwidth.of(bad)


# -- the class, searched exhaustively ----------------------------------------------------------------


def _nested(c: jr.ChainCosts, s: int, t: int):
    """Every persistent op list of the segment ``s..t`` (``a_s`` held, ``δ_{t+1}`` live)."""
    opts = range(c.option_count(s))
    if s == t:
        yield [("FB", s)]
        for k in opts:
            yield [("Fall", s, k), ("B", s)]
        return
    for k in opts:
        for rest in _nested(c, s + 1, t):
            yield [("Fall", s, k)] + rest + [("B", s)]
    for j in range(s + 1, t + 1):
        fwd = [("Fck", s)] + [("Fn", i) for i in range(s + 1, j)]
        for right in _nested(c, j, t):
            for left in _nested(c, s, j - 1):
                yield fwd + right + left


def _top(c: jr.ChainCosts, bw: Bandwidth, s: int, held, g):
    """Every schedule of the class from step ``s``: ``held`` is this step's held input if
    offloaded (``(buffer, stage, bytes)``), ``g`` the buffer whose prefetch runs beside this
    step's backward."""
    L = c.length
    prefetch = [] if g is None else [("Prefetch", g[1], g[0])]
    if s == L:
        if held is None:
            yield prefetch + [("Loss", L)]
        return
    tau = 0.0 if held is None else held[2] / bw.to_host
    for k in range(c.option_count(s)):
        if tau > c.fwd[s]:
            break
        for o in (0, 1) if s + 1 < L and c.option(s, k).xbar > 0 else (0,):
            nxt = ("abar", s, c.option(s, k).xbar) if o else None
            for rest in _top(c, bw, s + 1, nxt, held):
                yield [("Fall", s, k)] + ([("Offload", s, "abar")] if o else []) + rest + prefetch + [("B", s)]
    for j in range(s + 1, L + 1):
        if tau > float(c.fwd[s:j].sum()):
            continue
        fwd = [("Fck", s)] + [("Fn", i) for i in range(s + 1, j)]
        for o in (0, 1) if j < L and c.x[j] > 0 else (0,):
            nxt = ("a", j, int(c.x[j])) if o else None
            for rest in _top(c, bw, j, nxt, held):
                for back in _nested(c, s, j - 1):
                    yield fwd + ([("Offload", j, "a")] if o else []) + rest + prefetch + back


def exhaustive(c: jr.ChainCosts, bw: Bandwidth) -> list[tuple[int, float, bool]]:
    """(peak, time, offloads anything) of every schedule of the class."""
    out = []
    for ops in _top(c, bw, 0, None, None):
        r = jr.simulate(c, ops, bandwidth=bw)
        out.append((r.peak, r.time, any(op[0] == "Offload" for op in ops)))
    return out


def small_chain(pick, min_len: int = 1) -> jr.ChainCosts:
    """A chain of 2..4 stages with small integer sizes and times; ``pick(lo, hi)`` draws an
    integer in ``[lo, hi]`` (hypothesis in the property tests, a seeded generator below)."""
    L = pick(min_len, 4)
    size = lambda: pick(0, 12)  # noqa: E731
    t = lambda: float(pick(0, 8))  # noqa: E731
    tmp = lambda: pick(0, 4)  # noqa: E731
    x = [size() for _ in range(L + 1)]
    xbar = [x[i + 1] + size() * pick(1, 3) for i in range(L)]
    fwd = [float(pick(1, 8)) for _ in range(L)]
    bwd = [t() for _ in range(L)]
    options = [[jr.StageOption("p", pick(0, xbar[i]), bwd[i] + t(), tmp())] if pick(0, 1) else [] for i in range(L)]
    fb = [(fwd[i] + bwd[i], fwd[i] + bwd[i] + 1.0, bwd[i])[pick(0, 2)] for i in range(L)]
    return jr.ChainCosts(
        x=x,
        xbar=xbar,
        fwd=fwd,
        bwd=bwd,
        fwd_tmp=[tmp() for _ in range(L)],
        bwd_tmp=[tmp() for _ in range(L)],
        fb=fb,
        fb_tmp=[tmp() for _ in range(L)],
        options=options,
    )


@st.composite
def small_chains(draw, min_len: int = 1):
    return small_chain(lambda lo, hi: draw(st.integers(lo, hi)), min_len)


BANDWIDTHS = [4.0, 16.0, 64.0, (8.0, 32.0), (64.0, 2.0), (32.0, 1.0)]


def check_dp_against_exhaustive(c: jr.ChainCosts, share: float, bandwidth) -> bool:
    """The offload DP, with one slot per byte, is exactly as fast as the best schedule of its
    class within a budget ``share`` of the way from the least to the largest peak; returns
    whether that best schedule offloads and beats every schedule that does not."""
    bw = Bandwidth.of(bandwidth)
    every = exhaustive(c, bw)
    x0, least = int(c.x[0]), min(p for p, _, _ in every)
    top = max(p for p, _, _ in every)
    budget = max(least + int(share * (top - least)), x0 + 1)
    best = min((t for p, t, _ in every if p <= budget), default=math.inf)
    remat = min((t for p, t, off in every if p <= budget and not off), default=math.inf)
    ops, t = offload_ops(c, budget, budget - x0, bw)  # one slot per byte: the DP is exact
    if ops is None:
        assert best == math.inf
        return False
    r = jr.simulate(c, ops, bandwidth=bw)
    assert r.peak <= budget
    assert r.time == pytest.approx(t, rel=1e-9, abs=1e-9)  # replays at its stated time
    assert t == pytest.approx(best, rel=1e-9, abs=1e-9)
    return best < remat


@settings(max_examples=40, deadline=None)
@given(small_chains(min_len=2), st.floats(0.0, 0.7), st.sampled_from(BANDWIDTHS))
def test_dp_is_optimal_in_its_class(c, share, bandwidth):
    check_dp_against_exhaustive(c, share, bandwidth)


def test_the_search_meets_offloading_wins():
    # chains from a seeded generator (not hypothesis, whose draws change between its versions):
    # the class must contain chains where offloading is strictly faster, and the DP finds them
    rng = np.random.default_rng(0)
    pick = lambda lo, hi: int(rng.integers(lo, hi + 1))  # noqa: E731
    wins = sum(
        check_dp_against_exhaustive(small_chain(pick, 2), float(rng.uniform(0, 0.7)), BANDWIDTHS[pick(0, 5)])
        for _ in range(60)
    )
    assert wins >= 5, wins


# -- the solver's guarantees ---------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(small_chains(), st.floats(0.0, 1.0), st.sampled_from([0.5, 8.0, (3.0, 30.0)]), st.sampled_from([7, 50, 500]))
def test_never_slower_than_optimal_and_never_needs_more(c, share, bandwidth, slots):
    lo = jr.min_budget(c, slots=slots)
    lo_off = jr.min_budget(c, algorithm="optimal_offload", slots=slots, bandwidth=bandwidth)
    assert lo_off <= lo
    top = max(jr.store_all_peak(c), lo)
    budget = int(lo_off + share * (top - lo_off))
    s = jr.solve(c, budget, algorithm="optimal_offload", slots=slots, bandwidth=bandwidth)
    r = jr.simulate(c, s.ops, bandwidth=bandwidth)
    assert (r.peak, r.time, r.host_peak) == (s.peak, s.time, s.host_peak) and s.peak <= budget
    if budget >= lo:
        assert s.time <= jr.solve(c, budget, slots=slots).time
    if lo_off > int(c.x[0]) + 1:
        with pytest.raises(jr.InfeasibleBudget) as e:
            jr.solve(c, lo_off - 1, algorithm="optimal_offload", slots=slots, bandwidth=bandwidth)
        assert e.value.min_budget == lo_off


def test_offloading_beats_remat_when_the_link_is_fast():
    c = chain4()
    budget = 120
    remat = jr.solve(c, budget, slots=110)
    off = jr.solve(c, budget, algorithm="optimal_offload", slots=110, bandwidth=1000)
    assert off.time < remat.time and off.offloads and off.host_peak > 0
    assert "host memory" in off.summary()
    slow = jr.solve(c, budget, algorithm="optimal_offload", slots=110, bandwidth=1e-3)
    assert slow.time == remat.time  # a link too slow to hide anything: remat alone


def test_pareto_and_errors():
    c = chain4()
    front = jr.pareto(c, algorithm="optimal_offload", bandwidth=100, points=5)
    assert front and all(a.time >= b.time for a, b in zip(front, front[1:]))
    with pytest.raises(ValueError, match="leave bandwidth out"):
        jr.solve(c, None, bandwidth=10)
    with pytest.raises(ValueError, match="needs bandwidth="):
        jr.solve(c, None, algorithm="optimal_offload")
    with pytest.raises(ValueError, match="> 0"):
        jr.min_budget(c, algorithm="optimal_offload", bandwidth=-2)
    assert "optimal_offload" in OFFLOAD_ALGORITHMS and "optimal_offload" not in jr.ALGORITHMS


def test_solve_time_grows_gently():
    c = random_chain(np.random.default_rng(0), 24)
    budget = jr.min_budget(c) + 200
    s = jr.solve(c, budget, algorithm="optimal_offload", bandwidth=20, slots=200)
    assert s.peak <= budget and s.time <= jr.solve(c, budget, slots=200).time


CRAFTED = [
    # a big bundle offloaded while the next step's forward has a big transient
    (
        jr.ChainCosts(x=[1] * 5, xbar=[20, 6, 6, 6], fwd=[1] * 4, bwd=[1] * 4, fwd_tmp=[0, 5, 0, 0], bwd_tmp=[0] * 4),
        (20, 20),
    ),
    # a_1 still on its way to the host while the next stage's forward peaks
    (jr.ChainCosts(x=[8, 6, 8], xbar=[7, 13], fwd=[3, 3], bwd=[1, 2], fwd_tmp=[1, 16], bwd_tmp=[1, 1]), 64),
    # a slow link back: prefetches stall beside short backwards
    (
        jr.ChainCosts(
            x=[2, 6, 6, 6, 6],
            xbar=[12, 12, 12, 12],
            fwd=[2, 2, 2, 2],
            bwd=[1, 1, 1, 1],
            fwd_tmp=[1, 1, 1, 1],
            bwd_tmp=[2, 2, 2, 2],
        ),
        (40, 3),
    ),
]


@pytest.mark.parametrize("c, bandwidth", CRAFTED)
def test_dp_matches_the_search_at_every_budget(c, bandwidth):
    bw = Bandwidth.of(bandwidth)
    every = exhaustive(c, bw)
    x0 = int(c.x[0])
    wins = 0
    for budget in range(min(p for p, _, _ in every), max(p for p, _, _ in every) + 1):
        best = min(t for p, t, _ in every if p <= budget)
        remat = min((t for p, t, off in every if p <= budget and not off), default=math.inf)
        ops, t = offload_ops(c, budget, budget - x0, bw)
        r = jr.simulate(c, ops, bandwidth=bw)
        assert r.peak <= budget and r.time == pytest.approx(t) and t == pytest.approx(best), budget
        wins += best < remat
    assert wins > 0 or len(c.fwd) < 3
