"""The promise on models written by others: verified plans against hand policies.

For each model of the outside corpus (``tests/outside_models.py``: a plain-JAX loop MLP, a linen
decoder looping over its blocks, a linen CNN with the user's ``nn.remat``, dropout and
BatchNorm, a U-Net with concatenated skips, an equinox transformer with its blocks in a list, an
NNX model over an ``nnx.List``), planned
through ``jaxremat.remat`` at 20 / 30 / 50 / 75% of the store-all peak:

* the user's training step (gradient of the first argument, Adam, donated) compiled apart:
  XLA's temp over the budget, compiled flops over the plain step's, the corrections the
  verification made and the first call's setup seconds (trace, profile, plan, verify);
* against each hand policy on every block (``jax.checkpoint``, ``dots_saveable``,
  ``dots_with_no_batch_dims_saveable``): jaxremat given the policy's measured memory as its
  budget, its memory and flops over the policy's.

Goal: every accepted budget within 1.05x by measurement, no more flops than any hand policy at
its memory (beyond the 1% within which the leaner schedule is kept,
:data:`~jaxremat.solvers.lean.LEAN_TIE`). Plans as ``jaxremat.remat`` makes them by default
(``method="flops"``), CPU, ``cse_barrier_expander`` off. Writes ``benchmarks/results/outside.md``.

    python benchmarks/outside.py
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
import time
from pathlib import Path

# a cache folder of its own: the setup seconds are a first call's, not a read of an earlier run's plans
os.environ.setdefault("JAXREMAT_CACHE_DIR", tempfile.mkdtemp(prefix="jaxremat-outside-"))

import jax  # noqa: E402

import jaxremat as jr  # noqa: E402
from jaxremat.solvers.lean import LEAN_TIE  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from outside_models import CASES, HAND  # noqa: E402
from outside_models import update_step as step_figures  # noqa: E402

BUDGETS = ("20%", "30%", "50%", "75%")


def _how(e: jr.InfeasibleBudget) -> str:
    """Where a refusal's least budget comes from: XLA (verification compiled schedules) or the
    cost model (the solver found none within the budget, so nothing was compiled)."""
    return "measured" if "measured by XLA" in str(e) else "predicted"


def rows_for(key: str) -> tuple[list[str], list[str]]:
    case = CASES[key]()
    plain_temp, plain_flops = step_figures(case.loss, case.args, case.has_aux)
    budget_rows, hand_rows = [], []
    base = None
    for budget in BUDGETS:
        t0 = time.perf_counter()
        f = jr.remat(case.loss, budget) if base is None else base.with_budget(budget)
        base = base or f
        try:
            plan = f.plan(*case.args)
        except jr.InfeasibleBudget as e:
            budget_rows.append(
                f"| {case.name} | {budget} | refused: least {_how(e)} {jr.format_bytes(e.min_budget)} "
                f"(budget {jr.format_bytes(e.budget)}) | | | | {time.perf_counter() - t0:.1f} |"
            )
            print(budget_rows[-1], flush=True)
            continue
        setup = time.perf_counter() - t0
        temp, flops = step_figures(f, case.args, case.has_aux)
        v = plan.verification
        budget_rows.append(
            f"| {case.name} | {budget} | {jr.format_bytes(v.budget)} | {temp / v.budget:.3f} | "
            f"{flops / plain_flops:.3f} | "
            f"{v.corrections} ({v.chosen}) | {setup:.1f} |"
        )
        print(budget_rows[-1], flush=True)
    for hand, policy in HAND.items():
        memory, flops = step_figures(case.make(policy), case.args, case.has_aux)
        try:
            f = base.with_budget(memory)
            f.plan(*case.args)
            temp, got = step_figures(f, case.args, case.has_aux)
            if got <= flops * 1.001:
                verdict = "no more"
            elif got <= flops * (1 + LEAN_TIE) and temp < memory:
                verdict = "within the tie, leaner"  # the leaner of two schedules within 1% is kept
            else:
                verdict = "MORE"
            hand_rows.append(
                f"| {case.name} | {hand} | {jr.format_bytes(memory)} | {temp / memory:.3f} | "
                f"{got / flops:.3f} | {verdict} |"
            )
        except jr.InfeasibleBudget as e:
            hand_rows.append(
                f"| {case.name} | {hand} | {jr.format_bytes(memory)} | refused (least {_how(e)} "
                f"{jr.format_bytes(e.min_budget)}) | | MISSED |"
            )
        print(hand_rows[-1], flush=True)
    return budget_rows, hand_rows


def main() -> None:
    keys = sys.argv[1:] or list(CASES)
    budget_rows: list[str] = []
    hand_rows: list[str] = []
    for n, key in enumerate(keys):
        b, h = rows_for(key)
        budget_rows += b
        hand_rows += h
        write(budget_rows, hand_rows, keys[n + 1 :])  # after each model: a stopped run keeps what it measured


def write(budget_rows: list[str], hand_rows: list[str], left: list[str]) -> None:
    """``benchmarks/results/outside.md`` with the rows so far; ``left``: the models not yet run."""
    lines = [
        "# Verified plans on models written by others",
        "",
        f"Measured {datetime.date.today().isoformat()}, CPU, jax {jax.__version__}, `cse_barrier_expander` disabled; "
        'plans as `jaxremat.remat` makes them by default (`method="flops"`); the step is the user\'s '
        "(gradient of the first argument, Adam, donated), "
        "compiled apart from the plan's verification. Command: `python benchmarks/outside.py`",
        "",
        "## Budgets",
        "",
        "| model | budget | bytes | XLA temp / budget | flops / plain | corrections (chosen) | setup s |",
        "|---|---|---|---|---|---|---|",
        *budget_rows,
        "",
        "## Against hand policies on every block, at the policy's measured memory",
        "",
        "| model | hand policy | its memory | jaxremat temp / that | jaxremat flops / policy's | |",
        "|---|---|---|---|---|---|",
        *hand_rows,
    ]
    if left:
        lines += ["", f"Not yet run (the run was stopped or is still going): {', '.join(left)}."]
    out = Path(__file__).resolve().parent / "results" / "outside.md"
    out.write_text("\n".join(lines) + "\n")
    if not left:
        print(out.read_text())


if __name__ == "__main__":
    main()
