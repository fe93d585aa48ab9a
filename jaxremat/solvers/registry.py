"""The algorithms, by name: ``solve`` (chain costs and a budget to a schedule), ``min_budget``
and ``pareto`` (the time-memory front). The one registry of names and aliases."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from jaxremat.core.budgets import Budget, describe_budget, parse_budget, store_all_peak
from jaxremat.core.costs import ChainCosts
from jaxremat.core.schedule import InfeasibleBudget, Schedule
from jaxremat.core.transfers import Bandwidth, BandwidthLike
from jaxremat.solvers import baselines
from jaxremat.solvers.offload import offload_min_budget, solve_offload
from jaxremat.solvers.optimal import optimal_min_budget, solve_optimal


@dataclass(frozen=True)
class Algorithm:
    """A named way of making a schedule: ``solve(costs, budget_bytes, slots)`` (raises
    :class:`~jaxremat.InfeasibleBudget` when nothing fits) and ``min_budget(costs, slots)``.
    An algorithm that ``offloads`` takes a :class:`~jaxremat.core.transfers.Bandwidth` as a last argument of both."""

    name: str
    solve: Callable[..., Schedule]
    min_budget: Callable[..., int]
    description: str
    offloads: bool = False


def _fixed(name: str, description: str) -> Algorithm:
    make = baselines.FIXED[name]

    def schedule(costs: ChainCosts, budget: int | None) -> Schedule:
        return Schedule.from_ops(costs, make(costs.length), budget=budget, algorithm=name)

    def run(costs: ChainCosts, budget: int, slots: int) -> Schedule:
        sched = schedule(costs, budget)
        if sched.peak > budget:
            raise InfeasibleBudget(name, budget, sched.peak)
        return sched

    return Algorithm(name, run, lambda costs, slots: schedule(costs, None).peak, description)


def _revolve_schedule(costs: ChainCosts, snapshots: int, budget: int | None) -> Schedule:
    return Schedule.from_ops(
        costs,
        baselines.revolve(costs.length, snapshots),
        budget=budget,
        algorithm="revolve",
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


REGISTRY: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm(
            "optimal",
            solve_optimal,
            optimal_min_budget,
            "the persistent dynamic program (Rotor's, store-all check corrected); never slower than a baseline",
        ),
        Algorithm(
            "revolve",
            _revolve,
            lambda costs, slots: _revolve_schedule(costs, 0, None).peak,
            "binomial checkpointing with as many snapshots as fit",
        ),
        _fixed("sqrt", "about sqrt(L) evenly spaced checkpoints"),
        _fixed("every_stage", "jax.checkpoint around every stage"),
        _fixed("store_all", "plain autodiff"),
        _fixed("recompute_all", "keep only the input; quadratic time, least memory"),
        Algorithm(
            "optimal_offload",
            solve_offload,
            offload_min_budget,
            "remat and host offloading together (POFO-style); never slower than 'optimal'",
            offloads=True,
        ),
    )
}
ALIASES = {"rotor": "optimal"}
#: The names of the algorithms that only rematerialise (aliases in :data:`ALIASES`).
ALGORITHMS = tuple(name for name, a in REGISTRY.items() if not a.offloads)
#: The names of the algorithms that also offload to host memory (they take ``bandwidth=``).
OFFLOAD_ALGORITHMS = tuple(name for name, a in REGISTRY.items() if a.offloads)


def canonical(algorithm: str) -> str:
    """The registered name of ``algorithm`` (an alias resolved); ``ValueError`` naming the
    choices when it is unknown."""
    name = ALIASES.get(algorithm, algorithm)
    if name not in REGISTRY:
        known = ", ".join(repr(a) for a in tuple(REGISTRY) + tuple(ALIASES))
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {known}")
    return name


def _check(
    costs: ChainCosts, algorithm: str, slots: int, bandwidth: BandwidthLike | None = None
) -> tuple[Algorithm, tuple]:
    """The algorithm and the extra arguments it takes (a :class:`Bandwidth` when it offloads)."""
    if not isinstance(costs, ChainCosts):
        raise TypeError(f"expected ChainCosts, got {type(costs).__name__}; build one with jaxremat.ChainCosts(...)")
    found = REGISTRY[canonical(algorithm)]
    if isinstance(slots, bool) or not isinstance(slots, (int, np.integer)) or slots < 1:
        raise ValueError(f"slots must be an int >= 1 (500 by default), got {slots!r}")
    if not found.offloads:
        if bandwidth is not None:
            offloading = ", ".join(repr(a.name) for a in REGISTRY.values() if a.offloads)
            raise ValueError(
                f"bandwidth is for an algorithm that offloads to host memory ({offloading}); "
                f"{found.name!r} moves nothing, so leave bandwidth out"
            )
        return found, ()
    if bandwidth is None:
        raise ValueError(
            f"algorithm {found.name!r} needs bandwidth=: bytes per time unit of the device-host links "
            "(one number, or (to_host, to_device)), in the time unit of the costs"
        )
    return found, (Bandwidth.of(bandwidth),)


def solve(
    costs: ChainCosts,
    budget: Budget,
    *,
    algorithm: str = "optimal",
    slots: int = 500,
    bandwidth: BandwidthLike | None = None,
) -> Schedule:
    """The schedule of ``algorithm`` for ``costs`` within ``budget``.

    Args:
      costs: the chain's :class:`~jaxremat.ChainCosts`.
      budget: bytes (int), a string with a unit (``"512MiB"``, ``"2GB"``), a share of the
        store-all peak (``"40%"``), or ``None`` for the store-all peak.
      algorithm: ``"optimal"`` (alias ``"rotor"``), ``"revolve"``, ``"sqrt"``,
        ``"every_stage"``, ``"store_all"``, ``"recompute_all"``, or ``"optimal_offload"``
        (remat and host offloading together).
      slots: memory discretisation of the DP (``"optimal"`` and ``"optimal_offload"``).
      bandwidth: for ``"optimal_offload"`` only: bytes per time unit of the device-to-host and
        host-to-device links (one number for both, or a pair), in the costs' time unit.

    Returns:
      A :class:`~jaxremat.Schedule` whose simulated peak is within the budget.

    Raises:
      InfeasibleBudget: no schedule of this algorithm fits; ``.min_budget`` says what would.
    """
    found, extra = _check(costs, algorithm, slots, bandwidth)
    sched = found.solve(costs, parse_budget(budget, costs), int(slots), *extra)
    if sched.algorithm != algorithm:  # asked by an alias: say so
        sched = sched.with_algorithm(algorithm)
    return dataclasses.replace(sched, asked=describe_budget(budget, costs))


def min_budget(
    costs: ChainCosts, *, algorithm: str = "optimal", slots: int = 500, bandwidth: BandwidthLike | None = None
) -> int:
    """Smallest budget in bytes for which ``solve(costs, budget, algorithm=...)`` succeeds."""
    found, extra = _check(costs, algorithm, slots, bandwidth)
    return found.min_budget(costs, int(slots), *extra)


def pareto(
    costs: ChainCosts,
    *,
    algorithm: str = "optimal",
    budgets: Sequence[Budget] | None = None,
    slots: int = 500,
    points: int = 20,
    bandwidth: BandwidthLike | None = None,
) -> list[Schedule]:
    """The time-memory front of ``algorithm``: one schedule per feasible budget, by budget.

    Without ``budgets``, sweeps ``points`` budgets evenly from the algorithm's minimum budget to
    the store-all peak. Infeasible budgets are left out.
    """
    _check(costs, algorithm, slots, bandwidth)
    if budgets is None:
        lo = min_budget(costs, algorithm=algorithm, slots=slots, bandwidth=bandwidth)
        hi = max(store_all_peak(costs), lo)
        sweep = sorted({int(b) for b in np.linspace(lo, hi, points)})
    else:
        sweep = sorted(parse_budget(b, costs) for b in budgets)
    front = []
    for b in sweep:
        try:
            front.append(solve(costs, b, algorithm=algorithm, slots=slots, bandwidth=bandwidth))
        except InfeasibleBudget:
            continue
    return front


__all__ = [
    "ALGORITHMS",
    "ALIASES",
    "OFFLOAD_ALGORITHMS",
    "REGISTRY",
    "Algorithm",
    "canonical",
    "min_budget",
    "pareto",
    "solve",
]
