"""The largest batch that fits a device, per strategy, and the throughput there (issue 45).

For the built-in ResNet, GPT (12 blocks in an ``nn.Sequential``), the scanned decoder (the same
GPT with its blocks one ``nn.scan``, the hand strategies its own ``nn.remat`` policies as MaxText
writes them) and a linen decoder from the outside corpus (its 8 blocks in a Python loop, the hand
strategies ``nn.remat`` on each block as its author writes it), at three memory limits on the
CPU: :func:`jaxremat.tools.fit.fit` finds each strategy's largest batch by bisection on
XLA-measured compiles of the whole training step (Adam, donated; 5% headroom) and times it there;
jaxremat is ``jaxremat.remat(loss, jaxremat.Device(m))``, timed at every batch it fits. Goal: at
every limit, jaxremat's largest batch at least the largest of the hand strategies, and its
throughput there at least the best hand strategy's at its largest batch. Also given: jaxremat's
throughput at that hand strategy's batch.

    python benchmarks/fit.py [model ...]     # the run (all models: writes the results)
    python benchmarks/fit.py --render        # fit.md again from fit.json
    python benchmarks/fit.py --merge gpt     # those models run again, their records replaced

Writes ``benchmarks/results/fit.md``, ``fit.json`` and ``fit.png`` (the GPT at its middle limit).
CPU, ``cse_barrier_expander`` off.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("XLA_FLAGS", "--xla_disable_hlo_passes=cse_barrier_expander")

import jax  # noqa: E402

import jaxremat as jr  # noqa: E402
from jaxremat.tools import models  # noqa: E402
from jaxremat.tools.fit import JAXREMAT, fit, model_strategies  # noqa: E402
from jaxremat.tools.plots import plot_fit  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results"


def builtin(name: str, shape: tuple, dtype: str) -> Callable[[], dict]:
    """The strategies of a built-in model (:func:`~jaxremat.tools.fit.model_strategies`)."""
    return lambda: model_strategies(models.SAMPLES[name][0](), shape, dtype)


def loop_decoder() -> dict:
    """The outside corpus's linen decoder (``tests/outside_models.py``: 8 blocks in a Python loop,
    next-token cross-entropy), its hand strategies the user's own: ``nn.remat`` on every block,
    with each policy; the batch is the first dimension of its tokens (sequence 128)."""
    if str(ROOT / "tests") not in sys.path:  # once, however many limits ask
        sys.path.insert(0, str(ROOT / "tests"))
    import outside_models as om

    def strategy(hand: Any) -> Callable:
        def make(size: int) -> tuple:
            case = om.loop_decoder(tokens=(size, 128))
            return case.make(hand), case.args

        return make

    return {"no remat": strategy(None), **{name: strategy(hand) for name, hand in om.HAND.items()}}


# model -> (its strategies, batch range, memory limits)
CASES = {
    "resnet": (builtin("resnet", (8, 32, 32, 3), "float32"), (4, 256), ("32MiB", "64MiB", "128MiB")),
    "gpt": (builtin("gpt", (4, 128), "int32"), (1, 32), ("64MiB", "96MiB", "160MiB")),
    "scan_decoder": (builtin("scan_decoder", (4, 128), "int32"), (1, 32), ("64MiB", "96MiB", "160MiB")),
    "loop_decoder": (loop_decoder, (1, 32), ("64MiB", "128MiB", "256MiB")),
}
MIB = 2**20


def summary(rec: dict) -> str:
    """One row of the goal table from a :meth:`~jaxremat.tools.fit.Fit.to_json` record."""
    rows = {r["strategy"]: r for r in rec["rows"]}
    mine = rows.pop(JAXREMAT)
    fitting = [r for r in rows.values() if r["size"]]
    best = max(fitting, key=lambda r: (r["size"], r["throughput"] if r["throughput"] == r["throughput"] else 0))
    at = {size: size / t for size, _, t in mine["curve"] if t == t}
    same = f"{at[best['size']]:.1f}/s" if best["size"] in at else "not tried"
    bigger = (mine["size"] or 0) >= best["size"]
    faster = mine["throughput"] >= best["throughput"]
    # the user's other question: how fast can each train in this memory, at any batch that fits
    timed = [r for r in fitting if r["throughput"] == r["throughput"]]
    quick = max(timed, key=lambda r: r["throughput"]) if timed else None
    hand_top = f"{quick['strategy']}: {quick['size']}, {quick['throughput']:.1f}/s" if quick else "-"
    top = max(at.items(), key=lambda kv: kv[1]) if at else None
    mine_top = f"{top[0]}, {top[1]:.1f}/s" if top else "-"
    return (
        f"| {rec['model']} | {rec['limit'] / MIB:.0f} MiB | {best['strategy']}: {best['size']}, "
        f"{best['throughput']:.1f}/s | {mine['size']}, {mine['throughput']:.1f}/s | {same} | "
        f"{'yes' if bigger else 'no'} | {'yes' if faster else 'no'} | {hand_top} | {mine_top} |"
    )


def render(records: list[dict], date: str) -> str:
    head = [
        "# The largest batch that fits, per strategy",
        "",
        f"`python benchmarks/fit.py` ({date}, CPU (2 cores), jax {jax.__version__}, 5% headroom, Adam; "
        "steps timed in 3 interleaved rounds of 3 calls, the median). The largest batch is found by bisection on "
        "XLA-measured compiles of the whole step; samples per second at that batch.",
        "",
        "| model | memory | best hand strategy: largest batch, samples/s | jaxremat: largest batch, samples/s "
        "| jaxremat at their batch | batch at least theirs | throughput at least theirs "
        "| fastest hand strategy (at its largest batch) | jaxremat's fastest batch |",
        "|---|---|---|---|---|---|---|---|---|",
        *[summary(rec) for rec in records],
        "",
        "Per model and limit, every strategy (`fit.json` has every size tried, XLA's memory at each and the "
        "times; `fit.png` the GPT at 96 MiB):",
        "",
    ]
    tables = []
    for rec in records:
        lines = [f"| {r['strategy']} | {r['size']} | {r['used'] / MIB:.2f} MiB | {r['throughput']:.1f} |"
                 for r in rec["rows"]]
        tables += [f"### {rec['model']}, {rec['limit'] / MIB:.0f} MiB ({rec['usable'] / MIB:.1f} usable)", "",
                   "| strategy | largest batch | step memory (XLA) | samples/s |", "|---|---|---|---|", *lines, ""]
    return "\n".join(head + tables)


def main() -> None:
    if sys.argv[1:] == ["--render"]:
        records = json.loads((OUT / "fit.json").read_text())
        text = (OUT / "fit.md").read_text()
        date = text.split("`python benchmarks/fit.py` (")[1].split(",")[0]
        (OUT / "fit.md").write_text(render(records, date))
        return
    merge = sys.argv[1:2] == ["--merge"]
    names = sys.argv[2:] if merge else (sys.argv[1:] or list(CASES))
    records = []
    for name in names:
        strategies, sizes, limits = CASES[name]
        for memory in limits:
            result = fit(strategies(), jr.Device(memory), sizes=sizes, model=name, steps=3, quiet=True)
            records.append(result.to_json())
            print(summary(records[-1]), flush=True)
            print(result.table(), flush=True)
            if name == "gpt" and memory == limits[1]:
                plot_fit(result, OUT / "fit.png")
    date = str(datetime.date.today())
    if merge:
        old = json.loads((OUT / "fit.json").read_text())
        text = (OUT / "fit.md").read_text()
        first = text.split("`python benchmarks/fit.py` (")[1].split(",")[0]
        new = {r["model"] for r in records}
        kept = [r for r in old if r["model"] not in new]
        records = sorted(kept + records, key=lambda r: list(CASES).index(r["model"]))
        date = f"{first}; {' and '.join(names)} rerun {date} with `--merge`"
    if merge or not sys.argv[1:]:
        (OUT / "fit.json").write_text(json.dumps(records, indent=1))
        (OUT / "fit.md").write_text(render(records, date))


if __name__ == "__main__":
    main()
