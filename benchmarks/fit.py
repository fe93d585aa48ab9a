"""The largest batch that fits a device, per strategy, and the throughput there (issue 45).

For the built-in ResNet, GPT (12 blocks in an ``nn.Sequential``) and the scanned decoder (the same
GPT with its blocks one ``nn.scan``, the hand strategies its own ``nn.remat`` policies as MaxText
writes them), at three memory limits on the CPU: :func:`jaxremat.tools.fit.fit` finds each
strategy's largest batch by bisection on XLA-measured compiles of the whole training step (Adam,
donated; 5% headroom) and times it there; jaxremat is ``jaxremat.remat(loss, jaxremat.Device(m))``.
Goal: at every limit, jaxremat's largest batch at least the largest of the hand strategies, and its
throughput there at least the best hand strategy's at its largest batch.

    python benchmarks/fit.py [model ...]

Writes ``benchmarks/results/fit.md``, ``fit.json`` and ``fit.png`` (the GPT at its middle limit).
CPU, ``cse_barrier_expander`` off.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_disable_hlo_passes=cse_barrier_expander")

import jax  # noqa: E402

import jaxremat as jr  # noqa: E402
from jaxremat.tools import models  # noqa: E402
from jaxremat.tools.fit import JAXREMAT, fit, model_strategies  # noqa: E402
from jaxremat.tools.plots import plot_fit  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results"
# model -> (input shape at any batch, dtype, batch range, memory limits)
CASES = {
    "resnet": ((8, 32, 32, 3), "float32", (4, 256), ("32MiB", "64MiB", "128MiB")),
    "gpt": ((4, 128), "int32", (1, 32), ("64MiB", "96MiB", "160MiB")),
    "scan_decoder": ((4, 128), "int32", (1, 32), ("64MiB", "96MiB", "160MiB")),
}


def main() -> None:
    names = sys.argv[1:] or list(CASES)
    rows, records = [], []
    for name in names:
        shape, dtype, sizes, limits = CASES[name]
        factory = models.SAMPLES[name][0]
        for memory in limits:
            result = fit(model_strategies(factory(), shape, dtype), jr.Device(memory), sizes=sizes, model=name,
                         steps=3, quiet=True)
            records.append(result.to_json())
            mine, best = result.row(JAXREMAT), result.best_hand()
            bigger = best is None or (mine.size or 0) >= best.size
            faster = best is None or (mine.throughput == mine.throughput and mine.throughput >= best.throughput)
            hand = f"{best.strategy}: {best.size}, {best.throughput:.1f}/s" if best else "none fits"
            rows.append(
                f"| {name} | {memory} | {hand} | {mine.size or 'none'}, {mine.throughput:.1f}/s | "
                f"{'yes' if bigger else 'no'} | {'yes' if faster else 'no'} |"
            )
            print(rows[-1], flush=True)
            print(result.table(), flush=True)
            if name == "gpt" and memory == limits[1]:
                plot_fit(result, OUT / "fit.png")
    if sys.argv[1:]:
        return
    text = "\n".join([
        "# The largest batch that fits, per strategy",
        "",
        f"`python benchmarks/fit.py` ({datetime.date.today()}, CPU, jax {jax.__version__}, 5% headroom, Adam, "
        "steps timed 3 times after one untimed, median). Largest batch found by bisection on XLA-measured "
        "compiles of the whole step; samples per second at that batch.",
        "",
        "| model | memory | best hand strategy: largest batch, samples/s | jaxremat: largest batch, samples/s "
        "| batch at least theirs | throughput at least theirs |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        "Per model and limit, every strategy (`benchmarks/results/fit.json` has the sizes tried, the memory "
        "XLA measured at each and the times):",
        "",
    ])
    tables = []
    for rec in records:
        head = f"### {rec['model']}, {rec['limit'] / 2**20:.0f} MiB ({rec['usable'] / 2**20:.1f} usable)"
        lines = [f"| {r['strategy']} | {r['size']} | {r['used'] / 2**20:.2f} MiB | {r['throughput']:.1f} |"
                 for r in rec["rows"]]
        tables.append("\n".join([head, "", "| strategy | largest batch | step MiB | samples/s |",
                                 "|---|---|---|---|", *lines, ""]))
    (OUT / "fit.md").write_text(text + "\n".join(tables))
    (OUT / "fit.json").write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
