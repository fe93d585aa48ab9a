"""Why jaxremat's plan at a hand-written policy's memory is not that policy: the cost model's view.

For each built-in model and each per-block policy of ``compare.py`` (``dots_saveable``,
``dots_with_no_batch_dims_saveable``): the schedule that stores every stage under the policy (the
hand-written strategy, as the solver's candidate ``"every stage under ..."`` has it) replayed on
the model's profile, against the strategy's XLA-measured memory (read from
``benchmarks/results/compare_<model>.csv``, so run ``compare.py`` first) and against the plan the
solver makes at that memory. A row where the candidate is predicted over the strategy's memory
loses on the prediction; one where it fits but is predicted slower loses on the measured times.
Nothing is compiled (about a minute with cached profiles). Writes
``benchmarks/results/policy_gap.md``.

    python benchmarks/policy_gap.py [--models resnet gpt autoencoder mixer]
"""

from __future__ import annotations

import argparse
import csv
import datetime
from pathlib import Path

import jax

from jaxremat import Chain, profile, solve
from jaxremat.api.calibrate import measured_loss
from jaxremat.core.simulator import predicted_flops
from jaxremat.solvers.optimal import candidates
from jaxremat.core.schedule import Schedule
from jaxremat.tools.models import SAMPLES, sample_input

MIB = 2**20
POLICIES = ("dots_saveable", "dots_with_no_batch_dims_saveable")
RESULTS = Path(__file__).resolve().parent / "results"


def strategy_memory(name: str, policy: str) -> int | None:
    """The XLA temp bytes of ``policy`` around every block in ``compare.py``'s last run."""
    path = RESULTS / f"compare_{name}.csv"
    if not path.exists():
        return None
    for row in csv.DictReader(path.open()):
        if row["kind"] == "manual" and row["strategy"] == f"policy {policy}":
            return int(row["temp_bytes"])
    return None


def rows_for(name: str) -> list[str]:
    factory, shape, dtype = SAMPLES[name]
    model, x = factory(), sample_input(shape, dtype)
    chain = Chain.from_linen(model)
    costs = profile(chain, model.init(jax.random.key(0), x), x, method="measure", quiet=True, loss=measured_loss)
    x0 = int(costs.x[0])
    fixed = candidates(costs)
    store_all = Schedule.from_ops(costs, fixed["store_all"], budget=None, algorithm="store_all")
    out = []
    for policy in POLICIES:
        temp = strategy_memory(name, policy)
        ops = fixed.get(f"every stage under {policy}")
        if temp is None or ops is None:
            continue
        hand = Schedule.from_ops(costs, ops, budget=None, algorithm="candidate")
        plan = solve(costs, temp + x0)
        flops = predicted_flops(costs, plan.ops), predicted_flops(costs, hand.ops)
        ratio = "" if None in flops else f"{flops[0] / flops[1]:.3f}"
        over = (hand.peak - x0 - temp) / MIB
        why = [
            w
            for w, yes in (
                ("predicted over the memory", over > 0),
                (f"predicted {hand.time / plan.time - 1:.1%} slower", hand.time > plan.time),
            )
            if yes
        ]
        why = "; ".join(why) or "the plan is the policy or runs fewer flops"
        out.append(
            f"| {name} | {policy} | {temp / MIB:.3f} | {(hand.peak - x0) / MIB:.3f} ({over:+.3f}) | "
            f"{hand.time / store_all.time:.4f} | {(plan.peak - x0) / MIB:.3f} | {plan.time / store_all.time:.4f} | "
            f"{ratio} | {why} |"
        )
    return out


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(SAMPLES), choices=list(SAMPLES))
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    head = [
        "model",
        "policy",
        "strategy's XLA temp (MiB)",
        "every stage under it: predicted (over)",
        "its predicted time / store-all",
        "the plan's predicted peak",
        "the plan's predicted time / store-all",
        "the plan's flops / the policy's (predicted)",
        "why the plan is not the policy",
    ]
    rows = [r for name in args.models for r in rows_for(name)]
    text = (
        "\n".join(
            [
                f"# Hand-written policies against the plan at their memory ({datetime.date.today().isoformat()}, jax "
                f"{jax.__version__})",
                "",
                "Command: `python benchmarks/policy_gap.py` (the cost model only; strategy memory from "
                "`compare_<model>.csv`)",
                "",
                "| " + " | ".join(head) + " |",
                "|" + "---|" * len(head),
                *rows,
            ]
        )
        + "\n"
    )
    if not args.no_write:
        (RESULTS / "policy_gap.md").write_text(text)
    print(text)
    return text


if __name__ == "__main__":
    main()
