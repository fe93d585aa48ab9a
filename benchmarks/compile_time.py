"""Compile time of a deep transformer under jaxremat against nn.scan(nn.remat(block)).

    python benchmarks/compile_time.py [--blocks 48]

Two ways to write the model for jaxremat: ``jr.Repeat(block, n)`` (parameters stacked, as
nn.scan keeps them; the plan repeats one pattern over it, run as one ``lax.scan``) and an
``nn.Sequential`` of ``n`` blocks (one parameter tree per block; ``scan=True`` stacks runs of
alike units inside the step). For the Repeat rows the table also gives XLA's temp memory of the
step over the planned peak. Writes ``benchmarks/results/compile_time.md``.
"""

from __future__ import annotations

import argparse
import datetime
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp

import jaxremat as jr
from jaxremat.api.calibrate import compile_schedule_step
from jaxremat.core.compile import as_planned
from jaxremat.profiling import Rates
from profile_fidelity import TransformerBlock  # noqa: E402  (same directory)

WIDTH, HEADS, TOKENS, BATCH = 128, 4, 64, 2


class Scanned(nn.Module):
    """The hand-written baseline: nn.scan over nn.remat(block)."""

    blocks: int

    @nn.compact
    def __call__(self, x):
        block = nn.scan(
            nn.remat(lambda mdl, x, _: (TransformerBlock(HEADS, WIDTH, parent=mdl)(x), None)),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=self.blocks,
        )
        return block(self, x, None)[0]


def compile_seconds(fn, *args, tries: int = 2) -> float:
    """Tracing, lowering and compiling ``jax.jit(fn)`` (the best of ``tries``: timings here are noisy)."""
    times = []
    for _ in range(tries):
        jax.clear_caches()
        t0 = time.perf_counter()
        jax.jit(as_planned(fn)).lower(*args).compile(jr.compiler_options())
        times.append(time.perf_counter() - t0)
    return min(times)


def interleaved(steps: dict[str, tuple], rounds: int = 3) -> dict[str, float]:
    """Compile seconds of each ``name -> (fn, *args)``, the best of ``rounds`` taken in turn (the
    machine's speed drifts over minutes; taking them in turn keeps the ratios fair)."""
    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, (fn, *args) in steps.items():
            best[name] = min(best.get(name, float("inf")), compile_seconds(fn, *args, tries=1))
    return best


BASE = "nn.scan(nn.remat(block))"


def repeat_rows(blocks: int, rounds: int = 3) -> list[tuple[str, float, str, str]]:
    """The baseline and jaxremat on ``Repeat(block, blocks)`` (compile seconds, planned overhead,
    XLA temp / plan), compiled in turn ``rounds`` times."""
    x = jnp.ones((BATCH, TOKENS, WIDTH))
    base = Scanned(blocks)
    bv = base.init(jax.random.key(0), x)
    model = nn.Sequential([jr.Repeat(TransformerBlock(HEADS, WIDTH), blocks)])
    chain = jr.Chain.from_linen(model)
    v = model.init(jax.random.key(0), x)
    steps = {
        BASE: (jax.grad(lambda v: jnp.mean(base.apply(v, x) ** 2)), bv),
        "no remat, Repeat (nn.scan)": (jax.grad(lambda v: jnp.mean(model.apply(v, x) ** 2)), v),
    }
    info = {BASE: ("", ""), "no remat, Repeat (nn.scan)": ("1.000", "")}
    costs = jr.profile(chain, v, x, method="xla", rates=Rates(1e10, 1e10), quiet=True)
    for algorithm, budget in (("every_stage", None), ("optimal", "75%"), ("optimal", "50%"), ("optimal", "30%")):
        p = jr.plan(chain, v, x, budget, algorithm=algorithm, costs=costs)
        f = jr.execute(chain, p.schedule)
        temp = compile_schedule_step(chain, v, x, p.schedule).memory_analysis().temp_size_in_bytes
        name = f"jaxremat {algorithm}" + (f" at {budget}" if budget else "") + f", Repeat ({_period(p.schedule)})"
        steps[name] = (jax.grad(lambda v, f=f: jnp.mean(f(v, x)[0] ** 2)), v)
        info[name] = (f"{p.schedule.overhead:.3f}", f"{temp / (p.predicted_peak - int(costs.x[0])):.2f}")
    seconds = interleaved(steps, rounds)
    return [(name, seconds[name], *info[name]) for name in steps]


def depth_table(depths: list[int]) -> None:
    """Compile time of nn.scan(nn.remat(block)) and of jaxremat's Repeat plans at several depths."""
    lines = [
        f"# Compile time against depth, transformer blocks (width {WIDTH}, {TOKENS} tokens), CPU",
        "",
        f"Measured {datetime.date.today().isoformat()}, jax {jax.__version__}. Command: "
        f"`python benchmarks/compile_time.py --depths {' '.join(map(str, depths))}`. Seconds to trace, lower "
        "and compile the loss-and-gradients step (best of three, taken in turn with the baseline); in brackets, "
        "over nn.scan(nn.remat(block)) "
        "at the same depth.",
        "",
        "| step | " + " | ".join(f"{d} blocks" for d in depths) + " |",
        "|---|" + "---|" * len(depths),
    ]
    table: dict[str, list[str]] = {}
    for d in depths:
        rows = repeat_rows(d)
        t_base = rows[0][1]
        for name, t, _, _ in rows:
            if name == BASE:
                table.setdefault(BASE, []).append(f"{t:.2f}")
                continue
            key = name.split(" (")[0] if name.startswith("no remat") else name.split(", Repeat")[0] + ", Repeat"
            how = name.split("(")[-1].rstrip(")")
            table.setdefault(key, []).append(f"{t:.2f} ({t / t_base:.2f}x; {how})")
    lines += [f"| {k} | " + " | ".join(v) + " |" for k, v in table.items()]
    out = Path(__file__).resolve().parent / "results" / "compile_depth.md"
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())


def _period(schedule) -> str:
    """How a schedule runs one Repeat layer: a selective loop (how many copies stored) or the
    repeated pattern."""
    from jaxremat.core.tree import StoreUnit, parse, units

    spine = units(parse(schedule.ops, schedule.costs.length))[0]
    kinds = ["store" if isinstance(u, StoreUnit) else f"region of {u.stop - u.start}" for u in spine]
    if len(set(kinds)) == 2 and set(kinds) == {"store", "region of 1"}:
        return f"selective loop: {kinds.count('store')} of {len(kinds)} stored"
    for m in range(1, len(kinds) + 1):
        if kinds == kinds[:m] * (len(kinds) // m) and len(kinds) % m == 0:
            return "pattern: " + ", ".join(kinds[:m])
    return "no pattern"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=48)
    parser.add_argument(
        "--depths",
        type=int,
        nargs="+",
        default=None,
        help="instead: the baseline and the Repeat rows at each depth (writes compile_depth.md)",
    )
    args = parser.parse_args()
    if args.depths:
        return depth_table(args.depths)
    x = jnp.ones((BATCH, TOKENS, WIDTH))
    rows = repeat_rows(args.blocks)
    t_base = rows[0][1]
    model = nn.Sequential([TransformerBlock(HEADS, WIDTH) for _ in range(args.blocks)])
    chain = jr.Chain.from_linen(model)
    v = chain.init(jax.random.key(0), x)
    plain = compile_seconds(jax.grad(lambda v: jnp.mean(model.apply(v, x) ** 2)), v, tries=1)
    rows.append(("no remat, Sequential", plain, "1.000", ""))
    costs = jr.profile(chain, v, x, method="xla", rates=Rates(1e10, 1e10), quiet=True)
    for algorithm, budget in (("every_stage", None), ("sqrt", None), ("optimal", "50%"), ("optimal", "30%")):
        sched = jr.solve(costs, budget, algorithm=algorithm)
        for scan in (False, True):
            f = jr.execute(chain, sched, scan=scan)
            t = compile_seconds(jax.grad(lambda v: jnp.mean(f(v, x)[0] ** 2)), v, tries=1)
            name = (
                f"jaxremat {algorithm}"
                + (f" at {budget}" if budget else "")
                + ", Sequential"
                + (", scan=True" if scan else "")
            )
            rows.append((name, t, f"{sched.overhead:.3f}", ""))
    lines = [
        f"# Compile time, {args.blocks} transformer blocks (width {WIDTH}, {TOKENS} tokens), CPU",
        "",
        f"Measured {datetime.date.today().isoformat()}, jax {jax.__version__}. Command: "
        f"`python benchmarks/compile_time.py --blocks {args.blocks}`",
        "",
        "Compile time: tracing, lowering and XLA compile of the loss-and-gradients step (the baseline and "
        "the Repeat rows: the best of three, compiled in turn; Sequential rows: one). "
        "Planned overhead: predicted step time over store-all. XLA temp / plan: temp memory of the "
        "training step with its Adam update (parameters and optimizer state donated) over the planned peak "
        "(less the input), Repeat rows only.",
        "",
        "| step (loss and gradients) | compile time (s) | over nn.scan(nn.remat) | planned time overhead | XLA temp "
        "/ plan |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {name} | {t:.2f} | {t / t_base:.2f}x | {ov} | {fid} |" for name, t, ov, fid in rows]
    out = Path(__file__).resolve().parent / "results" / "compile_time.md"
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())


if __name__ == "__main__":
    main()
