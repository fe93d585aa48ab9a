"""``solve``: from chain costs and a memory budget to a schedule; ``pareto``: the time-memory front."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from jaxremat.costs import ChainCosts
from jaxremat.schedule import InfeasibleBudget, Schedule
from jaxremat.solvers import baselines
from jaxremat.solvers.optimal import optimal_min_budget, solve_optimal
from jaxremat.units import parse_budget

ALIASES = {"rotor": "optimal"}
ALGORITHMS = ("optimal", "revolve", "sqrt", "every_stage", "store_all", "recompute_all")

Budget = int | float | str | None


def _check(costs: ChainCosts, algorithm: str, slots: int) -> str:
    if not isinstance(costs, ChainCosts):
        raise TypeError(f"expected ChainCosts, got {type(costs).__name__}; build one with jaxremat.ChainCosts(...)")
    name = ALIASES.get(algorithm, algorithm)
    if name not in ALGORITHMS:
        known = ", ".join(repr(a) for a in ALGORITHMS + tuple(ALIASES))
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {known}")
    if isinstance(slots, bool) or not isinstance(slots, (int, np.integer)) or slots < 1:
        raise ValueError(f"slots must be an int >= 1 (500 by default), got {slots!r}")
    return name


def store_all_peak(costs: ChainCosts) -> int:
    """Peak bytes of plain autodiff (every stage stored whole)."""
    return Schedule.from_ops(costs, baselines.store_all(costs.length), budget=None, algorithm="store_all").peak


def budget_bytes(costs: ChainCosts, budget: Budget) -> int:
    """A budget in bytes: ``None`` means the store-all peak, ``"40%"`` a share of it."""
    if budget is None:
        return store_all_peak(costs)
    if isinstance(budget, str) and budget.strip().endswith("%"):
        return parse_budget(budget, store_all_peak(costs))
    return parse_budget(budget)


def _fixed(name: str) -> Callable[[ChainCosts, int, int], Schedule]:
    def run(costs: ChainCosts, budget: int, slots: int) -> Schedule:
        sched = Schedule.from_ops(costs, baselines.FIXED[name](costs.length), budget=budget, algorithm=name)
        if sched.peak > budget:
            raise InfeasibleBudget(name, budget, sched.peak)
        return sched

    return run


def _revolve_schedule(costs: ChainCosts, snapshots: int, budget: int | None) -> Schedule:
    return Schedule.from_ops(
        costs, baselines.revolve(costs.length, snapshots), budget=budget, algorithm="revolve",
        note=f"{snapshots} snapshot(s)",
    )


def _revolve(costs: ChainCosts, budget: int, slots: int) -> Schedule:
    floor = _revolve_schedule(costs, 0, budget)
    if floor.peak > budget:
        raise InfeasibleBudget("revolve", budget, floor.peak)
    biggest = int(costs.x[1:].max())
    L = costs.length
    snaps = L if biggest == 0 else min(L, (budget - floor.peak) // biggest)
    while snaps > 0:
        sched = _revolve_schedule(costs, snaps, budget)
        if sched.peak <= budget:
            return sched
        snaps -= 1
    return floor


_SOLVERS: dict[str, Callable[[ChainCosts, int, int], Schedule]] = {
    "optimal": lambda costs, budget, slots: solve_optimal(costs, budget, slots),
    "revolve": _revolve,
    **{name: _fixed(name) for name in baselines.FIXED},
}


def solve(costs: ChainCosts, budget: Budget, *, algorithm: str = "optimal", slots: int = 500) -> Schedule:
    """The schedule of ``algorithm`` for ``costs`` within ``budget``.

    Args:
      costs: the chain's :class:`~jaxremat.ChainCosts`.
      budget: bytes (int), a string with a unit (``"512MiB"``, ``"2GB"``), a share of the
        store-all peak (``"40%"``), or ``None`` for the store-all peak.
      algorithm: ``"optimal"`` (alias ``"rotor"``), ``"revolve"``, ``"sqrt"``,
        ``"every_stage"``, ``"store_all"`` or ``"recompute_all"``.
      slots: memory discretisation of the DP (``"optimal"`` only).

    Returns:
      A :class:`~jaxremat.Schedule` whose simulated peak is within the budget.

    Raises:
      InfeasibleBudget: no schedule of this algorithm fits; ``.min_budget`` says what would.
    """
    name = _check(costs, algorithm, slots)
    b = budget_bytes(costs, budget)
    sched = _SOLVERS[name](costs, b, int(slots))
    if name != algorithm:
        sched = Schedule(sched.ops, sched.time, sched.peak, sched.budget, algorithm, sched.costs, sched.note)
    return sched


def min_budget(costs: ChainCosts, *, algorithm: str = "optimal", slots: int = 500) -> int:
    """Smallest budget in bytes for which ``solve(costs, budget, algorithm=...)`` succeeds."""
    name = _check(costs, algorithm, slots)
    if name == "optimal":
        return optimal_min_budget(costs, int(slots))
    if name == "revolve":
        return _revolve_schedule(costs, 0, None).peak
    return Schedule.from_ops(costs, baselines.FIXED[name](costs.length), budget=None, algorithm=name).peak


def pareto(
    costs: ChainCosts,
    algorithm: str = "optimal",
    budgets: Sequence[Budget] | None = None,
    *,
    slots: int = 500,
    points: int = 20,
) -> list[Schedule]:
    """The time-memory front of ``algorithm``: one schedule per feasible budget, by budget.

    Without ``budgets``, sweeps ``points`` budgets evenly from the algorithm's minimum budget to
    the store-all peak. Infeasible budgets are left out.
    """
    _check(costs, algorithm, slots)
    if budgets is None:
        lo = min_budget(costs, algorithm=algorithm, slots=slots)
        hi = max(store_all_peak(costs), lo)
        sweep = sorted({int(b) for b in np.linspace(lo, hi, points)})
    else:
        sweep = sorted(budget_bytes(costs, b) for b in budgets)
    front = []
    for b in sweep:
        try:
            front.append(solve(costs, b, algorithm=algorithm, slots=slots))
        except InfeasibleBudget:
            continue
    return front


__all__ = ["ALGORITHMS", "budget_bytes", "min_budget", "pareto", "solve", "store_all_peak"]
