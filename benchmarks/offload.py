"""Remat alone, offload alone and both together, simulated on the built-in models for a GPU.

Each model is profiled with the roofline method at an H100's vendor rates (the profiler's rate
table: compute and HBM bandwidth), then for host links of 12, 25 and 50 GB/s each way every
budget of a sweep is solved three ways: ``"optimal"`` (remat, store options, FB), offloading
alone (every stage stored whole, bundles moved to host memory where the link hides it: the
offload DP with recomputation switched off) and ``"optimal_offload"`` (both). Everything is the
cost model's simulation (``jaxremat.simulate``): no GPU is used. Writes
``benchmarks/results/offload.md`` and ``offload.png``.

    python benchmarks/offload.py                    # H100 rates: offload.md, offload.png
    python benchmarks/offload.py --device V100      # a GPU with more compute time per byte: offload_v100.md
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import jax
import numpy as np

import jaxremat as jr
from jaxremat.core.transfers import Bandwidth
from jaxremat.model.chain import Chain
from jaxremat.profiling.rates import GPU_RATES
from jaxremat.solvers.offload import offload_ops
from jaxremat.tools import models as zoo

RESULTS = Path(__file__).resolve().parent / "results"
BANDWIDTHS = (12e9, 25e9, 50e9)
POINTS = 24
MODELS = {
    "resnet": ("ResNet-style CNN, 16 x 32x32x3", lambda: zoo.resnet(), (16, 32, 32, 3), "float32"),
    "gpt": ("GPT-2-style decoder, 12 blocks, width 128, 4 x 128 tokens", lambda: zoo.gpt(), (4, 128), "int32"),
    "autoencoder": ("Conv autoencoder, 8 x 64x64x3", lambda: zoo.autoencoder(), (8, 64, 64, 3), "float32"),
    "mixer": ("MLP-Mixer, 8 blocks, width 128, 16 x 32x32x3", lambda: zoo.mixer(), (16, 32, 32, 3), "float32"),
    "gpt-small": (
        "GPT-2-small-sized decoder, 12 blocks, width 768, 12 heads, vocab 8192, 8 x 512 tokens",
        lambda: zoo.gpt(blocks=12, width=768, heads=12, vocab=8192),
        (8, 512),
        "int32",
    ),
}


def costs_of(name: str, device: str = "H100") -> jr.ChainCosts:
    _, make, shape, dtype = MODELS[name]
    chain = Chain.from_linen(make())
    x = zoo.sample_input(shape, dtype, high=512)
    v = chain.init(jax.random.key(0), x)
    return jr.profile(chain, v, x, method="xla", rates=GPU_RATES[device], quiet=True)


def fronts(costs: jr.ChainCosts, bandwidth: float) -> dict[str, list[tuple[int, float]]]:
    """(peak bytes, overhead) per budget of a sweep, for each of the three ways."""
    top = jr.store_all_peak(costs)
    lo = jr.min_budget(costs, algorithm="optimal_offload", bandwidth=bandwidth)
    out: dict[str, list[tuple[int, float]]] = {"remat": [], "offload": [], "both": []}
    for b in sorted({int(v) for v in np.linspace(lo, top, POINTS)}):
        try:
            s = jr.solve(costs, b)
            out["remat"].append((s.peak, s.overhead))
        except jr.InfeasibleBudget:
            pass
        s = jr.solve(costs, b, algorithm="optimal_offload", bandwidth=bandwidth)
        out["both"].append((s.peak, s.overhead))
        ops, _ = offload_ops(costs, b, 500, Bandwidth.of(bandwidth), remat=False)
        if ops is not None:
            s = jr.Schedule.from_ops(costs, ops, budget=b, algorithm="offload only", bandwidth=bandwidth)
            out["offload"].append((s.peak, s.overhead))
    out["both"] += out["remat"]  # every remat schedule is one of "both"'s: the front is over all of them
    store_all = jr.solve(costs, None, algorithm="store_all")
    out["offload"].append((store_all.peak, store_all.overhead))  # offloading nothing is offloading alone too
    return out


def reduction(front: list[tuple[int, float]], top: int, overhead: float) -> float | None:
    """Store-all peak over the least peak within ``overhead`` (``None`` if none is)."""
    peaks = [p for p, o in front if o <= overhead + 1e-9]
    return top / min(peaks) if peaks else None


def removed(costs: jr.ChainCosts, bandwidth: float) -> list[float]:
    """At budgets 30%, 50% and 70% of the way from remat's least budget to store-all: the share
    of remat's overhead that adding offload removes."""
    lo, top = jr.min_budget(costs), jr.store_all_peak(costs)
    shares = []
    for f in (0.3, 0.5, 0.7):
        b = int(lo + f * (top - lo))
        r = jr.solve(costs, b).overhead
        o = jr.solve(costs, b, algorithm="optimal_offload", bandwidth=bandwidth).overhead
        shares.append((r - o) / (r - 1) if r > 1 + 1e-9 else float("nan"))
    return shares


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--device", default="H100", choices=list(GPU_RATES), help="vendor rates (default H100)")
    args = parser.parse_args()
    rates, stem = GPU_RATES[args.device], "offload" if args.device == "H100" else f"offload_{args.device.lower()}"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(args.models), figsize=(4.2 * len(args.models), 3.6), squeeze=False)
    rows, mids = [], []
    for ax, name in zip(axes[0], args.models):
        costs = costs_of(name, args.device)
        top = jr.store_all_peak(costs)
        compute = float(costs.fwd.sum() + costs.bwd.sum())
        acts = float(costs.xbar.sum())
        forward = float(costs.fwd.sum())
        for bw in BANDWIDTHS:
            fr = fronts(costs, bw)
            red = {k: (reduction(v, top, 1.10), reduction(v, top, 1.20)) for k, v in fr.items()}
            rows.append((name, bw, red, compute, acts, min(1.0, bw * forward / acts)))
            mids.append((name, bw, removed(costs, bw)))
            print(name, f"{bw / 1e9:.0f} GB/s", red, mids[-1][2], flush=True)
            style = {12e9: ":", 25e9: "-", 50e9: "--"}[bw]
            for k, color in (("remat", "tab:blue"), ("offload", "tab:orange"), ("both", "tab:green")):
                if fr[k] and (k != "remat" or bw == BANDWIDTHS[0]):
                    p, o = zip(*sorted(fr[k]))
                    ax.plot(
                        np.array(p) / 2**20,
                        o,
                        style if k != "remat" else "-",
                        color=color,
                        label=f"{k}" + ("" if k == "remat" else f" {bw / 1e9:.0f} GB/s"),
                    )
        ax.set_title(MODELS[name][0][:40], fontsize=8)
        ax.set_xlabel("predicted peak (MiB)")
        ax.set_ylabel("time over store-all")
        ax.set_ylim(0.95, 2.0)
        ax.legend(fontsize=6)
    fig.tight_layout()
    RESULTS.mkdir(parents=True, exist_ok=True)
    fig.savefig(RESULTS / f"{stem}.png", dpi=110)
    fmt = lambda v: "—" if v is None else f"{v:.2f}x"  # noqa: E731
    lines = [
        f"# Remat, offload, and both (simulated for an {args.device})",
        "",
        f"Computed {datetime.date.today().isoformat()}, jax {jax.__version__}: costs from the roofline method at "
        f"{args.device} vendor rates ({rates.flops / 1e12:.1f} TFLOP/s, {rates.bandwidth / 1e12:.2f} TB/s), "
        "schedules replayed by `jaxremat.simulate`; no GPU ran. Command: `python benchmarks/offload.py"
        + ("" if args.device == "H100" else f" --device {args.device}")
        + "`",
        "",
        "Memory reduction: the store-all peak over the least predicted peak whose time is within 10% / 20% of "
        "store-all. *offload alone* stores every stage whole and moves bundles to host memory where the link "
        'hides them; *both* is `"optimal_offload"`. *link\'s reach*: the share of the store-all bundle bytes the '
        "link can carry to the host during the whole forward pass (bandwidth × forward time / bundle bytes), an upper "
        "bound on what any offload schedule hides.",
        "",
        "| model | link | compute per step (ms) | bundle bytes (MiB) | bytes per µs of compute | link's reach | "
        "remat ≤10% | remat ≤20% | offload alone ≤10% | offload alone ≤20% | both ≤10% | both ≤20% |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, bw, red, compute, acts, reach in rows:
        lines.append(
            f"| {name} | {bw / 1e9:.0f} GB/s | {compute * 1e3:.3f} | {acts / 2**20:.1f} | "
            f"{acts / (compute * 1e6):.0f} | "
            f"{reach:.1%} | "
            f"{fmt(red['remat'][0])} | {fmt(red['remat'][1])} | {fmt(red['offload'][0])} | {fmt(red['offload'][1])} | "
            f"{fmt(red['both'][0])} | {fmt(red['both'][1])} |"
        )
    lines += [
        "",
        "Share of remat's overhead that offloading removes, at budgets 30% / 50% / 70% of the way from remat's "
        "least budget to store-all (nan: remat has no overhead there):",
        "",
        "| model | link | 30% | 50% | 70% |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {n} | {bw / 1e9:.0f} GB/s | " + " | ".join(f"{v:.2f}" for v in s) + " |" for n, bw, s in mids]
    lines += [
        "",
        "Reading it against the paper's headline (4–6x at under 20% overhead, a third of remat's overhead "
        "removed): offloading can only hide what the link carries while the forward pass computes, the *reach* "
        "column. Where the reach is a few percent (every model here at an H100's vendor rates: hundreds of kB of "
        "kept bytes per µs of roofline compute, against 12–50 kB per µs for the links) offloading removes almost "
        "none of remat's overhead and offloading alone cannot go below store-all within 20%; where it is larger "
        "(the GPT-2-small-sized model at a V100's rates: `offload_v100.md`) the two together go well past remat "
        "alone. The simulation is only as good as the roofline times: measured GPU step times are longer, which "
        "gives the link more time (`benchmarks/gpu_check.py` measures them on a GPU).",
        "",
        f"![fronts]({stem}.png)",
        "",
    ]
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print((RESULTS / f"{stem}.md").read_text())


if __name__ == "__main__":
    main()
