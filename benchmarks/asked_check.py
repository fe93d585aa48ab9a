"""The compiled half of ``compare.py``, without timing: memory and flops only (about 6 minutes).

For each built-in model: every hand-written strategy's update step is compiled, jaxremat
``"optimal"`` is asked for its XLA-measured memory (plus the input) from the cost model alone,
and the plan's step compiled; plus jaxremat's sweep of 8 budgets. Reports per asked row whether
the plan fits the strategy's memory in no more compiled flops (the issue-13 criterion, as
``compare.py``'s "no more flops" column), and the XLA temp / predicted peak over every row.
Nothing is timed, so it is the quick check of a cost-model or executor change; ``compare.py``
stays the measurement of record. Writes ``benchmarks/results/asked_check.md``.

    python benchmarks/asked_check.py [--models resnet gpt autoencoder mixer]
"""

from __future__ import annotations

import argparse
import datetime
import time
from pathlib import Path
from typing import NamedTuple

import jax

from jaxremat import Chain, profile
from jaxremat.api.calibrate import measured_loss
from jaxremat.tools.bench import fits_in_flops, more_flops
from jaxremat.tools.compare import compare
from jaxremat.tools.models import SAMPLES, sample_input

MIB = 2**20


class ModelCheck(NamedTuple):
    """One model's table rows, its wins of its asked rows, and the least and largest XLA temp /
    predicted over the asked and sweep rows."""

    rows: list[str]
    wins: int
    asked: int
    low: float
    high: float


def check(name: str) -> ModelCheck:
    """The asked rows and the sweep of model ``name`` (:data:`SAMPLES`), compiled, not timed."""
    factory, shape, dtype = SAMPLES[name]
    model, x = factory(), sample_input(shape, dtype)
    chain = Chain.from_linen(model)
    variables = model.init(jax.random.key(0), x)
    costs = profile(chain, variables, x, method="measure", quiet=True, loss=measured_loss)
    cmp = compare(name, chain, variables, x, costs, algorithms=("optimal",), rounds=0)
    base = next(p for p in cmp.points if p.strategy == "no remat").flops
    manual = {p.strategy: p for p in cmp.points if p.kind == "manual"}
    # the sweep and the asked rows (not calibration's trial plans, which compare() also compiles)
    planned = [
        p for p in cmp.points if p.kind in ("jaxremat", "matched") and not p.strategy.startswith("jaxremat calibrated")
    ]
    ratios = [p.temp / p.predicted_peak for p in planned if p.predicted_peak]
    rows, wins, asked = [], 0, 0
    for p in cmp.points:
        if p.kind != "matched":
            continue
        m = manual[p.matches]
        asked += 1
        if not p.predicted_peak:  # did not fit: the note says why
            rows.append(f"| {name} | {m.strategy} | {m.temp / MIB:.2f} | {m.flops / base:.3f} | | | | | {p.note} |")
            continue
        ok = fits_in_flops(m, p)
        wins += ok
        why = (
            "ok"
            if ok
            else ", ".join(w for w, bad in (("more memory", p.temp > m.temp), ("more flops", more_flops(m, p))) if bad)
        )
        rows.append(
            f"| {name} | {m.strategy} | {m.temp / MIB:.2f} | {m.flops / base:.3f} | {p.predicted_peak / MIB:.2f} "
            f"| {p.temp / MIB:.3f} | {p.temp / p.predicted_peak:.3f} | {p.flops / base:.3f} | {why} |"
        )
    return ModelCheck(rows, wins, asked, min(ratios), max(ratios))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(SAMPLES), choices=list(SAMPLES))
    args = parser.parse_args()
    table = [
        "| model | hand-written strategy | its temp MiB | its flops | asked: predicted − a_0 MiB | XLA temp MiB "
        "| temp / predicted | flops | result |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    summary = []
    total = [0, 0]
    for name in args.models:
        t0 = time.perf_counter()
        c = check(name)
        print(
            f"{name}: {c.wins} of {c.asked}, temp / predicted {c.low:.3f}-{c.high:.3f} "
            f"({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
        table += c.rows
        summary.append(f"| {name} | {c.wins} of {c.asked} | {c.low:.3f}–{c.high:.3f} |")
        total = [total[0] + c.wins, total[1] + c.asked]
    text = "\n".join(
        [
            "# Asked plans against hand-written strategies: memory and flops (no timing)",
            "",
            f"Measured {datetime.date.today().isoformat()}, jax {jax.__version__}, CPU, every step the update step "
            "(Adam, parameters and state donated) compiled with `cse_barrier_expander` disabled; costs profiled "
            'with `method="measure"`. Command: `python benchmarks/asked_check.py '
            f"--models {' '.join(args.models)}`. Flops are over no remat's. A row is a win when jaxremat's plan, "
            "asked for the strategy's XLA temp plus the input, uses no more XLA temp and no more compiled flops "
            "(0.1% slack). Temp / predicted covers the asked rows and the 8-budget sweep.",
            "",
            "| model | asked: fits in no more flops | XLA temp / predicted |",
            "|---|---|---|",
            *summary,
            f"| all | {total[0]} of {total[1]} | |",
            "",
            *table,
            "",
        ]
    )
    out = Path(__file__).resolve().parent / "results" / "asked_check.md"
    out.write_text(text)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
