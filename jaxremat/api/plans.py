"""A plan: the costs, the schedule and what they were made for, saved and loaded as JSON."""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from jaxremat.chain import Chain, tree_bytes
from jaxremat.units import format_bytes
from jaxremat.costs import ChainCosts
from jaxremat.executor import execute
from jaxremat.profiler import profile
from jaxremat.schedule import InfeasibleBudget, Schedule
from jaxremat.solvers import budget_bytes, solve
from jaxremat.solvers.periodic import MAX_PERIOD, periodic_schedules, solve_periodic
from jaxremat.solvers.regular import regularise, stage_classes

FORMAT = "jaxremat-plan"
VERSION = 1


def signature(chain: Chain, variables: Any, sample: Any) -> str:
    """What a plan depends on: stage structure, variable shapes and dtypes, input shape and dtype."""
    leaves = lambda t: [(tuple(np.shape(x)), str(x.dtype)) for x in jax.tree.leaves(t)]  # noqa: E731
    parts = [
        [st.key or st.kind for st in chain.stages],
        [leaves(v) for v in chain.stage_shapes(variables)],
        leaves(sample),
    ]
    return json.dumps(parts, sort_keys=True)


@dataclass(frozen=True)
class Plan:
    """The schedule ``remat_chain`` runs, with the costs it was solved on."""

    schedule: Schedule
    signature: str

    @property
    def costs(self) -> ChainCosts:
        return self.schedule.costs

    @property
    def predicted_peak(self) -> int:
        """Predicted peak bytes of activations (``a_0`` included, parameters not)."""
        return self.schedule.peak

    @property
    def predicted_overhead(self) -> float:
        """Predicted step time over the store-all time."""
        return self.schedule.overhead

    def report(self) -> str:
        return self.schedule.summary()

    def check(self, chain: Chain, variables: Any, sample: Any) -> None:
        """``ValueError`` unless this plan was made for this chain, variables and input shape."""
        if signature(chain, variables, sample) != self.signature:
            raise ValueError(
                "this plan was made for another model or input shape (stage structure, variable "
                "shapes or input shape differ); make a new one with jaxremat.plan(...)"
            )

    def executor(self, chain: Chain, variables: Any, sample: Any) -> Callable[..., tuple[Any, Any]]:
        """:func:`~jaxremat.execute` of this plan, after checking it fits the model."""
        self.check(chain, variables, sample)
        return execute(chain, self.schedule)

    def to_json(self) -> dict:
        s = self.schedule
        return {
            "format": FORMAT,
            "version": VERSION,
            "signature": self.signature,
            "costs": s.costs.to_dict(),
            "budget": s.budget,
            "algorithm": s.algorithm,
            "ops": [list(op) for op in s.ops],
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))


def load_plan(path: str | Path) -> Plan:
    """A plan saved with :meth:`Plan.save`; its ops are replayed to check them."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read a jaxremat plan from {path}: {e}") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise ValueError(f"{path} is not a jaxremat plan")
    if d.get("version") != VERSION:
        raise ValueError(f"{path} is a version {d.get('version')} plan; this jaxremat reads version {VERSION}")
    costs = ChainCosts.from_dict(d["costs"])
    schedule = Schedule.from_ops(costs, [tuple(op) for op in d["ops"]], budget=d["budget"], algorithm=d["algorithm"])
    return Plan(schedule, d["signature"])


def plan(
    chain: Chain,
    variables: Any,
    sample: Any,
    budget: Any,
    *,
    algorithm: str = "optimal",
    method: str = "measure",
    slots: int = 500,
    costs: ChainCosts | None = None,
    calibrate: bool = False,
    max_period: int = MAX_PERIOD,
    **profile_options: Any,
) -> Plan:
    """Profile ``chain`` (unless ``costs`` are given) and solve for ``budget``.

    With ``calibrate=True``, XLA measures the compiled step of each candidate schedule and the
    budget is corrected until the measured peak fits (:func:`jaxremat.calibrate.calibrated_solve`;
    a few compilations), so the plan's memory is what XLA uses rather than what the cost model
    predicts.

    A chain with :class:`~jaxremat.Repeat` layers gets, for ``algorithm="optimal"``, the
    fastest schedule that runs each of them as one loop over its stacked parameters (no copies,
    compile time flat in depth; :func:`~jaxremat.solvers.periodic.solve_periodic`): each copy
    stored or checkpointed alone, in any mix (a selective loop: one block body to compile), or a
    pattern of up to ``max_period`` stages repeated (which compiles each stage of the pattern);
    of those within 0.5% of the fastest, the one that compiles least.
    """
    if costs is None:
        costs = profile(chain, variables, sample, method=method, **profile_options)
    if chain.stacked and algorithm in ("optimal", "rotor"):
        schedule = None
        if calibrate:
            schedule = _calibrated_periodic(chain, variables, sample, costs, budget, max_period)
        if schedule is None:
            schedule = _periodic(chain, variables, costs, budget, slots, max_period)
    elif calibrate:
        from jaxremat.calibrate import calibrated_solve, step_temp

        measure = functools.partial(step_temp, chain, variables, sample)
        schedule = calibrated_solve(costs, budget, measure, algorithm=algorithm, slots=slots).schedule
    else:
        schedule = solve(costs, budget, algorithm=algorithm, slots=slots)
    return Plan(schedule, signature(chain, variables, sample))


def _calibrated_periodic(
    chain: Chain, variables: Any, sample: Any, costs: ChainCosts, budget: Any, max_period: int
) -> Schedule | None:
    """The fastest periodic schedule whose step, compiled by XLA, fits the budget (fastest
    candidates first, skipping those whose plain prediction is above the budget by more than
    XLA was seen to save; a few compilations); ``None`` when none tried fits."""
    from jaxremat.calibrate import calibrated_pick, step_temp
    from jaxremat.simulate import simulate

    groups = [(g.start, g.length) for g in chain.stacked]
    param_bytes = [tree_bytes(v) for v in chain.stage_shapes(variables)]
    candidates = _loop_schedules(costs, groups, param_bytes, max_period)
    measure = functools.partial(step_temp, chain, variables, sample)
    found = calibrated_pick(
        candidates, budget_bytes(costs, budget), measure, optimistic=lambda s: int(0.85 * simulate(costs, s.ops)[0])
    )
    return None if found is None else found.schedule


def _periodic(chain: Chain, variables: Any, costs: ChainCosts, budget: Any, slots: int, max_period: int) -> Schedule:
    """For a chain with Repeat layers: the fastest schedule that runs each as one loop over its
    stacked variables, with the loop's transients counted. When none fits, the optimal schedule
    with alike units grouped and the copies of the sliced parameters counted (the executor then
    warns); ``InfeasibleBudget`` when that does not fit either."""
    groups = [(g.start, g.length) for g in chain.stacked]
    param_bytes = [tree_bytes(v) for v in chain.stage_shapes(variables)]
    target = budget_bytes(costs, budget)
    found = solve_periodic(costs, target, groups, max_period=max_period, param_bytes=param_bytes)
    if found is not None:
        return found
    try:
        best = solve(copy_costs(costs, groups, param_bytes), target, slots=slots)
    except InfeasibleBudget as e:
        least_loop = _least_loop_peak(costs, groups, param_bytes)
        raise InfeasibleBudget(
            "optimal", target, min(least_loop, e.min_budget),
            note=f"a Repeat layer runs as one loop from {format_bytes(least_loop)}; below that its stacked "
            "parameters would be sliced, which copies them",
        ) from None
    classes = [(st.key, tuple(np.shape(t) for t in jax.tree.leaves(v))) for st, v in zip(chain.stages, chain.stage_shapes(variables))]
    return regularise(best, [(c, k) for c, k in zip(classes, stage_classes(best))])


def _loop_schedules(costs: ChainCosts, groups: list, param_bytes: list[int], max_period: int, steps: int = 16) -> list[Schedule]:
    """:func:`~jaxremat.solvers.periodic.periodic_schedules`, with shorter patterns and fewer
    selective loops when several Repeat layers make too many combinations."""
    for period, k in ((max_period, steps), (min(max_period, 2), 4), (1, 1)):
        try:
            return periodic_schedules(costs, groups, max_period=period, param_bytes=param_bytes, selective_steps=k)
        except ValueError:  # too many combinations over several layers
            continue
    return periodic_schedules(costs, groups, max_period=1, param_bytes=param_bytes, selective_steps=1, limit=10**9)


def _least_loop_peak(costs: ChainCosts, groups: list[tuple[int, int]], param_bytes: list[int]) -> int:
    """The lowest peak of a schedule that runs every Repeat layer as one loop."""
    return min(s.peak for s in _loop_schedules(costs, groups, param_bytes, MAX_PERIOD, steps=1))


def copy_costs(costs: ChainCosts, groups: list[tuple[int, int]], param_bytes: list[int]) -> ChainCosts:
    """``costs`` with what slicing each Repeat's stacked variables costs: XLA copies the slices
    and the gradient's pieces, up to twice the layer's variable bytes (measured), live from the
    layer's forward pass to the end of its backward pass."""
    fwd_tmp, bwd_tmp = costs.fwd_tmp.copy(), costs.bwd_tmp.copy()
    for s, n in groups:
        w = 2 * sum(int(b) for b in param_bytes[s : s + n])
        fwd_tmp[s:] += w
        bwd_tmp[s:] += w
    return dataclasses.replace(costs, fwd_tmp=np.asarray(fwd_tmp), bwd_tmp=np.asarray(bwd_tmp))
