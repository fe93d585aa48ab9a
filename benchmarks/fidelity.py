"""Executed schedules against their plan: XLA temp memory and flops of the whole training step.

For each test chain and budgets of 30%, 50% and 75% of the store-all peak, solve with
``"optimal"``, run the schedule with :func:`jaxremat.execute` inside the training step, compile
it on CPU with ``cse_barrier_expander`` disabled, and compare XLA's ``temp_size_in_bytes`` with
the predicted peak (minus the input ``a_0``), and the compiled flops with the predicted forward,
backward and recomputation flops (not for a Repeat, which runs as a loop: XLA's cost analysis
counts a loop body once). Writes ``benchmarks/results/fidelity.md``.

    python benchmarks/fidelity.py
"""

from __future__ import annotations

import datetime
from pathlib import Path

import jax

import jaxremat as jr
from jaxremat.tools import models as zoo
from jaxremat.api.calibrate import compile_schedule_step, measured_loss
from jaxremat.model.chain import Chain
from jaxremat import profile
from jaxremat.profiling import Rates
from jaxremat.core import simulator
from profile_fidelity import models, returning_temp  # noqa: E402  (same directory)


def measure(chain, variables, x, costs, schedule) -> tuple[int, float]:
    """(XLA temp bytes, compiled flops) of a training step that follows ``schedule``."""
    compiled = compile_schedule_step(chain, variables, x, schedule)
    return int(compiled.memory_analysis().temp_size_in_bytes), float(compiled.cost_analysis()["flops"])


def predicted_flops(costs: jr.ChainCosts, schedule: jr.Schedule) -> float:
    return simulator.predicted_flops(costs, schedule.ops)


def chains(scale: int = 1):
    """The profile-fidelity chains, and a CNN and a transformer deep enough to plan at 30%."""
    yield from models(scale)
    b = max(1, 16 // scale)
    resnet = Chain.from_linen(zoo.resnet(blocks=(3, 3, 3)))
    yield "ResNet-style CNN, 3 x 3 residual blocks (2 downsampling)", resnet, zoo.sample_input((b, 32, 32, 3))
    gpt = Chain.from_linen(zoo.gpt(blocks=12))
    yield "GPT-style decoder, 12 blocks, 128 tokens", gpt, zoo.sample_input((max(1, b // 4), 128), "int32")
    stacked = Chain.from_linen(zoo.gpt(blocks=12, stacked=True))
    yield (
        "GPT-style decoder, 12 blocks as one Repeat (loop plan)",
        stacked,
        zoo.sample_input((max(1, b // 4), 128), "int32"),
    )


def rows(scale: int = 1, shares=("30%", "50%", "75%"), returning: bool = False):
    for label, chain, x in chains(scale):
        v = chain.init(jax.random.key(0), x)
        costs = profile(chain, v, x, method="xla", rates=Rates(1e10, 1e10), cache=False, quiet=True, loss=measured_loss)
        least = jr.min_budget(costs)
        budgets = list(shares)
        if any(jr.parse_budget(b, costs) < least for b in shares):
            budgets.append(least)  # also the least budget that fits
        for share in budgets:
            try:  # jr.plan: a Repeat layer gets a schedule it runs as one loop
                sched = jr.plan(chain, v, x, share, costs=costs).schedule if chain.stacked else jr.solve(costs, share)
            except jr.InfeasibleBudget as e:
                yield label, share, None, e.min_budget / jr.store_all_peak(costs)
                continue
            if not isinstance(share, str):
                share = f"least ({share / jr.store_all_peak(costs):.0%})"
            temp, flops = measure(chain, v, x, costs, sched)
            pflops = float("nan") if chain.stacked else predicted_flops(costs, sched)  # XLA counts a loop body once
            ret = None
            if returning:  # the same schedule in a step that returns the gradients, for comparison
                f, per = jr.execute(chain, sched), chain.layer_variables(v)
                ret = returning_temp(
                    lambda vs, a: f(chain.from_layer_variables(vs), a)[0], per, [u.get("params", {}) for u in per], x
                )
            yield label, share, (sched, temp, flops, pflops, int(costs.x[0]), ret), None


def main() -> None:
    lines = [
        '# Executed schedules against the plan (`"optimal"`, CPU)',
        "",
        f"Measured {datetime.date.today().isoformat()}, jax {jax.__version__}, `cse_barrier_expander` disabled. "
        "Command: `python benchmarks/fidelity.py`",
        "",
        "XLA temp is that of the step users run (loss, gradients and an Adam update, parameters and optimizer "
        "state donated), the step whose memory a plan promises. *Gradient-returning step*: the same schedule "
        "in a step that returns the loss and gradients instead, where XLA can keep activations in the "
        "gradient output buffers, which its temp leaves out (shown for comparison).",
        "",
        "| chain | budget | predicted peak − a_0 | XLA temp | temp / predicted | gradient-returning step: temp / "
        "predicted | "
        "time overhead (plan) | compiled flops / predicted |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, share, got, min_share in rows(returning=True):
        if got is None:
            lines.append(f"| {label} | {share} | does not fit (least budget {min_share:.0%} of store-all) | | | | | |")
        else:
            sched, temp, flops, pflops, x0, ret = got
            pred = sched.peak - x0
            lines.append(
                f"| {label} | {share} | {jr.format_bytes(pred)} | {jr.format_bytes(temp)} | {temp / pred:.3f} | "
                f"{ret / pred:.3f} | {sched.overhead:.3f} | "
                f"{'n/a (a loop)' if pflops != pflops else f'{flops / pflops:.3f}'} |"
            )
        print(lines[-1], flush=True)
    out = Path(__file__).resolve().parent / "results" / "fidelity.md"
    out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
