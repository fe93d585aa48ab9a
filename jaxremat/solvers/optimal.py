"""``"optimal"``: the persistent dynamic program (Rotor's, with the corrected store-all check)."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxremat.core.costs import ChainCosts
from jaxremat.core.schedule import InfeasibleBudget, Schedule
from jaxremat.core.simulator import predicted_flops
from jaxremat.core.ops import FORWARD_KINDS, Op, OpKind, store_all_ops
from jaxremat.solvers import baselines
from jaxremat.solvers._discretise import ABSENT, bisect_least, discretise, extend, least_memory
from jaxremat.solvers._dp_jax import table
from jaxremat.solvers._dp_numpy import reference_ops, reference_table
from jaxremat.solvers._rebuild import rebuild_ops


def dp_ops(costs: ChainCosts, budget: int, slots: int) -> list[Op] | None:
    """The DP's op list for ``budget`` with ``slots`` slots, or ``None`` if nothing fits in slots.

    Chains with shared values take the numpy DP (its checkpoint shift depends on the segment's
    start; see :mod:`jaxremat.solvers._dp_numpy`)."""
    c = discretise(costs, budget, slots)
    if c.ov is not None:
        return reference_ops(c, reference_table(c))
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
    # each positive size rounds to 1 slot at best; an option a stage lacks never fits
    ones = lambda v: np.where(v >= ABSENT, slots + 1, np.minimum(v, 1))  # noqa: E731
    # (what a_q adds beyond its overlap, x[q] - ov[p, q], at best 1 slot too)
    ov = None if b.ov is None else np.maximum(ones(b.x)[None, :] - ones(b.x[None, :] - b.ov), 0)
    limit = dataclasses.replace(
        b,
        slots=slots,
        x=ones(b.x),
        xbar=ones(b.xbar),
        fwd_tmp=ones(b.fwd_tmp),
        bwd_tmp=ones(b.bwd_tmp),
        fb_tmp=ones(b.fb_tmp),
        ov=ov,
        P=None if b.P is None else ones(b.P),
    )
    if least_memory(limit) > slots:
        return None
    feasible = lambda budget: least_memory(discretise(costs, budget, slots)) <= slots  # noqa: E731
    lo = x0 + exact - 1  # infeasible: below the exact need even without rounding
    hi = x0 + exact
    step = max(exact // max(slots, 1), 1)
    while not feasible(hi):
        lo, hi = hi, hi + step
        step *= 2
    return bisect_least(lo, hi, feasible)


def op_time(costs: ChainCosts, ops: list[Op]) -> float:
    """The time of ``ops`` without replaying them (valid or not)."""
    fwd = np.array([op[1] for op in ops if op[0] in FORWARD_KINDS], dtype=np.int64)
    total = float(np.bincount(fwd, minlength=costs.length) @ costs.fwd)
    option: dict[int, int] = {}
    for op in ops:
        if op[0] == OpKind.FALL:
            option[op[1]] = op[2] if len(op) > 2 else 0
        elif op[0] == OpKind.B:
            total += costs.option_table[op[1]][option.get(op[1], 0)][1]
        elif op[0] == OpKind.FB:
            total += float(costs.fb[op[1]])
    return total


def candidates(costs: ChainCosts) -> dict[str, list[Op]]:
    """Fixed schedules (all persistent) that ``optimal`` also considers: the baselines, and for
    each checkpoint policy of the stages' store options, every stage stored under it (what
    ``jax.checkpoint(block, policy=...)`` around every block does).

    A stage without that policy's option had it dropped by the profiler as no better than
    another of its options, which then keeps no more bytes: there the candidate takes the option
    that keeps the fewest (fastest among equals). An MLP-Mixer's patch embedding under
    ``dots_with_no_batch_dims_saveable`` keeps its matmul's output, as its ``dots_saveable``
    option does (0.5 MiB), not everything (0.69 MiB, as when the candidate stored it whole)."""
    L = costs.length
    out = {name: make(L) for name, make in baselines.FIXED.items()}
    names = dict.fromkeys(o.name for per in costs.options or () for o in per)

    def option(i: int, name: str) -> int:
        ks = range(costs.option_count(i))
        named = [k for k in ks if k and costs.option(i, k).name == name]
        return named[0] if named else min(ks, key=lambda k: (costs.option(i, k).xbar, costs.option(i, k).bwd))

    for name in names:
        out[f"every stage under {name}"] = store_all_ops(L, [option(i, name) for i in range(L)])
    return out


#: Predicted times within this share of the fastest are ties, broken by fewer flops (profiled
#: costs only) where the flops are fewer by at least ``FLOPS_GAIN``: see :func:`solve_optimal`.
FLOPS_TIE = 0.02
FLOPS_GAIN = 0.005


def solve_optimal(costs: ChainCosts, budget: int, slots: int, algorithm: str = "optimal") -> Schedule:
    """The fastest persistent schedule the DP finds within ``budget``.

    Rounding sizes up to slots can make the DP miss a schedule that fits in exact bytes; the
    fixed baselines (all persistent) are replayed in bytes too and the fastest one that fits is
    kept, so ``optimal`` is never slower than a baseline at the same budget.

    With profiled flops, near ties go to fewer flops: among the DP's schedule and the baselines
    that fit, the one of fewest flops is taken when its predicted time is within
    :data:`FLOPS_TIE` of the fastest and it runs :data:`FLOPS_GAIN` fewer flops at least. A
    baseline it is slower than then runs more flops. Measured times carry noise that flops do not:
    on a 12-block GPT at the memory of ``dots_saveable`` around every block, the DP preferred a
    plan 1.2% faster on the profile that ran 1.03x the flops, where every block under the policy
    (a baseline) runs 1.01x; a profile taken again can rank such plans the other way.
    """
    best: Schedule | None = None
    ops = dp_ops(costs, budget, slots)
    if ops is not None:
        best = Schedule.from_ops(costs, ops, budget=budget, algorithm=algorithm)
        if best.peak > budget:
            raise AssertionError(f"DP schedule peaks at {best.peak} bytes over the budget {budget}")
    # the baselines that fit, within the tie of the fastest (only costs with flops break ties)
    tie = FLOPS_TIE if costs.fwd_flops is not None and costs.bwd_flops is not None else 0.0
    fitting: dict[str, Schedule] = {}
    for name, cand_ops in candidates(costs).items():
        if best is not None and op_time(costs, cand_ops) >= best.time * (1 + tie):
            continue  # cheap: no replay for a candidate that can neither win nor tie
        sched = Schedule.from_ops(
            costs,
            cand_ops,
            budget=budget,
            algorithm=algorithm,
            note=f"the {name} schedule (DP in slots was not faster)",
        )
        if sched.peak <= budget:
            fitting[name] = sched
            if best is None or sched.time < best.time:
                best = sched
    if best is None:
        raise InfeasibleBudget(algorithm, budget, optimal_min_budget(costs, slots), note=f"with {slots} slots")
    return _fewer_flops(costs, best, fitting)


def _fewer_flops(costs: ChainCosts, best: Schedule, fitting: dict[str, Schedule]) -> Schedule:
    """``best``, or the schedule of fewest flops among the baselines that fit (``fitting``, by
    name) where it ties with ``best`` (:data:`FLOPS_TIE`) and runs :data:`FLOPS_GAIN` fewer flops
    at least. (Running the DP a second time on the flops found such plans too, but doubled the
    solve time.)"""
    if costs.fwd_flops is None or costs.bwd_flops is None:
        return best
    flops = {n: predicted_flops(costs, s.ops) for n, s in fitting.items() if s.time <= best.time * (1 + FLOPS_TIE)}
    if not flops:
        return best
    name = min(flops, key=lambda n: (flops[n], fitting[n].time))
    fewest = fitting[name]
    ratio = flops[name] / predicted_flops(costs, best.ops)
    if ratio > 1 - FLOPS_GAIN:
        return best
    slower = fewest.time / best.time - 1 if best.time > 0 else 0.0
    return Schedule.from_ops(
        costs,
        fewest.ops,
        budget=fewest.budget,
        algorithm=fewest.algorithm,
        note=f"the {name} schedule: {1 - ratio:.1%} fewer flops than the fastest, {slower:.1%} slower on the profile",
    )


def optimal_min_budget(costs: ChainCosts, slots: int) -> int:
    """Smallest budget for which :func:`solve_optimal` returns a schedule."""
    peaks = [Schedule.from_ops(costs, o, budget=None, algorithm=n).peak for n, o in candidates(costs).items()]
    dp = dp_min_budget(costs, slots)
    return min(peaks if dp is None else peaks + [dp])
