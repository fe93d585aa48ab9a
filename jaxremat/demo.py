"""The README's main job: plan a ResNet-style chain for a few budgets against the baselines.

Until the profiler lands, the chain's costs are written by hand from a ResNet-50 at batch 32,
224x224, float32 (activation bytes from the shapes; times proportional to the flops).
"""

from __future__ import annotations

import time

from jaxremat.costs import ChainCosts
from jaxremat.schedule import InfeasibleBudget
from jaxremat.solvers import ALGORITHMS, budget_bytes, solve, store_all_peak
from jaxremat.units import format_bytes


def resnet_like_costs(batch: int = 32) -> ChainCosts:
    """A 18-stage ResNet-50-shaped chain: stem, pool, 3+4+6+3 bottleneck blocks, head."""
    f32 = 4
    act = lambda c, hw: batch * c * hw * hw * f32  # noqa: E731
    names, x, xbar, fwd, ftmp, btmp = ["input"], [act(3, 224)], [], [], [], []

    def stage(name: str, out: int, keep: float, ms: float, tmp: float) -> None:
        names.append(name)
        x.append(out)
        xbar.append(int(keep * out))
        fwd.append(ms)
        ftmp.append(int(tmp * out))
        btmp.append(int(tmp * out))

    stage("stem", act(64, 112), 2.5, 2.0, 0.5)
    stage("maxpool", act(64, 56), 1.5, 0.3, 0.0)
    for k, (n, c, hw, ms) in enumerate([(3, 256, 56, 3.0), (4, 512, 28, 2.8), (6, 1024, 14, 2.6), (3, 2048, 7, 2.4)]):
        for b in range(n):
            stage(f"layer{k + 1}.{b}", act(c, hw), 3.0, ms, 0.5)
    stage("head", batch * 1000 * f32, 1.0, 0.1, 0.0)
    return ChainCosts(
        x=x, xbar=xbar, fwd=fwd, bwd=[2 * t for t in fwd], fwd_tmp=ftmp, bwd_tmp=btmp, names=names[1:]
    )


def run_demo(budgets: tuple[str, ...] = ("30%", "50%", "75%")) -> None:
    costs = resnet_like_costs()
    for b in budgets:
        budget_bytes(costs, b)  # a budget that does not parse fails before any output
    peak = store_all_peak(costs)
    print("jaxremat demo: a ResNet-50-shaped chain (batch 32, 224x224, float32), hand-written costs")
    print(f"  {costs.length} stages; store-all peak {format_bytes(peak)}; times in ms\n")
    header = f"{'budget':>18}  " + "  ".join(f"{a:>22}" for a in ALGORITHMS)
    print(header)
    print("-" * len(header))
    for b in budgets:
        cells = []
        for algorithm in ALGORITHMS:
            try:
                s = solve(costs, b, algorithm=algorithm)
                cells.append(f"{format_bytes(s.peak):>11} {s.overhead:>6.3f}x {'':>2}")
            except InfeasibleBudget:
                cells.append(f"{'does not fit':>22}")
        label = f"{b} = {format_bytes(budget_bytes(costs, b))}"
        print(f"{label:>18}  " + "  ".join(f"{c:>22}" for c in cells))
    print("\n(each cell: predicted peak, time over store-all)\n")
    t0 = time.perf_counter()
    s = solve(costs, budgets[len(budgets) // 2])
    print(f"optimal schedule at {budgets[len(budgets) // 2]} (solved in {time.perf_counter() - t0:.3f} s):")
    print(s.summary())
