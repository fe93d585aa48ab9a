"""The least memory at the fastest time: of the schedules within :data:`LEAN_TIE` of the fastest
predicted time, the one that peaks lowest.

The DP spends the budget it is given wherever that saves any time: at 75% of a 12-block GPT's
store-all peak the fastest plan kept five blocks whole, 0.97 of the budget (165 MiB), to run 0.5%
fewer flops than every block under ``dots_saveable`` in 95.7 MiB. It ran 1.07x that strategy's
time on the CPU (2026-12-06; why was not checked: the CPU may pay for touching the larger temp
memory every step); and memory left free is room for XLA's heap packing, which verification
otherwise corrects by compiling the step again. Plans and verification rank alike
(:func:`preferred`): fewer flops (or less time) by more than the tie wins; within it, less memory
does.
"""

from __future__ import annotations

import dataclasses

from jaxremat.core.costs import ChainCosts
from jaxremat.core.schedule import InfeasibleBudget, Schedule
from jaxremat.solvers.registry import solve

#: Schedules whose predicted time (or compiled flops) is within this share of the fastest's tie
#: with it; of tied schedules, the one of least memory is kept.
LEAN_TIE = 0.01


def preferred(cost: float, peak: int, other_cost: float, other_peak: int, tie: float = LEAN_TIE) -> bool:
    """Whether a schedule of ``cost`` (time or flops) and ``peak`` bytes is to be kept over one
    of ``other_cost`` and ``other_peak``: cheaper by more than ``tie``, or tied and leaner."""
    if cost < other_cost * (1 - tie):
        return True
    return cost <= other_cost * (1 + tie) and peak < other_peak


def leanest(costs: ChainCosts, fastest: Schedule, *, algorithm: str = "optimal", slots: int = 500,
            tie: float = LEAN_TIE) -> Schedule:
    """The schedule of least peak whose predicted time is within ``tie`` of ``fastest``'s, found
    by bisection on the budget the solver is given (below ``fastest``'s peak, to the DP's
    resolution there); ``fastest`` itself where none peaks lower. Keeps ``fastest``'s budget."""
    limit = fastest.time * (1 + tie)
    lo, hi, best = 0, fastest.peak, fastest
    resolution = max(1, fastest.peak // max(slots, 1))
    while hi - lo > resolution:
        mid = (lo + hi) // 2
        try:
            found = solve(costs, mid, algorithm=algorithm, slots=slots)
        except InfeasibleBudget:
            lo = mid
            continue
        if found.time <= limit:
            hi = min(mid, found.peak)
            if found.peak < best.peak:
                best = found
        else:
            lo = mid
    if best is fastest:
        return fastest
    slower = best.time / fastest.time - 1 if fastest.time > 0 else 0.0
    note = (
        f"the least memory within {tie:.0%} of the fastest: {format(1 - best.peak / fastest.peak, '.0%')} less, "
        f"{slower:.1%} slower on the profile"
    )
    return dataclasses.replace(best, budget=fastest.budget, asked=fastest.asked, note=note)


__all__ = ["LEAN_TIE", "leanest", "preferred"]
