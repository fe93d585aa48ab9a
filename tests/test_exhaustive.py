"""On tiny chains, compare the DP with a shortest-path search over every valid op sequence
(store options and FB included)."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math

import numpy as np

import jaxremat as jr
from jaxremat.core.simulator import FORWARD_KINDS, Machine


def exhaustive_best_time(costs: jr.ChainCosts, budget: int, persistent: bool = False) -> float:
    """Least time of any valid schedule within ``budget`` (Dijkstra over simulator states).

    ``persistent``: only schedules in which a standalone activation, once kept past the op after
    the one that made it, stays until its stage's backward (``Fn i`` frees only the ``a_i`` the
    op before it made): the class the DP is optimal in."""
    L = costs.length
    start = Machine(costs)
    x0 = int(costs.x[0])
    seen: dict[tuple, float] = {}
    tie = itertools.count()
    heap = [(0.0, next(tie), start, None)]
    while heap:
        t, _, m, fresh = heapq.heappop(heap)
        if m.done:
            return t
        key = (m.key(), fresh)
        if key in seen:
            continue
        seen[key] = t
        ops = [(k, i) for i in range(max(m.next_b, -1) + 1) for k in FORWARD_KINDS]
        ops += [("Fall", i, k) for i in range(max(m.next_b, -1) + 1) for k in range(1, costs.option_count(i))]
        ops += [("Loss", L), ("B", m.next_b), ("FB", m.next_b)] if m.next_b >= 0 else []
        for op in ops:
            if persistent and op[0] == "Fn" and op[1] in m.a and op[1] != fresh:
                continue
            nxt = m.copy()
            try:
                peak = nxt.step(op)
            except ValueError:
                continue
            made = op[1] + 1 if op[0] in ("Fn", "Fck") else None
            if x0 + peak <= budget and (nxt.key(), made) not in seen:
                heapq.heappush(heap, (nxt.time, next(tie), nxt, made))
    return math.inf


def test_exhaustive_never_slower_and_optimal_never_below(capsys):
    rng = np.random.default_rng(11)
    equal = total = 0
    for trial in range(60):
        L = int(rng.integers(1, 5))
        costs = jr.ChainCosts(
            x=rng.integers(0, 12, L + 1) * 8,
            xbar=rng.integers(1, 30, L) * 8,
            fwd=rng.integers(1, 5, L).astype(float),
            bwd=rng.integers(1, 8, L).astype(float),
            fwd_tmp=rng.integers(0, 3, L) * 8 * int(rng.integers(0, 2)),
            bwd_tmp=rng.integers(0, 3, L) * 8 * int(rng.integers(0, 2)),
        )
        lo, hi = jr.min_budget(costs), jr.store_all_peak(costs)
        for budget in sorted({lo, (lo + hi) // 2, hi}):
            opt = jr.solve(costs, budget)
            best = exhaustive_best_time(costs, budget)
            assert best <= opt.time + 1e-9, (trial, budget)
            assert opt.time >= best - 1e-9
            total += 1
            equal += math.isclose(best, opt.time)
    with capsys.disabled():
        print(f"\nexhaustive search == optimal on {equal}/{total} tiny-chain budgets")
    assert total >= 100


def _shared_chain(rng: np.random.Generator) -> jr.ChainCosts:
    """A tiny random chain with one or two values shared by runs of activations (skips)."""
    L = int(rng.integers(3, 6))
    x = rng.integers(0, 10, L + 1) * 8
    shared = []
    for _ in range(int(rng.integers(1, 3))):
        first = int(rng.integers(1, L))
        last = int(rng.integers(first + 1, L + 1))
        shared.append(jr.Shared(first, last, int(rng.integers(1, 8)) * 8))
        x[first : last + 1] += shared[-1].nbytes
    xbar = rng.integers(1, 30, L) * 8
    for v in shared:  # the making stage's bundle holds the value
        xbar[v.first - 1] += v.nbytes
    return jr.ChainCosts(
        x=x,
        xbar=xbar,
        fwd=rng.integers(1, 5, L).astype(float),
        bwd=rng.integers(1, 8, L).astype(float),
        fwd_tmp=rng.integers(0, 3, L) * 8,
        bwd_tmp=rng.integers(0, 3, L) * 8,
        shared=shared,
        held=rng.integers(0, 4, L) * 8 * rng.integers(0, 2, L),
    )


def test_dp_is_optimal_among_persistent_schedules_with_shared_values():
    """With values shared by several activations counted once (and bytes held until a stage's
    backward), the DP (in exact bytes: one byte per slot) finds the fastest persistent schedule, as the search over
    every persistent op
    sequence does, and is never slower than planning as if nothing were shared."""
    rng = np.random.default_rng(5)
    checked = faster = 0
    for trial in range(24):
        costs = _shared_chain(rng)
        lo, hi = jr.min_budget(costs, slots=4000), jr.store_all_peak(costs)
        for budget in sorted({lo, (2 * lo + hi) // 3, (lo + 2 * hi) // 3}):
            slots = max(budget - int(costs.x[0]), 1)
            opt = jr.solve(costs, budget, slots=slots)
            assert jr.simulate(costs, opt.ops).peak == opt.peak <= budget
            want = exhaustive_best_time(costs, budget, persistent=True)
            assert math.isclose(opt.time, want), (trial, budget, opt.time, want)
            try:
                blind = jr.solve(costs.without_shared(), budget, slots=slots).time
            except jr.InfeasibleBudget:
                blind = math.inf
            assert opt.time <= blind + 1e-9
            faster += opt.time < blind - 1e-9
            checked += 1
    print(f"\n{checked} budgets, sharing-aware DP faster on {faster}")
    assert checked >= 70 and faster >= 8, (checked, faster)


def test_persistent_search_matches_the_dp_without_shared_values():
    """The persistent search is the DP's class: on chains without shared values (the jitted
    table), with bytes held until a stage's backward on half of them and output bytes the
    backwards do not read on a third, they agree."""
    rng = np.random.default_rng(7)
    for trial in range(30):
        L = int(rng.integers(1, 5))
        costs = jr.ChainCosts(
            x=rng.integers(0, 12, L + 1) * 8,
            xbar=rng.integers(1, 30, L) * 8,
            fwd=rng.integers(1, 5, L).astype(float),
            bwd=rng.integers(1, 8, L).astype(float),
            fwd_tmp=rng.integers(0, 3, L) * 8,
            bwd_tmp=rng.integers(0, 3, L) * 8,
            held=rng.integers(0, 6, L) * 8 * (trial % 2),
        )
        if trial % 3 == 0:  # output bytes the backwards do not read
            costs = dataclasses.replace(costs, unread=np.minimum(costs.x[1:], costs.xbar) * rng.integers(0, 2, L))
        lo, hi = jr.min_budget(costs, slots=4000), jr.store_all_peak(costs)
        for budget in sorted({lo, (lo + hi) // 2, hi}):
            opt = jr.solve(costs, budget, slots=max(budget - int(costs.x[0]), 1))
            assert math.isclose(opt.time, exhaustive_best_time(costs, budget, persistent=True)), (trial, budget)


def test_min_budget_is_exact_with_shared_values_and_held_bytes():
    """``min_budget`` is the least budget ``solve`` takes, and the error below it names it."""
    rng = np.random.default_rng(1)
    for trial in range(30):
        costs = _shared_chain(rng)
        for slots in (500, 50, 3):
            least = jr.min_budget(costs, slots=slots)
            assert jr.solve(costs, least, slots=slots).peak <= least
            try:
                jr.solve(costs, least - 1, slots=slots)
            except jr.InfeasibleBudget as e:
                assert e.min_budget == least, (trial, slots)
            else:
                raise AssertionError(f"chain {trial}, {slots} slots: solved below min_budget")
