"""jaxremat against hand-written jax.checkpoint strategies on one GPU, at realistic sizes.

    python benchmarks/gpu_check.py            # GPT-style and ResNet-style models, under 8 minutes on one GPU
                                              # (and the GPT's size as a decoder written with nn.scan)
    python benchmarks/gpu_check.py --tiny     # the same on small sizes (runs on a CPU, for testing)

For each model: compile the training step (loss and gradients) under every manual strategy,
under jaxremat ``"optimal"`` asked for each strategy's compiled memory, and under remat-only and
remat + offload plans (``"optimal_offload"``, with the host links' bandwidths measured once) at 30%
and 50% of the store-all peak (for the GPT also with its blocks stacked in one ``jr.Repeat``,
whose offload plans run as loops); then run them in order of
increasing compiled memory and read the device's ``peak_bytes_in_use`` after each (the peak only
grows, so each reading is that step's peak as long as the order holds; a reading that did not
grow is marked ``<=``). Times: median of timed calls synchronised with ``block_until_ready``.
Offload plans' gradients are compared with the no-remat step's (offloaded residuals have given
wrong gradients on GPUs before). Prints a short table last and writes it to
``benchmarks/results/gpu_check.md`` with the card and date, rewritten after each model so that a
run stopped from outside keeps what it measured.

Last, the GPT's largest batch in the whole device (``jaxremat.tools.fit``, ``jr.Device("device")``:
the allocator's limit, 5% headroom) under no remat, its hand strategies and jaxremat, by bisection
on compiles, and the samples per second each trains at there (a table of its own).

A lent GPU's time is short: ``--deadline`` (seconds from the start, default 420) stops starting
new profiles and compilations once passed; the strategies left out are listed under the table,
and what was compiled is still run and timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import sys
import time
import traceback
import warnings
from pathlib import Path

import jax
import numpy as np

import jaxremat as jr
from jaxremat.core.transfers import Bandwidth
from jaxremat.api.calibrate import measured_loss
from jaxremat.profiling.bandwidth import link_bandwidth
from jaxremat.tools import compare
from jaxremat.tools.models import gpt, resnet, sample_input

SIZES = {
    # name: (factory, kwargs, input shape, dtype)
    "GPT-2-small-style, 12 blocks, width 768, 12 heads, vocab 32768, 8 x 1024 tokens": (
        gpt,
        dict(blocks=12, width=768, heads=12, vocab=32768),
        (8, 1024),
        "int32",
    ),
    "ResNet-style, (3, 4, 6, 3) blocks, width 64, 64 x 224x224x3": (
        resnet,
        dict(blocks=(3, 4, 6, 3), width=64, classes=1000),
        (64, 224, 224, 3),
        "float32",
    ),
}
TINY = {
    "GPT-style tiny": (gpt, dict(blocks=2, width=32, heads=2, vocab=64), (2, 16), "int32"),
    "ResNet-style tiny": (resnet, dict(blocks=(1, 1), width=8, classes=10), (2, 8, 8, 3), "float32"),
}
#: The batches the fit searches (GPU; ``--tiny``: the second) and its strategies.
FIT_SIZES = ((1, 64), (1, 4))
FIT_STRATEGIES = ("no remat", "remat every block", "policy dots_saveable", "policy dots_with_no_batch_dims_saveable")
MANUAL = (
    "no remat",
    "remat every block",
    "checkpoint whole chain",
    "policy dots_saveable",
    "policy dots_with_no_batch_dims_saveable",
)


@dataclasses.dataclass
class Clock:
    """Seconds since the run began, and the deadline after which nothing new is compiled."""

    deadline: float
    start: float = dataclasses.field(default_factory=time.perf_counter)
    skipped: list[str] = dataclasses.field(default_factory=list)
    failed: list[str] = dataclasses.field(default_factory=list)  # models that raised, with the error

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def log(self, message: str) -> None:
        print(f"  [{self.elapsed:5.0f} s] {message}", flush=True)

    def late(self, what: str) -> bool:
        """Whether the deadline has passed; if so ``what`` is recorded as left out."""
        if self.elapsed < self.deadline:
            return False
        self.skipped.append(what)
        self.log(f"past the {self.deadline:.0f} s deadline: {what} left out")
        return True


def device_bytes(key: str) -> int | None:
    stats = jax.devices()[0].memory_stats()
    return None if not stats or key not in stats else int(stats[key])


def bandwidth() -> Bandwidth:
    """The links' measured bandwidths; on the CPU (``--tiny``), where nothing moves, a stand-in."""
    return Bandwidth(1e10, 1e10) if jax.devices()[0].platform == "cpu" else link_bandwidth()


def costs_of(chain: jr.Chain, v, x) -> jr.ChainCosts:
    """Measured costs on a GPU; on the CPU (``--tiny``, a test of this script) roofline costs,
    which profile in a fraction of the time."""
    if jax.devices()[0].platform == "cpu":
        return jr.profile(
            chain, v, x, method="xla", rates=jr.profiling.Rates(1e10, 1e10), quiet=True, loss=measured_loss
        )
    return jr.profile(chain, v, x, method="measure", quiet=True, loss=measured_loss)


def prepared(model, shape: tuple, dtype: str, high: int) -> tuple:
    """``(x, chain, variables, costs)`` for ``model`` on a sample input."""
    x = sample_input(shape, dtype, high=high)
    chain = jr.Chain.from_linen(model)
    v = model.init(jax.random.key(0), x)
    return x, chain, v, costs_of(chain, v, x)


def check(label: str, factory, kwargs: dict, shape: tuple, dtype: str, calls: int, clock: Clock) -> list[list[str]]:
    if clock.late(label):
        return []
    x, chain, v, costs = prepared(factory(**kwargs), shape, dtype, kwargs.get("vocab", 2))
    clock.log(f"profiled {len(chain)} stages")
    per = chain.split(v)
    params = [u.get("params", {}) for u in per]
    x0 = int(costs.x[0])
    manual = compare.manual_strategies(chain)
    k = max(2, round(math.sqrt(len(chain))))
    names = [n for n in manual if n in MANUAL or n.startswith(f"checkpoint every {k} blocks")]
    points: list = []
    for n in names:  # each strategy, then jaxremat asked for its memory: pairs, whatever the deadline cuts
        if points and clock.late(f"{label}: {n}"):  # no remat always: the rows' baseline
            continue
        points.append(compare.compile_point(compare.Point(n, "manual"), manual[n], per, params, x))
        m = points[-1]
        clock.log(f"compiled {n} ({m.compile_s:.0f} s)")
        if n == "no remat" or clock.late(f"{label}: jaxremat at '{n}'"):
            continue
        try:
            sched = jr.solve(costs, m.temp + x0)
        except jr.InfeasibleBudget as e:
            print(f"  jaxremat at {n}'s memory: does not fit (least {jr.format_bytes(e.min_budget)})")
            continue
        f = jr.execute(chain, sched)
        p = compare.Point(
            f"jaxremat at '{n}'",
            "matched",
            predicted_peak=sched.peak - x0,
            predicted_overhead=sched.overhead,
            matches=n,
        )
        points.append(compare.compile_point(p, lambda vs, a, f=f: f(chain.merge(vs), a)[0], per, params, x))
        clock.log(f"compiled {p.strategy} ({p.compile_s:.0f} s)")
    bw = bandwidth()
    for share in ("30%", "50%"):
        for alg in ("optimal", "optimal_offload"):
            if clock.late(f"{label}: jaxremat {alg} at {share}"):
                continue
            try:
                sched = jr.solve(costs, share, algorithm=alg, **({"bandwidth": bw} if alg == "optimal_offload" else {}))
            except jr.InfeasibleBudget:
                continue
            f = jr.execute(chain, sched)
            p = compare.Point(
                f"jaxremat {alg} at {share} ({len(sched.offloads)} offloaded)",
                "offload",
                predicted_peak=sched.peak - x0,
                predicted_overhead=sched.overhead,
            )
            points.append(compare.compile_point(p, lambda vs, a, f=f: f(chain.merge(vs), a)[0], per, params, x))
            clock.log(f"compiled {p.strategy} ({p.compile_s:.0f} s)")
    return measure(label, points, params, x, calls)


def measure(label: str, points: list, params: list, x, calls: int) -> list[list[str]]:
    """Run ``points`` in order of increasing compiled memory (the device's peak only grows), time
    them, compare offload plans' gradients with the no-remat step's (read from Adam's first
    moment after one update step, ``(1 - b1) g``); the table's rows."""
    base_in_use = device_bytes("bytes_in_use")
    outputs: dict[str, object] = {}
    rows, last_peak = [], None
    for p in sorted(points, key=lambda p: p.temp):  # increasing compiled memory: the peak only grows
        out = jax.block_until_ready(p.compiled(*compare.fresh_state(params), x))
        if p.strategy == "no remat" or p.kind == "offload":
            outputs[p.strategy] = jax.tree.map(np.asarray, out[2][0].mu)  # to host: compared after the runs
        carried = out[1:]
        del out
        peak = device_bytes("peak_bytes_in_use")
        grew = last_peak is None or peak is None or peak > last_peak
        last_peak = peak
        for _ in range(calls):
            t0 = time.perf_counter()
            _, *carried = jax.block_until_ready(p.compiled(*carried, x))
            p.times.append(time.perf_counter() - t0)
        del carried
        p.note = "n/a" if peak is None else ("" if grew else "<=") + jr.format_bytes(peak - (base_in_use or 0))
    for p in points:
        if p.kind == "offload":
            got, ref = jax.tree.leaves(outputs[p.strategy]), jax.tree.leaves(outputs["no remat"])
            err = max(float(np.max(np.abs(a - b))) for a, b in zip(got, ref)) / max(
                float(np.max(np.abs(b))) for b in ref
            )
            p.matches = f"grads rel. err {err:.1e}"
    base = next(p for p in points if p.strategy == "no remat")
    for p in points:
        rows.append(
            [
                label,
                p.strategy + (f"; {p.matches}" if p.kind == "offload" and p.matches else ""),
                jr.format_bytes(p.temp),
                "" if p.predicted_peak is None else jr.format_bytes(p.predicted_peak),
                p.note,
                f"{p.time * 1e3:.1f}",
                f"{p.time / base.time:.2f}",
                f"{p.flops / base.flops:.2f}" if p.flops > 0 and base.flops > 0 else "n/a",
                "" if p.predicted_overhead is None else f"{p.predicted_overhead:.2f}",
            ]
        )
        p.compiled = None
    return rows


def stacked_offload(label: str, kwargs: dict, shape: tuple, dtype: str, calls: int, clock: Clock) -> list[list[str]]:
    """The GPT with its blocks as one ``jr.Repeat`` (stacked parameters, as ``nn.scan`` keeps
    them): remat + offload plans at 30% and 50% run as offload loops (a scan per run of alike
    copies, residuals moved as scan outputs), gradients against the stacked model's plain step."""
    if clock.late(f"{label} (blocks stacked)"):
        return []
    model = gpt(**kwargs, stacked=True)
    x, chain, v, costs = prepared(model, shape, dtype, kwargs["vocab"])
    clock.log("profiled the stacked model")
    per = chain.layer_variables(v)  # the stack as the model keeps it
    params = [u.get("params", {}) for u in per]
    x0 = int(costs.x[0])
    plain = lambda vs, a: model.apply(chain.from_layer_variables(vs), a)  # noqa: E731
    points = [compare.compile_point(compare.Point("no remat", "manual"), plain, per, params, x)]
    for share in ("30%", "50%"):
        if clock.late(f"{label} (blocks stacked): jaxremat optimal_offload at {share}"):
            continue
        try:
            sched = jr.solve(costs, share, algorithm="optimal_offload", bandwidth=bandwidth())
        except jr.InfeasibleBudget:
            continue
        f = jr.execute(chain, sched)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            p = compare.compile_point(
                compare.Point(
                    f"jaxremat optimal_offload at {share} ({len(sched.offloads)} offloaded)",
                    "offload",
                    predicted_peak=sched.peak - x0,
                    predicted_overhead=sched.overhead,
                ),
                lambda vs, a, f=f: f(chain.from_layer_variables(vs), a)[0],
                per,
                params,
                x,
            )
        unrolled = any("runs unrolled" in str(w.message) for w in seen)
        p.strategy += ", unrolled" if unrolled else ", as loops"
        points.append(p)
        clock.log(f"compiled {p.strategy} ({p.compile_s:.0f} s)")
    return measure(label + " (blocks stacked: one jr.Repeat)", points, params, x, calls)


def scanned(label: str, kwargs: dict, shape: tuple, dtype: str, calls: int, clock: Clock) -> list[list[str]]:
    """The decoder written with ``nn.scan`` as MaxText writes it (``benchmarks/scan.py``): the
    scanned layer under ``nn.remat`` with each of its users' policies, and ``jaxremat.remat`` of
    the decoder without remat (planned per layer, run as loops) given each one's compiled memory."""
    import scan as scan_bench  # noqa: PLC0415 - beside this script

    if clock.late(f"{label} (nn.scan)"):
        return []
    dims = dict(layers=kwargs["blocks"], width=kwargs["width"], heads=kwargs["heads"], vocab=kwargs["vocab"])
    tokens = sample_input(shape, dtype, high=kwargs["vocab"])
    params = scan_bench.Decoder(**dims).init(jax.random.key(0), tokens)

    def point(strategy: str, kind: str, loss, **extra) -> compare.Point:
        p = compare.Point(strategy, kind, **extra)
        p.compiled, p.compile_s = scan_bench.compile_update(loss, params, tokens)
        p.temp = int(p.compiled.memory_analysis().temp_size_in_bytes)
        cost = p.compiled.cost_analysis()
        p.flops = float((cost[0] if isinstance(cost, (list, tuple)) else cost).get("flops", 0.0))
        clock.log(f"compiled {strategy} ({p.compile_s:.0f} s)")
        return p

    points = [point("no remat", "manual", scan_bench.loss_of(**dims))]
    on_gpu = jax.devices()[0].platform != "cpu"
    base = jr.remat(scan_bench.loss_of(**dims), None, method="measure" if on_gpu else "xla", quiet=True)
    for name, policy in scan_bench.POLICIES.items():
        if clock.late(f"{label} (nn.scan): {name}"):
            continue
        hand = point(f"nn.remat {name}", "manual", scan_bench.loss_of(**dims, policy=policy))
        points.append(hand)
        try:
            f = base.with_budget(hand.temp)
            plan = f.plan(params, tokens)
        except jr.InfeasibleBudget as e:
            clock.log(f"jaxremat at '{name}': refused, least {jr.format_bytes(e.min_budget)}")
            continue
        predicted = plan.predicted_peak - int(plan.costs.x[0])
        points.append(point(f"jaxremat at '{name}'", "matched", f, predicted_peak=predicted))
    return measure(label + " (nn.scan, as MaxText writes it)", points, params, tokens, calls)


def fit_table(label: str, kwargs: dict, shape: tuple, dtype: str, calls: int, clock: Clock, tiny: bool) -> str:
    """The GPT's largest batch per strategy in the device's memory (on the CPU, ``--tiny``: in the
    no-remat step's memory at batch 2), and its samples per second there: a markdown section."""
    from jaxremat.tools.fit import fit, model_strategies, step_bytes  # noqa: PLC0415

    if clock.late(f"{label}: the largest batch"):
        return ""
    every = model_strategies(gpt(**kwargs), shape, dtype)
    strategies = {name: every[name] for name in FIT_STRATEGIES}
    if tiny:
        memory = jr.Device(step_bytes(*strategies["no remat"](2), jr.api.calibrate.measured_optimizer()), 0.0)
    else:
        memory = jr.Device("device")
    result = fit(strategies, memory, sizes=FIT_SIZES[tiny], model=label, steps=min(calls, 5), quiet=True)
    clock.log(f"fit: {result.row('jaxremat').size} for jaxremat")
    return "\n".join([
        "", f"## {label}: the largest batch in {jr.format_bytes(result.limit)} "
        f"({jr.format_bytes(result.usable)} usable), per strategy", "", result.table(),
    ])


def render(rows: list[list[str]], card: str, clock: Clock, tiny: bool, extra: tuple[str, ...] = ()) -> str:
    """The results file: the table, the command and what the deadline left out."""
    head = [
        "model",
        "strategy",
        "XLA temp",
        "predicted",
        "peak_bytes_in_use - before",
        "step ms",
        "over no remat",
        "flops over no remat",
        "predicted over store-all",
    ]
    lines = [
        f"# GPU check: {card}, {datetime.date.today().isoformat()}, jax {jax.__version__}",
        "",
        f"Command: `python benchmarks/gpu_check.py{' --tiny' if tiny else ''}` "
        f"({clock.elapsed:.0f} s in all, deadline {clock.deadline:.0f} s)",
        "",
        f"Host links (jaxremat.profiling.bandwidth, measured once): {bandwidth().to_host / 1e9:.1f} GB/s to the host, "
        f"{bandwidth().to_device / 1e9:.1f} GB/s back" + (" (a stand-in: nothing moves on the CPU)" if tiny else ""),
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *["| " + " | ".join(r) + " |" for r in rows],
    ]
    lines += list(extra)
    if clock.skipped:
        lines += ["", "Left out at the deadline: " + "; ".join(clock.skipped) + "."]
    if clock.failed:
        lines += [
            "",
            "Failed (the traceback is in the run's output):",
            *[f"- {f.splitlines()[0][:300]}" for f in clock.failed],
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="small sizes (for a CPU)")
    parser.add_argument("--calls", type=int, default=10, help="timed calls per strategy (default 10)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--only", help="run only the models whose name contains this")
    parser.add_argument(
        "--deadline",
        type=float,
        default=420.0,
        help="seconds after which no new profile or compilation starts (default 420)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent / "results" / "gpu_check.md",
        help="where the table is written (default benchmarks/results/gpu_check.md)",
    )
    args = parser.parse_args(argv)
    dev = jax.devices()[0]
    card = getattr(dev, "device_kind", dev.platform)
    clock = Clock(args.deadline)
    rows: list[list[str]] = []
    text = ""
    models = [(label, m) for label, m in (TINY if args.tiny else SIZES).items() if not args.only or args.only in label]
    # every model's check first, the stacked GPT's offload loops last: what the deadline cuts first
    runs = [(label, check, m) for label, m in models]
    runs += [(label, scanned, m) for label, m in models if m[0] is gpt]
    runs += [(label, stacked_offload, m) for label, m in models if m[0] is gpt]
    runs += [(label, fit_table, m) for label, m in models if m[0] is gpt]
    extra: list[str] = []
    for label, run, (factory, kwargs, shape, dtype) in runs:
        print(f"{label}{'' if run is check else f' ({run.__name__})'} ...", flush=True)
        try:
            if run is check:
                rows += check(label, factory, kwargs, shape, dtype, args.calls, clock)
            elif run is fit_table:
                extra.append(fit_table(label, kwargs, shape, dtype, args.calls, clock, args.tiny))
            else:
                rows += run(label, kwargs, shape, dtype, args.calls, clock)
        except Exception as e:  # noqa: BLE001 - a lent GPU's minutes are few: the next model still runs
            if args.tiny:
                raise
            traceback.print_exc()
            clock.failed.append(f"{label}{'' if run is check else f' ({run.__name__})'}: {type(e).__name__}: {e}")
        text = render(rows, card, clock, args.tiny, tuple(extra))
        if not args.no_write and not args.tiny:
            args.out.write_text(text)  # after each model: a run stopped from outside keeps what it measured
    print(text)
    return text


if __name__ == "__main__":
    main(sys.argv[1:])
