"""Solve time, compile time and peak memory of ``"optimal"`` for deep chains.

Each depth runs in a fresh process so that its peak RSS is its own. Writes
``benchmarks/results/solver.md`` (and ``solver.csv``).

    python benchmarks/solver_speed.py            # L = 50, 100, 200, 400 at S = 500; 1 and 3 options per stage
    python benchmarks/solver_speed.py --lengths 50 200 --repeats 3 --options 2
    python benchmarks/solver_speed.py --offload  # "optimal_offload" against L and slots (its own section)
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SHARES = ("25%", "40%", "70%")  # budgets, as shares of the store-all peak
OFFLOAD_MARK = '## `"optimal_offload"`'
BANDWIDTH = 5e6  # bytes per time unit each way: a 5 MB activation moves in about one stage's forward


def chain(L: int, seed: int, options: int = 0):
    """A heterogeneous chain: activations 0.1-10 MB, store-all bundles 1-30 MB, varied temps; with
    ``options``, that many store options per stage (keeping 20-80% of the bundle, backward up to
    1.5x slower), a measured-looking FB (0.8-1.0x the forward plus backward) and flops as a
    profile has them (about proportional to the times), so that ``"optimal"`` also runs its
    flops DP (the tie-break of ``docs/cost_model.md``)."""
    import numpy as np

    import jaxremat as jr

    rng = np.random.default_rng(seed)
    xbar, fwd, bwd = rng.integers(10**6, 3 * 10**7, L), rng.uniform(1, 3, L), rng.uniform(2, 5, L)
    fwd_tmp, bwd_tmp = rng.integers(0, 2 * 10**6, L), rng.integers(0, 2 * 10**6, L)
    v2 = {}
    if options:
        fb = (fwd + bwd) * rng.uniform(0.8, 1.0, L)
        flops = lambda t: t * 1e9 * rng.uniform(0.9, 1.1, np.shape(t))  # noqa: E731
        v2 = dict(
            fb=fb,
            fb_tmp=(xbar * rng.uniform(0.5, 1.0, L)).astype(int),
            fwd_flops=flops(fwd),
            bwd_flops=flops(bwd),
            fb_flops=flops(fb),
            options=[
                [
                    jr.StageOption(
                        f"policy{k}",
                        int(xbar[i] * rng.uniform(0.2, 0.8)),
                        t := float(bwd[i] * rng.uniform(1.0, 1.5)),
                        int(bwd_tmp[i] + rng.integers(0, 10**6)),
                        float(flops(t)),
                    )
                    for k in range(options)
                ]
                for i in range(L)
            ],
        )
    return jr.ChainCosts(
        x=rng.integers(10**5, 10**7, L + 1), xbar=xbar, fwd=fwd, bwd=bwd, fwd_tmp=fwd_tmp, bwd_tmp=bwd_tmp, **v2
    )


def child(L: int, slots: int, repeats: int, options: int = 0) -> dict:
    """Run in a subprocess: compile, then time the table fill and the whole solve."""
    import resource
    import time

    import jaxremat as jr
    from jaxremat.core.budgets import parse_budget
    from jaxremat.solvers import _dp_jax as dp_jax
    from jaxremat.solvers._discretise import discretise

    rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # noqa: E731  (MiB on Linux)
    import jax.numpy as jnp

    jnp.zeros(1).block_until_ready()  # JAX runtime up
    base_rss = rss()
    costs = chain(L, seed=0, options=options)
    budget = parse_budget("40%", costs)
    c = discretise(costs, budget, slots)
    t0 = time.perf_counter()
    dp_jax.program(c)  # compile
    compile_s = time.perf_counter() - t0
    dp_jax.table(c)  # first fill
    fills, solves = [], []
    for r in range(repeats):
        t0 = time.perf_counter()
        dp_jax.table(c)
        fills.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        sched = jr.solve(costs, budget, slots=slots)
        solves.append(time.perf_counter() - t0)
    by_share = {}  # pruning makes the fill depend on the budget
    for share in SHARES:
        ts = []
        for r in range(repeats):
            t0 = time.perf_counter()
            jr.solve(costs, share, slots=slots)
            ts.append(time.perf_counter() - t0)
        by_share[share] = round(sorted(ts)[len(ts) // 2], 3)
    compiles = dp_jax.compile_count()
    near = L - 3 if dp_jax.bucket(L - 3) == dp_jax.bucket(L) else L + 3  # similar depth, same bucket
    other = chain(near, seed=1, options=options)
    t0 = time.perf_counter()
    jr.solve(other, "40%", slots=slots)
    similar = time.perf_counter() - t0
    fill = sorted(fills)[len(fills) // 2]
    return dict(
        L=L,
        options=options + 1,
        slots=slots,
        compile_s=round(compile_s, 3),
        fill_s=round(fill, 3),
        solve_s=round(sorted(solves)[len(solves) // 2], 3),
        similar_depth=near,
        bucket=dp_jax.bucket(L),
        similar_depth_solve_s=round(similar, 3),
        recompiled_for_similar_depth=dp_jax.compile_count() > compiles,
        solve_s_by_budget=by_share,
        peak_rss_mib=round(rss(), 1),
        jax_runtime_rss_mib=round(base_rss, 1),
        table_mib=round(dp_jax.table_bytes(c) / 2**20, 1),
        overhead=round(sched.overhead, 4),
    )


def offload_rows(lengths: list[int], slot_counts: list[int], options: list[int], repeats: int) -> list[dict]:
    """Solve time of ``"optimal_offload"`` (median of ``repeats``) and its time against
    ``"optimal"``'s at 40% of store-all, in this process (the remat table's compile excluded)."""
    import time

    import jaxremat as jr

    rows = []
    for k in options:
        for L in lengths:
            costs = chain(L, seed=0, options=k)
            for slots in slot_counts:
                jr.solve(costs, "40%", slots=slots)  # compile the remat table's program
                ts = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    sched = jr.solve(costs, "40%", algorithm="optimal_offload", slots=slots, bandwidth=BANDWIDTH)
                    ts.append(time.perf_counter() - t0)
                remat = jr.solve(costs, "40%", slots=slots)
                row = dict(
                    L=L,
                    options=k + 1,
                    slots=slots,
                    solve_s=round(sorted(ts)[len(ts) // 2], 3),
                    offloads=len(sched.offloads),
                    overhead=round(sched.overhead, 4),
                    remat_overhead=round(remat.overhead, 4),
                )
                print(row, flush=True)
                rows.append(row)
    return rows


def write_offload_section(rows: list[dict], repeats: int) -> None:
    import jax

    lines = [
        OFFLOAD_MARK,
        "",
        f"Measured {datetime.date.today().isoformat()} on {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, jax {jax.__version__}; the same chains, budget 40% of store-all, bandwidth "
        f"{BANDWIDTH:.0e} bytes per time unit each way, median of {repeats}, in one process (the remat table's "
        'compile excluded: it is shared with `"optimal"`).',
        "",
        "Command: `python benchmarks/solver_speed.py --offload`",
        "",
        "| L | options per stage | slots | whole solve (s) | offloaded buffers | overhead with offload | overhead, "
        "remat alone |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['L']} | {r['options']} | {r['slots']} | {r['solve_s']} | {r['offloads']} | {r['overhead']} | "
        f"{r['remat_overhead']} |"
        for r in rows
    ]
    lines += [
        "",
        "The offload DP runs over the top-level steps with the remat DP's table for the recomputed segments: "
        "O(L^2 · S · G) with G the distinct sizes of offloadable buffers (at most about L · (options + 1)).",
    ]
    path = RESULTS / "solver.md"
    head = path.read_text().split(OFFLOAD_MARK)[0].rstrip() + "\n\n" if path.exists() else ""
    path.write_text(head + "\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[50, 100, 200, 400])
    parser.add_argument("--slots", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--options",
        type=int,
        nargs="+",
        default=[0, 2],
        help="store options per stage beyond store-all (default: 0 and 2)",
    )
    parser.add_argument("--offload", action="store_true", help='time "optimal_offload" instead (L 20..100, S 100..500)')
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.offload:
        RESULTS.mkdir(parents=True, exist_ok=True)
        write_offload_section(offload_rows([20, 40, 60, 100], [100, 250, 500], [0, 2], args.repeats), args.repeats)
        print((RESULTS / "solver.md").read_text().split(OFFLOAD_MARK)[1])
        return
    if args.child is not None:
        print(json.dumps(child(args.child, args.slots, args.repeats, args.options[0])))
        return
    rows = []
    for k in args.options:
        for L in args.lengths:
            cmd = [
                sys.executable,
                __file__,
                "--child",
                str(L),
                "--slots",
                str(args.slots),
                "--repeats",
                str(args.repeats),
                "--options",
                str(k),
            ]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ).stdout
            row = json.loads(out.strip().splitlines()[-1])
            print(row, flush=True)
            rows.append(row)
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(RESULTS / "solver.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    import jax

    lines = [
        '# Solver speed: `"optimal"` (the persistent DP)',
        "",
        f"Measured {datetime.date.today().isoformat()} on {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, jax {jax.__version__}, S = {args.slots} slots, budget 40% of store-all "
        f"(and {', '.join(SHARES)} for the solve), median of {args.repeats}. Each depth in a fresh process.",
        "",
        "Command: `python benchmarks/solver_speed.py`",
        "",
        "| L | options per stage | table fill (s) | whole solve (s) | whole solve at "
        + " / ".join(SHARES)
        + " (s) | compile (s) | "
        "similar depth: L, solve (s), recompiled? | solver memory (MiB) | table (MiB) | peak RSS, whole process "
        "(MiB) | "
        "JAX and jaxremat loaded (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['L']} | {r['options']} | {r['fill_s']} | {r['solve_s']} | "
            f"{' / '.join(str(v) for v in r['solve_s_by_budget'].values())} | "
            f"{r['compile_s']} | {r['similar_depth']}, {r['similar_depth_solve_s']}, "
            f"{'yes' if r['recompiled_for_similar_depth'] else 'no'} | "
            f"{round(r['peak_rss_mib'] - r['jax_runtime_rss_mib'], 1)} | {r['table_mib']} | {r['peak_rss_mib']} | "
            f"{r['jax_runtime_rss_mib']} |"
        )
    lines += [
        "",
        "`table fill` is the jitted DP alone; `whole solve` adds discretisation, the least-memory check, "
        "rebuilding the ops, replaying them and the baseline candidates. The fill skips splits that cannot "
        "win (a lower bound), so its time depends on the budget. `solver memory` is the peak RSS of the "
        "process less its RSS once JAX and jaxremat are loaded (before the solver): XLA compiling the "
        "table program (about 100 MiB, the same at every depth) and the table. The whole process also "
        "holds the JAX runtime and the imported libraries. The published C implementation of Rotor "
        "takes 7-9 s and about 2 GB at L = 200.",
    ]
    path = RESULTS / "solver.md"
    kept = (
        OFFLOAD_MARK + path.read_text().split(OFFLOAD_MARK)[1]
        if path.exists() and OFFLOAD_MARK in path.read_text()
        else ""
    )
    path.write_text("\n".join(lines) + "\n" + ("\n" + kept if kept else ""))
    print(path.read_text())


if __name__ == "__main__":
    main()
