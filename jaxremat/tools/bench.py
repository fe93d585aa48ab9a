"""Reports of a :class:`~jaxremat.compare.Comparison`: CSV, markdown tables and the plot."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import jax

from jaxremat.model.chain import Chain
from jaxremat.tools.compare import Comparison, compare
from jaxremat.api.calibrate import measured_loss
from jaxremat.profiling.profiler import profile
from jaxremat.core.units import format_bytes

NOISE = 0.03  # step-time differences below this share of the no-remat time are within noise here, at least


def tolerance(cmp: Comparison) -> float:
    """The step-time difference (a share of no remat's time) called noise in ``cmp``: the run's
    own spread between points that compiled to the same program (:meth:`Comparison.identical_spread`),
    at least :data:`NOISE`. On the 2-core CPU VM such pairs differed by 2-14% (2026-12-03)."""
    return max(NOISE, cmp.identical_spread()[0])


def write_csv(cmp: Comparison, path: str | Path) -> Path:
    rows = cmp.rows()
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return Path(path)


def _mib(b: int | None) -> str:
    return "" if b is None else f"{b / 2**20:.2f}"


def verdict(cmp: Comparison, manual: Any, asked: Any) -> str:
    """How jaxremat, asked for a manual strategy's memory, did against it."""
    if asked is None:
        return "not run"
    if not asked.times:
        return asked.note
    parts = []
    d = cmp.overhead(asked) - cmp.overhead(manual)
    noise = tolerance(cmp)
    parts.append("faster" if d < -noise else "slower" if d > noise else "same time (within noise)")
    if asked.temp > manual.temp:
        parts.append(f"but {100 * (asked.temp / manual.temp - 1):.0f}% more memory")
    return ", ".join(parts)


FLOPS_SLACK = 1e-3  # compiled flops within 0.1% count as no more


def more_flops(manual: Any, asked: Any) -> bool:
    """Whether the compiled ``asked`` point takes more compiled flops than ``manual``."""
    return asked.flops > manual.flops * (1 + FLOPS_SLACK)


def fits_in_flops(manual: Any, asked: Any) -> bool:
    """Whether the compiled ``asked`` point uses no more XLA temp than ``manual`` and no more
    compiled flops (:data:`FLOPS_SLACK`)."""
    return asked.temp <= manual.temp and not more_flops(manual, asked)


def flops_verdict(manual: Any, asked: Any) -> bool:
    """Whether jaxremat, asked for a manual strategy's memory, fits it in no more compiled flops."""
    return asked is not None and bool(asked.times) and fits_in_flops(manual, asked)


def strategies_table(cmp: Comparison) -> list[str]:
    """Every manual strategy and jaxremat's answers at its memory."""
    lines = [
        "| manual strategy | temp MiB | total MiB | flops | time | jaxremat asked: temp MiB (predicted) | time "
        "(predicted) | result | jaxremat calibrated: temp MiB | flops | time | result |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = cmp.baseline
    lines.append(
        f"| no remat | {_mib(base.temp)} | {_mib(base.total)} | 1.00 | 1.00 ({base.time * 1e3:.1f} ms) |" + " |" * 7
    )
    for m, asked, cal, _ in cmp.matched():
        cells = [m.strategy, _mib(m.temp), _mib(m.total), f"{cmp.flops_ratio(m):.2f}", f"{cmp.overhead(m):.2f}"]
        if asked is not None and asked.times:
            cells += [
                f"{_mib(asked.temp)} ({_mib(asked.predicted_peak)})",
                f"{cmp.overhead(asked):.2f} ({asked.predicted_overhead:.2f})",
            ]
        else:
            cells += ["", ""]
        cells.append(verdict(cmp, m, asked))
        if cal is not None and cal.times:
            cells += [_mib(cal.temp), f"{cmp.flops_ratio(cal):.2f}", f"{cmp.overhead(cal):.2f}"]
        else:
            cells += ["", "", ""]
        cells.append(verdict(cmp, m, cal))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def sweep_table(cmp: Comparison) -> list[str]:
    lines = [
        "| jaxremat | budget MiB | predicted peak − a_0 MiB | XLA temp MiB | temp / predicted | flops | time "
        "(predicted) | compile s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in cmp.points:
        if p.kind != "jaxremat" or not p.times:
            continue
        ratio = p.temp / p.predicted_peak if p.predicted_peak else float("nan")
        lines.append(
            f"| {p.strategy.split(' @ ')[0]} | {_mib(p.budget)} | {_mib(p.predicted_peak)} | {_mib(p.temp)} | "
            f"{ratio:.2f} | {cmp.flops_ratio(p):.2f} | {cmp.overhead(p):.2f} ({p.predicted_overhead:.2f}) | "
            f"{p.compile_s:.1f} |"
        )
    return lines


def noise_check(cmp: Comparison) -> str:
    """A sentence on timing noise: jaxremat at the store-all budget runs no remat's computation,
    in about its memory (less where store options keep less at no extra flops, or where its
    stored stages make no copies of donated kernels; more where XLA copies the parameters of
    stages whose kernel reads wait for their cotangent, :mod:`jaxremat.run._grad_tie`)."""
    base = cmp.baseline
    spread, names = cmp.identical_spread()
    same = (
        f" Identical programs timed apart differed by up to {spread:.1%} of no remat's time "
        f"({' and '.join(f'`{n}`' for n in names)}); differences below {tolerance(cmp):.1%} are called noise "
        "here."
        if names
        else ""
    )
    swept = [p for p in cmp.points if p.kind == "jaxremat" and p.times and p.budget is not None]
    if not swept:
        return same
    p = max(swept, key=lambda p: p.budget)  # the store-all budget, the sweep's largest
    if abs(cmp.flops_ratio(p) - 1) >= 0.005:
        return same
    memory = (
        "the same memory"
        if p.temp == base.temp
        else (f"{p.temp / 2**20:.2f} MiB of temp against {base.temp / 2**20:.2f}")
    )
    return (
        f" Noise check: jaxremat at the store-all budget compiles to no remat's flops "
        f"({cmp.flops_ratio(p):.3f}), in {memory}, and measured {cmp.overhead(p):.2f}.{same}"
    )


def markdown(cmp: Comparison, plot: str | None = None) -> str:
    """The model's section of the results: strategies, jaxremat's sweep, the plot."""

    def ok(w: str) -> bool:
        return w.startswith(("faster", "same")) and "more memory" not in w

    asked = [verdict(cmp, m, a) for m, a, _, _ in cmp.matched()]
    cal = [verdict(cmp, m, c) for m, _, c, _ in cmp.matched()]
    flops = [flops_verdict(m, a) for m, a, _, _ in cmp.matched()]
    out = [
        f"## {cmp.model}",
        "",
        f"{cmp.costs.length} stages; input {format_bytes(cmp.input_bytes)}, parameters "
        f"{format_bytes(cmp.params_bytes)}; no-remat step {cmp.baseline.time * 1e3:.1f} ms. "
        f"Times and flops are over no remat; temp is XLA's `temp_size_in_bytes` (total adds arguments "
        "and outputs less the donated buffers: parameters, optimizer state, input and loss). jaxremat asked for a "
        "manual strategy's "
        f"memory: no slower within that memory for {sum(map(ok, asked))} of {len(asked)}, within it and in no "
        f"more compiled flops for {sum(flops)} of {len(flops)}; calibrated with XLA in the loop: "
        f"{sum(map(ok, cal))} of {len(cal)}.{noise_check(cmp)}",
        "",
        *strategies_table(cmp),
        "",
        "jaxremat's sweep (budgets from the least that fits to the store-all peak):",
        "",
        *sweep_table(cmp),
        "",
    ]
    if plot:
        out += [f"![{cmp.model}]({plot})", ""]
    return "\n".join(out)


def run(
    label: str,
    model: Any,
    x: Any,
    out_dir: str | Path,
    *,
    name: str,
    method: str = "measure",
    rounds: int = 6,
    quiet: bool = False,
    plot: bool = True,
    variables: Any = None,
    points: int = 8,
    manual: Any = None,
) -> tuple[Comparison, str]:
    """Profile, compare and write ``{name}.csv`` (and ``{name}.png``) under ``out_dir``;
    returns the comparison and its markdown section."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    chain = model if isinstance(model, Chain) else Chain.from_linen(model)
    if variables is None:
        variables = (
            model.init(jax.random.key(0), x) if not isinstance(model, Chain) else chain.init(jax.random.key(0), x)
        )
    costs = profile(chain, variables, x, method=method, quiet=quiet, loss=measured_loss)
    say = None if quiet else (lambda s: print("  " + s, flush=True))
    cmp = compare(label, chain, variables, x, costs, rounds=rounds, progress=say, n_budgets=points, manual=manual)
    write_csv(cmp, out_dir / f"{name}.csv")
    png = None
    if plot:
        from jaxremat.tools.plots import plot_comparison

        png = plot_comparison(cmp, out_dir / f"{name}.png").name
    return cmp, markdown(cmp, png)
