"""Solvers: from chain costs and a budget to a schedule. ``registry`` names the algorithms;
``optimal`` is the dynamic program, ``baselines`` the hand-written strategies, ``periodic`` the
loop schedules of ``Repeat`` layers, ``regular`` the reordering that groups alike units."""

from jaxremat.solvers.registry import (
    ALGORITHMS,
    ALIASES,
    OFFLOAD_ALGORITHMS,
    Algorithm,
    canonical,
    min_budget,
    pareto,
    solve,
)

__all__ = ["ALGORITHMS", "ALIASES", "OFFLOAD_ALGORITHMS", "Algorithm", "canonical", "min_budget", "pareto", "solve"]
