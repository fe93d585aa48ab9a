"""Do two profiles of the same model agree? Per-stage times of two profiles in a row (cache off).

For each built-in model (`jaxremat.tools.models`), profile it twice with ``method="measure"`` and
no cache, and report per stage the relative difference of the forward, backward and FB times
(``|a - b| / max(a, b)``) and of each store option's backward: the largest and the median over the
stages, and the stages beyond 15%, apart from those whose programs take under 1% of the model's
forward and backward time (tens of microseconds, where the dispatch of one call is most of what
is timed), which are listed with their absolute difference. Writes
``benchmarks/results/profile_stability.md``.

    python benchmarks/profile_stability.py [--models resnet gpt autoencoder mixer]
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import jax
import numpy as np

import jaxremat as jr
from jaxremat.profiling import profile_stages
from jaxremat.tools.models import SAMPLES, sample_input


def spread(a: float, b: float) -> float:
    return abs(a - b) / max(a, b, 1e-12)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(SAMPLES), choices=list(SAMPLES))
    args = parser.parse_args()
    lines = [
        '# Two profiles in a row (`method="measure"`, cache off)',
        "",
        f"Measured {datetime.date.today().isoformat()}, CPU, jax {jax.__version__}. "
        "Command: `python benchmarks/profile_stability.py`",
        "",
        "Per stage, `|a - b| / max(a, b)` of the two profiles' times (identical stages are measured once per "
        "profile, so each distinct stage counts once). A *small* stage's programs each take under 1% of the "
        "model's forward and backward time: its spread is listed apart, with the largest absolute difference.",
        "",
        "| model | distinct stages | fwd: max / median | bwd: max / median | FB: max / median | options' bwd: max | "
        "stages beyond 15% | small stages beyond 15% |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in args.models:
        factory, shape, dtype = SAMPLES[name]
        model, x = factory(), sample_input(shape, dtype)
        chain = jr.Chain.from_linen(model)
        v = model.init(jax.random.key(0), x)
        runs = [profile_stages(chain, v, x, cache=False, quiet=True)[1] for _ in range(2)]
        total = sum(s.fwd_time + s.bwd_time for s in runs[0])
        seen, rows, small = set(), [], {}
        for i, (a, b) in enumerate(zip(*runs)):
            key = (a.kind, a.out_shape, a.fwd_flops, a.bwd_flops)
            if key in seen:
                continue
            seen.add(key)
            pairs = [(a.fwd_time, b.fwd_time), (a.bwd_time, b.bwd_time), (a.fb_time, b.fb_time)]
            pairs += [(p.bwd_time, q.bwd_time) for p, q in zip(a.options, b.options)]
            small[a.name] = max(max(p) for p in pairs) < 0.01 * total, max(abs(p - q) for p, q in pairs)
            opts = [spread(p.bwd_time, q.bwd_time) for p, q in zip(a.options, b.options)]
            rows.append(
                (
                    a.name,
                    spread(a.fwd_time, b.fwd_time),
                    spread(a.bwd_time, b.bwd_time),
                    spread(a.fb_time, b.fb_time),
                    max(opts, default=0.0),
                )
            )
        arr = np.array([r[1:] for r in rows])

        def listed(r):
            return (
                f"{r[0]} ({', '.join(f'{n} {v:.0%}' for n, v in zip(('fwd', 'bwd', 'FB', 'opt'), r[1:]) if v > 0.15)})"
            )

        beyond = [listed(r) for r in rows if max(r[1:]) > 0.15 and not small[r[0]][0]]
        tiny = [
            f"{listed(r)[:-1]}; at most {1e6 * small[r[0]][1]:.0f} us)"
            for r in rows
            if max(r[1:]) > 0.15 and small[r[0]][0]
        ]
        lines.append(
            f"| {name} | {len(rows)} | {arr[:, 0].max():.0%} / {np.median(arr[:, 0]):.0%} | "
            f"{arr[:, 1].max():.0%} / {np.median(arr[:, 1]):.0%} | {arr[:, 2].max():.0%} / "
            f"{np.median(arr[:, 2]):.0%} | "
            f"{arr[:, 3].max():.0%} | {'; '.join(beyond) or 'none'} | {'; '.join(tiny) or 'none'} |"
        )
        print(lines[-1], flush=True)
    out = Path(__file__).resolve().parent / "results" / "profile_stability.md"
    out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
