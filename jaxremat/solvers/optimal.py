"""``"optimal"``: the persistent dynamic program (Rotor's, with the corrected store-all check)."""

from __future__ import annotations

import numpy as np

from jaxremat.core.costs import ChainCosts
from jaxremat.core.schedule import InfeasibleBudget, Schedule
from jaxremat.core.ops import FORWARD_KINDS, Op
from jaxremat.solvers import baselines
from jaxremat.solvers._discretise import SlotChain, discretise, extend, least_memory
from jaxremat.solvers._dp_jax import table
from jaxremat.solvers._rebuild import rebuild_ops


def dp_ops(costs: ChainCosts, budget: int, slots: int) -> list[Op] | None:
    """The DP's op list for ``budget`` with ``slots`` slots, or ``None`` if nothing fits in slots."""
    c = discretise(costs, budget, slots)
    A, args = table(c)
    if not np.isfinite(A[0, c.L, slots]):
        return None
    return rebuild_ops(A, args)


def dp_min_budget(costs: ChainCosts, slots: int) -> int | None:
    """Smallest budget (bytes) for which the DP, with sizes rounded up to slots, finds a schedule.

    Feasibility grows with the budget (every rounded size shrinks or stays), so bisect between
    the exact least memory of persistent schedules and the first budget found feasible. Returns
    ``None`` when no budget is enough: with very few slots, every positive size takes at least
    one slot, and the sums may never fit.
    """
    x0 = int(costs.x[0])
    exact = least_memory(extend(costs))
    if exact == 0:
        return x0
    b = extend(costs)
    ones = lambda v: np.minimum(v, 1)  # noqa: E731  (each positive size rounds to 1 slot at best)
    limit = SlotChain(b.L, slots, ones(b.x), ones(b.xbar), ones(b.fwd_tmp), ones(b.bwd_tmp), b.fwd, b.bwd)
    if least_memory(limit) > slots:
        return None
    feasible = lambda budget: least_memory(discretise(costs, budget, slots)) <= slots  # noqa: E731
    lo = x0 + exact - 1  # infeasible: below the exact need even without rounding
    hi = x0 + exact
    step = max(exact // max(slots, 1), 1)
    while not feasible(hi):
        lo, hi = hi, hi + step
        step *= 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if feasible(mid):
            hi = mid
        else:
            lo = mid
    return hi


def op_time(costs: ChainCosts, ops: list[Op]) -> float:
    """The time of ``ops`` without replaying them (valid or not)."""
    fwd = np.array([i for k, i in ops if k in FORWARD_KINDS], dtype=np.int64)
    n = np.bincount(fwd, minlength=costs.length)
    return float(n @ costs.fwd + costs.bwd.sum())


def candidates(costs: ChainCosts) -> dict[str, list[Op]]:
    """Fixed baseline schedules (all persistent) that ``optimal`` also considers."""
    L = costs.length
    return {name: make(L) for name, make in baselines.FIXED.items()}


def solve_optimal(costs: ChainCosts, budget: int, slots: int, algorithm: str = "optimal") -> Schedule:
    """The fastest persistent schedule the DP finds within ``budget``.

    Rounding sizes up to slots can make the DP miss a schedule that fits in exact bytes; the
    fixed baselines (all persistent) are replayed in bytes too and the fastest one that fits is
    kept, so ``optimal`` is never slower than a baseline at the same budget.
    """
    best: Schedule | None = None
    ops = dp_ops(costs, budget, slots)
    if ops is not None:
        best = Schedule.from_ops(costs, ops, budget=budget, algorithm=algorithm)
        if best.peak > budget:
            raise AssertionError(f"DP schedule peaks at {best.peak} bytes over the budget {budget}")
    for name, cand_ops in candidates(costs).items():
        if best is not None and op_time(costs, cand_ops) >= best.time:
            continue  # cheap: no replay for a candidate that cannot win
        sched = Schedule.from_ops(
            costs, cand_ops, budget=budget, algorithm=algorithm, note=f"the {name} schedule (DP in slots was not faster)"
        )
        if sched.peak <= budget and (best is None or sched.time < best.time):
            best = sched
    if best is None:
        raise InfeasibleBudget(algorithm, budget, optimal_min_budget(costs, slots), note=f"with {slots} slots")
    return best


def optimal_min_budget(costs: ChainCosts, slots: int) -> int:
    """Smallest budget for which :func:`solve_optimal` returns a schedule."""
    peaks = [Schedule.from_ops(costs, o, budget=None, algorithm=n).peak for n, o in candidates(costs).items()]
    dp = dp_min_budget(costs, slots)
    return min(peaks if dp is None else peaks + [dp])
