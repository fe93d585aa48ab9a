"""Plans for chains with ``Repeat`` layers: the fastest schedule that runs each as one loop."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any


from jaxremat.api.calibrate import LOOP_OPTIMISM, calibrated_pick, step_temp
from jaxremat.core.budgets import Budget, describe_budget, parse_budget
from jaxremat.core.costs import ChainCosts
from jaxremat.core.loops import MAX_PERIOD, LoopGroup, copy_costs, loop_store_all_peak, stacked_gradients
from jaxremat.core.schedule import InfeasibleBudget, Schedule
from jaxremat.core.simulator import simulate
from jaxremat.core.units import format_bytes
from jaxremat.model.chain import Chain
from jaxremat.model.identity import stage_identity
from jaxremat.model.trees import tree_bytes
from jaxremat.solvers import solve
from jaxremat.solvers.periodic import periodic_schedules, solve_periodic
from jaxremat.solvers.regular import regularise, stage_classes


def loop_groups(chain: Chain) -> list[LoopGroup]:
    return [LoopGroup(g.start, g.length) for g in chain.stacked]


def param_bytes(chain: Chain, variables: Any) -> list[int]:
    return [tree_bytes(v) for v in chain.stage_shapes(variables)]


def loop_budget_bytes(costs: ChainCosts, groups: list[LoopGroup], weights: list[int], budget: Budget) -> int:
    """``budget`` in bytes for a chain with Repeat layers: a share (``"40%"``) or ``None`` is of
    the store-all peak with each Repeat run as one loop of stored copies, stacked gradient
    included (:func:`~jaxremat.core.loops.loop_store_all_peak`), the memory plain autodiff of
    the model as written uses."""
    return parse_budget(budget, loop_store_all_peak(costs, groups, weights))


def describe_loop_budget(chain: Chain, variables: Any, costs: ChainCosts, budget: Budget) -> str:
    """What ``budget`` was asked as on a chain with Repeat layers (``Schedule.asked``): a share
    names :func:`loop_budget_bytes`'s reference."""
    peak = loop_store_all_peak(costs, loop_groups(chain), param_bytes(chain, variables))
    return describe_budget(budget, peak, of="the store-all peak with each Repeat run as one loop")


def with_stacked_gradients(
    chain: Chain, variables: Any, costs: ChainCosts, budget: Budget
) -> tuple[ChainCosts, Budget]:
    """For an algorithm other than ``"optimal"`` on a chain with Repeat layers: ``costs`` with
    each layer's stacked gradient held (:func:`~jaxremat.core.loops.stacked_gradients`), and
    ``budget`` in bytes, a share taken of :func:`loop_budget_bytes`'s reference."""
    groups, weights = loop_groups(chain), param_bytes(chain, variables)
    return stacked_gradients(costs, groups, weights), loop_budget_bytes(costs, groups, weights, budget)


def loop_schedule(
    chain: Chain, variables: Any, costs: ChainCosts, budget: Budget, slots: int, max_period: int
) -> Schedule:
    """The fastest schedule that runs each Repeat layer as one loop over its stacked variables,
    with the loop's transients counted. When none fits, the optimal schedule with alike units
    grouped and the copies of the sliced parameters counted (the executor then warns);
    ``InfeasibleBudget`` when that does not fit either."""
    groups, weights = loop_groups(chain), param_bytes(chain, variables)
    target = loop_budget_bytes(costs, groups, weights, budget)
    found = solve_periodic(costs, target, groups, max_period=max_period, param_bytes=weights)
    if found is not None:
        return found
    try:
        best = solve(copy_costs(costs, groups, weights), target, slots=slots)
    except InfeasibleBudget as e:
        least_loop = least_loop_peak(costs, groups, weights)
        raise InfeasibleBudget(
            "optimal",
            target,
            min(least_loop, e.min_budget),
            note=f"a Repeat layer or scanned layer stack runs as one loop from {format_bytes(least_loop)}; below "
            "that its stacked parameters would be sliced, which copies them",
        ) from None
    ids = [stage_identity(st, v) for st, v in zip(chain.stages, chain.stage_shapes(variables))]
    return regularise(best, list(zip(ids, stage_classes(best))))


def calibrated_loop_schedule(
    chain: Chain, variables: Any, sample: Any, costs: ChainCosts, budget: Budget, max_period: int, policies: Any = None
) -> Schedule | None:
    """The fastest loop schedule whose step, compiled by XLA, fits the budget (fastest candidates
    first, skipping those whose plain prediction is above the budget by more than XLA was seen to
    save; a few compilations); ``None`` when none tried fits."""
    groups, weights = loop_groups(chain), param_bytes(chain, variables)
    candidates = loop_schedules(costs, groups, weights, max_period)
    measure = functools.partial(step_temp, chain, variables, sample, policies=policies)
    found = calibrated_pick(
        candidates,
        loop_budget_bytes(costs, groups, weights, budget),
        measure,
        optimistic=lambda s: int(LOOP_OPTIMISM * simulate(costs, s.ops)[0]),
    )
    return None if found is None else found.schedule


def loop_candidates(chain: Chain, variables: Any, costs: ChainCosts, max_period: int) -> list[Schedule]:
    """The schedules that run each Repeat layer (or layer stack) as one loop, fastest first."""
    return loop_schedules(costs, loop_groups(chain), param_bytes(chain, variables), max_period)


def least_loop_plan(chain: Chain, variables: Any, costs: ChainCosts, budget: Budget, max_period: int) -> Schedule:
    """The loop schedule of least predicted peak, asked for ``budget`` (below that peak): for
    verification to compile where the prediction refuses."""
    least = min(loop_candidates(chain, variables, costs, max_period), key=lambda s: s.peak)
    target = loop_budget_bytes(costs, loop_groups(chain), param_bytes(chain, variables), budget)
    return dataclasses.replace(least, budget=target, asked=describe_loop_budget(chain, variables, costs, budget))


def loop_schedules(
    costs: ChainCosts, groups: list[LoopGroup], weights: list[int], max_period: int, steps: int = 16
) -> list[Schedule]:
    """:func:`~jaxremat.solvers.periodic.periodic_schedules`, with shorter patterns and fewer
    selective loops when several Repeat layers make too many combinations."""
    for period, k in ((max_period, steps), (min(max_period, 2), 4), (1, 1)):
        try:
            return periodic_schedules(costs, groups, max_period=period, param_bytes=weights, selective_steps=k)
        except ValueError:  # too many combinations over several layers
            continue
    return periodic_schedules(costs, groups, max_period=1, param_bytes=weights, selective_steps=1, limit=10**9)


def least_loop_peak(costs: ChainCosts, groups: list[LoopGroup], weights: list[int]) -> int:
    """The lowest peak of a schedule that runs every Repeat layer as one loop."""
    return min(s.peak for s in loop_schedules(costs, groups, weights, MAX_PERIOD, steps=1))


__all__ = [
    "calibrated_loop_schedule",
    "least_loop_plan",
    "loop_candidates",
    "describe_loop_budget",
    "least_loop_peak",
    "loop_budget_bytes",
    "loop_schedule",
    "loop_schedules",
    "with_stacked_gradients",
]
