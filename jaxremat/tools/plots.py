"""Plots (matplotlib, from the ``bench`` extra): time against memory."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from jaxremat.core.costs import ChainCosts
from jaxremat.solvers import pareto

if TYPE_CHECKING:
    from jaxremat.tools.compare import Comparison
    from jaxremat.tools.fit import Fit

MIB = 2.0**20


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("plots need matplotlib: pip install 'jaxremat[bench]' (or pip install matplotlib)") from None
    return plt


def plot_front(costs: ChainCosts, path: str | Path, algorithms: Sequence[str] = ("optimal", "revolve")) -> Path:
    """The predicted time-memory front of each algorithm, saved as a PNG."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for algorithm in algorithms:
        front = pareto(costs, algorithm=algorithm)
        if front:
            ax.plot([s.peak / MIB for s in front], [s.overhead for s in front], "-o", ms=3, label=algorithm)
    ax.set_xlabel("predicted peak activation memory (MiB)")
    ax.set_ylabel("predicted step time over store-all")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def plot_comparison(cmp: "Comparison", path: str | Path) -> Path:
    """Measured time over no remat against XLA temp memory: jaxremat's curves and the manual
    strategies as labelled points."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    timed = [p for p in cmp.points if p.times]
    for algorithm, style in (("optimal", "-o"), ("revolve", "--s"), ("sqrt", "D")):
        pts = sorted(
            {
                p.temp: p for p in timed if p.kind == "jaxremat" and p.strategy.startswith(f"jaxremat {algorithm} ")
            }.values(),
            key=lambda p: p.temp,
        )
        if pts:
            ax.plot(
                [p.temp / MIB for p in pts], [cmp.overhead(p) for p in pts], style, label=f"jaxremat {algorithm}", ms=4
            )
    matched = [p for p in timed if p.kind == "matched"]
    if matched:
        ax.scatter(
            [p.temp / MIB for p in matched],
            [cmp.overhead(p) for p in matched],
            facecolors="none",
            edgecolors="C0",
            s=60,
            label="jaxremat at a manual strategy's memory",
            zorder=3,
        )
    calibrated = [p for p in timed if p.kind == "calibrated"]
    if calibrated:
        ax.scatter(
            [p.temp / MIB for p in calibrated],
            [cmp.overhead(p) for p in calibrated],
            color="C2",
            marker="^",
            s=40,
            label="jaxremat calibrated to a manual strategy's memory",
            zorder=3,
        )
    manual = [p for p in timed if p.kind == "manual"]
    ax.scatter(
        [p.temp / MIB for p in manual],
        [cmp.overhead(p) for p in manual],
        color="C3",
        marker="x",
        s=50,
        label="manual strategies",
        zorder=4,
    )
    for n, p in enumerate(manual):
        ax.annotate(
            p.strategy.replace("checkpoint ", "ckpt ").replace("policy ", ""),
            (p.temp / MIB, cmp.overhead(p)),
            textcoords="offset points",
            xytext=(4, 4 + 7 * (n % 3)),
            fontsize=7,
            color="C3",
        )
    ax.set_xlabel("XLA temp memory of the training step (MiB)")
    ax.set_ylabel("step time over no remat (measured)")
    ax.set_title(cmp.model, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def plot_fit(result: "Fit", path: str | Path) -> Path:
    """Two panels per strategy against the input size: the step's memory as XLA measured it, the
    device's usable memory drawn as a line; and the samples per second where the step was timed
    (each strategy's largest size that fits, or every size with ``time_all``)."""
    plt = _pyplot()
    fig, (mem, speed) = plt.subplots(1, 2, figsize=(11, 4.4))
    for row in result.rows:
        style = "-o" if row.strategy == "jaxremat" else "--."
        width = 2.2 if row.strategy == "jaxremat" else 1.0
        sizes = [s for s, _, _ in row.curve]
        (line,) = mem.plot(sizes, [b / MIB for _, b, _ in row.curve], style, lw=width, ms=4, label=row.strategy)
        timed = [(s, s / t) for s, _, t in row.curve if t == t]
        if timed:
            speed.plot(*zip(*timed), style, lw=width, ms=6, color=line.get_color(), label=row.strategy)
    mem.axhline(result.usable / MIB, color="k", lw=1.2, label=f"usable memory ({result.usable / MIB:.0f} MiB)")
    for ax, label in ((mem, "step memory, XLA (MiB)"), (speed, "samples per second")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel(result.axis)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    mem.legend(fontsize=7)
    fig.suptitle(f"{result.model}: the largest {result.axis} in {result.limit / MIB:.0f} MiB, per strategy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
