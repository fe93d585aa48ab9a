"""What a Repeat's offload loops cost in memory on the CPU, against the loops without transfers.

A GPT-style decoder with its blocks stacked in one ``jr.Repeat`` is planned with
``"optimal_offload"`` (a fast link, so that it moves something) at three budgets. Each schedule's
step is compiled three ways and XLA's ``temp_size_in_bytes`` read:

* *offload loops*: as the executor runs it (``jaxremat/run/offload_loop.py``);
* *same, nothing moved*: the schedule with its transfer ops dropped, run by the loops JAX's
  autodiff of ``lax.scan`` makes (a pattern or selective loop);
* *unrolled*: the schedule with ``scan=False``.

On the CPU host and device memory are one, so an offload frees nothing and the offload loops
should use what the same loops without transfers use; the plan's peak (which counts offloaded
buffers as gone) is shown for reference, and the plan of the schedule without transfers.
Writes ``benchmarks/results/offload_loops.md``.

    python benchmarks/offload_loops.py
"""

from __future__ import annotations

import datetime
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

import jaxremat as jr
from jaxremat.core.ops import OpKind
from jaxremat.core.tree import parse_offloads, units
from jaxremat.run.loop_plan import Alike, OffloadLoop, plan_loops
from jaxremat.run.offload_loop import segments
from jaxremat.tools.models import gpt, sample_input


def temp(chain: jr.Chain, sched: jr.Schedule, v, x, scan: bool | None) -> int:
    f = jr.execute(chain, sched, scan=scan)
    step = jr.jit(jax.grad(lambda v: jnp.mean(jnp.square(f(v, x)[0].astype(jnp.float32)))))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return int(step.lower(v).compile().memory_analysis().temp_size_in_bytes)


def main() -> None:
    model, x = gpt(blocks=8, width=64, heads=2, vocab=64, stacked=True), sample_input((4, 64), "int32", high=64)
    chain = jr.Chain.from_linen(model)
    v = model.init(jax.random.key(0), x)
    costs = jr.profile(chain, v, x, method="xla", quiet=True)
    bw = 1e12
    lo, hi = jr.min_budget(costs, algorithm="optimal_offload", bandwidth=bw), jr.store_all_peak(costs)
    mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
    rows = []
    for share in (0.3, 0.5, 0.7):
        sched = jr.solve(costs, int(lo + share * (hi - lo)), algorithm="optimal_offload", bandwidth=bw)
        tree, moved = parse_offloads(sched.ops, len(chain))
        shapes = chain.stage_shapes(v)
        loops = plan_loops(chain, shapes, units(tree)[0], None, Alike(chain, shapes), moved)
        segs = sum(len(segments(seg.kinds)) for seg in loops.segments if isinstance(seg, OffloadLoop))
        kept = [op for op in sched.ops if op.kind not in (OpKind.OFFLOAD, OpKind.PREFETCH)]
        plain = jr.Schedule.from_ops(costs, kept, budget=None, algorithm="optimal_offload, transfers dropped")
        a, b, c = temp(chain, sched, v, x, None), temp(chain, plain, v, x, None), temp(chain, sched, v, x, False)
        rows.append(
            f"| {share:.0%} | {len(sched.offloads)} | {segs} | {mib(a)} | {mib(b)} | {a / b:.3f} | {mib(c)} | "
            f"{mib(sched.peak)} | {mib(plain.peak)} |"
        )
        print(rows[-1], flush=True)
    lines = [
        "# Offload loops on the CPU: memory against the same loops without transfers",
        "",
        f"Measured {datetime.date.today().isoformat()}, CPU, jax {jax.__version__}; "
        "GPT-style decoder, 8 blocks of width 64 stacked in one `jr.Repeat`, 4 x 64 tokens; XLA temp in MiB. "
        "Command: `python benchmarks/offload_loops.py`",
        "",
        "Budgets between `optimal_offload`'s least and the store-all peak. *segments*: runs of alike copies, "
        "each one forward and one backward scan. On the CPU nothing moves, so the offload loops should use what "
        "the loops without transfers use; the plan counts offloaded buffers as gone.",
        "",
        "| budget | offloaded | segments | offload loops | same, nothing moved | ratio | unrolled | plan | plan "
        "without transfers |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    (Path(__file__).resolve().parent / "results" / "offload_loops.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
