"""jaxremat against the ``jax.checkpoint`` strategies JAX users write by hand, measured by XLA.

Every strategy becomes the same training step, the one users run (loss, gradients and an Adam
update, parameters and optimizer state donated: :func:`jaxremat.api.calibrate.update_step`),
compiled with :func:`jaxremat.compiler_options` so remat is real on the CPU. For each we record
XLA's temp memory and total memory (temp + arguments + outputs), compiled flops, compile time
and the median step wall time; times are measured in interleaved rounds so that drift on a busy
machine hits every strategy alike.

Manual strategies (per "block" = per stage of the chain):

* ``no remat``; ``remat every block`` (what ``nn.remat`` on each block does: keep each block's
  input, recompute the block in the backward pass);
* ``checkpoint every k blocks`` for k = 2, 3, 4 and ~sqrt(L) (``jax.checkpoint`` around groups);
* ``checkpoint whole chain`` (one ``jax.checkpoint`` around everything);
* per-block policies ``dots_saveable``, ``dots_with_no_batch_dims_saveable``,
  ``nothing_saveable`` (``jax.checkpoint(block, policy=...)``).
"""

from __future__ import annotations

import hashlib
import math
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxremat.api.calibrate import calibrated_solve, compile_step, measured_optimizer
from jaxremat.core.compile import total_bytes
from jaxremat.model.chain import Chain
from jaxremat.model.stage import stage_rngs
from jaxremat.model.trees import tree_bytes
from jaxremat.core.costs import ChainCosts
from jaxremat.run.executor import execute
from jaxremat.core.schedule import InfeasibleBudget, Schedule
from jaxremat.core.budgets import store_all_peak
from jaxremat.solvers import min_budget, solve
from jaxremat.tools.step_timing import CarriedStep, interleaved

Forward = Callable[[list, Any], Any]  # (per-stage variables, x) -> output


# -- manual strategies ---------------------------------------------------------------------------


def _apply_range(chain: Chain, start: int, stop: int, rngs: dict | None) -> Callable[[list, Any], Any]:
    def run(per_stage: list, a: Any) -> Any:
        for i in range(start, stop):
            a = chain.stages[i].apply(per_stage[i], a, stage_rngs(rngs, i))[0]
        return a

    return run


def grouped(chain: Chain, k: int, policy: Callable | None = None, rngs: dict | None = None) -> Forward:
    """``jax.checkpoint`` (with ``policy``) around each run of ``k`` consecutive stages."""
    L = len(chain)
    groups = [jax.checkpoint(_apply_range(chain, s, min(s + k, L), rngs), policy=policy) for s in range(0, L, k)]

    def forward(per_stage: list, x: Any) -> Any:
        for g in groups:
            x = g(per_stage, x)
        return x

    return forward


def plain(chain: Chain, rngs: dict | None = None) -> Forward:
    """The chain without remat."""
    return _apply_range(chain, 0, len(chain), rngs)


def manual_strategies(chain: Chain, rngs: dict | None = None) -> dict[str, Forward]:
    """The hand-written strategies, by name (see the module docstring)."""
    L = len(chain)
    policies = jax.checkpoint_policies
    out: dict[str, Forward] = {"no remat": plain(chain, rngs), "remat every block": grouped(chain, 1, None, rngs)}
    ks = sorted({2, 3, 4, max(2, round(math.sqrt(L)))})
    for k in ks:
        if k < L:
            name = f"checkpoint every {k} blocks" + (" (sqrt L)" if k == max(2, round(math.sqrt(L))) else "")
            out[name] = grouped(chain, k, None, rngs)
    out["checkpoint whole chain"] = grouped(chain, L, None, rngs)
    for name in ("dots_saveable", "dots_with_no_batch_dims_saveable", "nothing_saveable"):
        out[f"policy {name}"] = grouped(chain, 1, getattr(policies, name), rngs)
    return out


# -- the training step and its measurement --------------------------------------------------------


@dataclass
class Point:
    """One measured strategy. Memory in bytes, time in seconds."""

    strategy: str
    kind: str  # "manual", "jaxremat", "matched" (asked for a manual strategy's memory) or "calibrated"
    temp: int = 0
    total: int = 0
    flops: float = 0.0
    compile_s: float = 0.0
    times: list[float] = field(default_factory=list, repr=False)
    budget: int | None = None  # jaxremat: the budget asked for
    predicted_peak: int | None = None  # jaxremat: the plan's peak minus the input a_0
    predicted_overhead: float | None = None
    matches: str | None = None  # matched/calibrated: the manual strategy whose memory was the budget
    note: str = ""
    compiled: Any = field(default=None, repr=False)
    program: str = ""  # a hash of the compiled program's text: points with equal ones run the same code

    @property
    def time(self) -> float:
        return statistics.median(self.times) if self.times else float("nan")


def compile_point(point: Point, forward: Forward, per_stage: list, params: list, x: Any) -> Point:
    """``point`` with the memory, flops and compile time of ``forward``'s update step
    (:func:`~jaxremat.api.calibrate.compile_step`); its compiled step is kept for timing."""
    t0 = time.perf_counter()
    compiled = compile_step(forward, per_stage, params, x)
    point.compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    point.temp, point.total = int(mem.temp_size_in_bytes), total_bytes(mem)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    point.flops = float(cost.get("flops", float("nan")))
    point.compiled = compiled
    # the module's name and metadata differ between strategies that compile to the same code
    lines = compiled.as_text().splitlines()
    text = "\n".join(line.split(", metadata=")[0] for line in lines if not line.startswith("HloModule"))
    point.program = hashlib.sha256(text.encode()).hexdigest()[:16]
    return point


def fresh_state(params: list) -> tuple[list, Any]:
    """A copy of ``params`` and a new optimizer state for them: what a compiled update step
    (which donates both) is first called with."""
    return jax.tree.map(jnp.copy, params), measured_optimizer().init(params)


def time_points(points: Sequence[Point], params: list, x: Any, *, rounds: int = 6, calls: int = 5) -> None:
    """Wall times of every compiled point, in interleaved rounds
    (:func:`~jaxremat.tools.step_timing.interleaved`); each point's step donates its parameters
    and optimizer state, so each carries its own copy from call to call."""
    steps = [CarriedStep(p.compiled, *fresh_state(params), x) for p in points]
    for p, times in zip(points, interleaved(steps, rounds=rounds, calls=calls)):
        p.times.extend(times)


# -- the comparison ----------------------------------------------------------------------------------


@dataclass
class Comparison:
    """All measured points of one model; ratios are over the ``no remat`` point."""

    model: str
    costs: ChainCosts
    points: list[Point]
    input_bytes: int
    params_bytes: int

    @property
    def baseline(self) -> Point:
        return next(p for p in self.points if p.strategy == "no remat")

    def overhead(self, p: Point) -> float:
        return p.time / self.baseline.time

    def flops_ratio(self, p: Point) -> float:
        return p.flops / self.baseline.flops

    def identical_spread(self) -> tuple[float, list[str]]:
        """Timing noise measured in this run: the largest difference of step time over no remat
        between points that compiled to the same program (say ``remat every block`` and ``policy
        nothing_saveable``, or jaxremat at the store-all budget and no remat), and those points;
        ``(0.0, [])`` when no two did. Measured separately, each is the same computation."""
        by_program: dict[str, list[Point]] = {}
        for p in self.points:
            if p.times and p.program and not any(p.times is q.times for q in by_program.get(p.program, [])):
                by_program.setdefault(p.program, []).append(p)
        spread, names = 0.0, []
        for group in by_program.values():
            if len(group) > 1:
                ratios = [self.overhead(p) for p in group]
                if max(ratios) - min(ratios) > spread:
                    spread, names = max(ratios) - min(ratios), [p.strategy for p in group]
        return spread, names

    def rows(self) -> list[dict[str, Any]]:
        """One dict per point, for CSV and tables."""
        out = []
        for p in self.points:
            out.append(
                {
                    "model": self.model,
                    "kind": p.kind,
                    "strategy": p.strategy,
                    "matches": p.matches or "",
                    "budget_bytes": "" if p.budget is None else p.budget,
                    "predicted_bytes": "" if p.predicted_peak is None else p.predicted_peak,
                    "temp_bytes": p.temp,
                    "total_bytes": p.total,
                    "flops_over_no_remat": round(self.flops_ratio(p), 4) if p.flops == p.flops else "",
                    "time_over_no_remat": round(self.overhead(p), 4) if p.times else "",
                    "predicted_overhead": "" if p.predicted_overhead is None else round(p.predicted_overhead, 4),
                    "step_ms": round(p.time * 1e3, 3) if p.times else "",
                    "compile_s": round(p.compile_s, 3),
                    "note": p.note,
                }
            )
        return out

    def matched(self) -> list[tuple[Point, Point | None, Point | None, Point | None]]:
        """(manual point, jaxremat asked for its memory, jaxremat calibrated to its memory,
        fastest jaxremat point measured within its memory) per manual strategy but ``no remat``."""
        jr = [p for p in self.points if p.kind != "manual" and p.times]
        out = []
        for m in self.points:
            if m.kind != "manual" or m.strategy == "no remat":
                continue
            find = lambda kind: next(  # noqa: E731
                (p for p in self.points if p.kind == kind and p.matches == m.strategy), None
            )
            within = [p for p in jr if p.temp <= m.temp]
            best = min(within, key=lambda p: p.time) if within else None
            out.append((m, find("matched"), find("calibrated"), best))
        return out


def _schedule_point(name: str, kind: str, sched: Schedule, x0: int, **extra: Any) -> Point:
    return Point(
        name, kind, budget=sched.budget, predicted_peak=sched.peak - x0, predicted_overhead=sched.overhead, **extra
    )


def compare(
    label: str,
    chain: Chain,
    variables: Any,
    x: Any,
    costs: ChainCosts,
    *,
    budgets: Iterable[Any] | None = None,
    algorithms: Sequence[str] = ("optimal", "revolve", "sqrt"),
    manual: Sequence[str] | None = None,
    match: bool = True,
    schedules: Sequence[Schedule] = (),
    n_budgets: int = 8,
    rounds: int = 6,
    progress: Callable[[str], None] | None = None,
) -> Comparison:
    """Measure the manual strategies and jaxremat's schedules for ``chain`` on input ``x``.

    ``budgets``: jaxremat's sweep (bytes, strings such as ``"40%"``); by default ``n_budgets`` budgets
    from the least that fits to the store-all peak; ``schedules`` are measured as well. With ``match``, jaxremat
    ``"optimal"`` is
    also asked for each manual strategy's XLA-measured temp memory (plus the input, which the
    plan counts and XLA's temp does not). ``progress`` receives a line per compiled point.
    """
    say = progress or (lambda s: None)
    if chain.stacked:
        raise ValueError(
            "compare() measures per-stage manual strategies and does not take models with jaxremat.Repeat "
            "layers; use the same model with an nn.Sequential of its blocks"
        )
    per_stage = chain.split(variables)
    params = [u.get("params", {}) for u in per_stage]
    x0 = int(costs.x[0])
    rngs = {s: jax.random.key(1) for st in chain.stages for s in st.rng_streams} or None
    points: list[Point] = []
    by_ops: dict[tuple, Point] = {}  # identical schedules are compiled once

    strategies = manual_strategies(chain, rngs)
    unknown = sorted(set(manual or ()) - set(strategies))
    if unknown:
        raise ValueError(f"unknown manual strategies {unknown}; this chain has: {', '.join(strategies)}")
    for name, fwd in strategies.items():
        if manual is not None and name not in manual and name != "no remat":
            continue
        points.append(compile_point(Point(name, "manual"), fwd, per_stage, params, x))
        say(f"{name}: temp {points[-1].temp} B, compiled in {points[-1].compile_s:.1f} s")

    def run_schedule(point: Point, sched: Schedule) -> Point:
        key = tuple(sched.ops)
        if key in by_ops:  # same ops: reuse the measurement
            src = by_ops[key]
            point = replace(
                point,
                temp=src.temp,
                total=src.total,
                flops=src.flops,
                compile_s=src.compile_s,
                compiled=None,
                program=src.program,
                note=(point.note + f" same schedule as {src.strategy}").strip(),
            )
            point.times = src.times  # shared list: filled once when timed
            return point
        f = execute(chain, sched)
        compile_point(point, lambda vs, a: f(chain.merge(vs), a, rngs)[0], per_stage, params, x)
        by_ops[key] = point
        say(
            f"{point.strategy}: temp {point.temp} B (predicted {point.predicted_peak} B), compiled in "
            f"{point.compile_s:.1f} s"
        )
        return point

    least, top = min_budget(costs), store_all_peak(costs)
    if budgets is None:
        budgets = [int(b) for b in np.linspace(least, top, n_budgets)]
    for b in budgets:
        for algorithm in algorithms:
            try:
                sched = solve(costs, b, algorithm=algorithm)
            except InfeasibleBudget:
                continue
            name = f"jaxremat {algorithm} @ {sched.budget}"
            points.append(run_schedule(_schedule_point(name, "jaxremat", sched, x0), sched))

    for sched in schedules:
        name = f"jaxremat {sched.algorithm} @ {sched.budget}"
        points.append(run_schedule(_schedule_point(name, "jaxremat", sched, x0), sched))

    if match:
        for m in [p for p in points if p.kind == "manual" and p.strategy != "no remat"]:
            budget = m.temp + x0
            try:
                sched = solve(costs, budget)
            except InfeasibleBudget as e:
                points.append(
                    Point(
                        f"jaxremat optimal @ {budget}",
                        "matched",
                        budget=budget,
                        matches=m.strategy,
                        note=f"does not fit (least budget {e.min_budget} B)",
                    )
                )
            else:
                p = _schedule_point(f"jaxremat optimal @ {budget}", "matched", sched, x0, matches=m.strategy)
                points.append(run_schedule(p, sched))
            measured = {k: p.temp for k, p in by_ops.items()}

            def measure(s: Schedule) -> int:
                key = tuple(s.ops)
                if key not in measured:
                    name = f"jaxremat calibrated @ {s.budget}"
                    measured[key] = run_schedule(_schedule_point(name, "jaxremat", s, x0), s).temp
                return measured[key]

            try:
                cal = calibrated_solve(costs, budget, measure)
            except InfeasibleBudget as e:
                points.append(
                    Point(
                        f"jaxremat calibrated @ {budget}",
                        "calibrated",
                        budget=budget,
                        matches=m.strategy,
                        note=f"does not fit ({e})",
                    )
                )
                continue
            p = _schedule_point(f"jaxremat calibrated @ {budget}", "calibrated", cal.schedule, x0, matches=m.strategy)
            points.append(run_schedule(p, cal.schedule))

    needed = {id(p.times) for p in points}  # points reusing a measurement share its list of times
    timed = [p for p in points if p.kind == "manual"] + [s for s in by_ops.values() if id(s.times) in needed]
    time_points(timed, params, x, rounds=rounds)
    for p in [*points, *by_ops.values()]:
        p.compiled = None
    return Comparison(label, costs, points, x0, tree_bytes(params))
