"""On tiny chains, compare the DP with a shortest-path search over every valid op sequence
(store options and FB included)."""

from __future__ import annotations

import heapq
import itertools
import math

import numpy as np

import jaxremat as jr
from jaxremat.core.simulator import FORWARD_KINDS, Machine


def exhaustive_best_time(costs: jr.ChainCosts, budget: int) -> float:
    """Least time of any valid schedule within ``budget`` (Dijkstra over simulator states)."""
    L = costs.length
    start = Machine(costs)
    x0 = int(costs.x[0])
    seen: dict[tuple, float] = {}
    tie = itertools.count()
    heap = [(0.0, next(tie), start)]
    while heap:
        t, _, m = heapq.heappop(heap)
        if m.done:
            return t
        key = m.key()
        if key in seen:
            continue
        seen[key] = t
        ops = [(k, i) for i in range(max(m.next_b, -1) + 1) for k in FORWARD_KINDS]
        ops += [("Fall", i, k) for i in range(max(m.next_b, -1) + 1) for k in range(1, costs.option_count(i))]
        ops += [("Loss", L), ("B", m.next_b), ("FB", m.next_b)] if m.next_b >= 0 else []
        for op in ops:
            nxt = m.copy()
            try:
                peak = nxt.step(op)
            except ValueError:
                continue
            if x0 + peak <= budget and nxt.key() not in seen:
                heapq.heappush(heap, (nxt.time, next(tie), nxt))
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

