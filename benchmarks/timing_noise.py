"""How noisy is this machine's wall clock, and which statistic over several timings resists it?

Times a convolution and its gradient (the programs of a small residual stage) the way the
profiler does (:func:`jaxremat.profiling.timing.interleaved_times`: ``--rounds`` interleaved
rounds, the fastest kept), once every ``--gap`` seconds for ``--seconds``. Then splits the
timings into consecutive groups of k (k = 1 to 4), as k timings of one profile, and reports how
often one group's statistic (the fastest, or the middle timing) differs from the next group's by
more than 15%: what two profiles in a row would see with that statistic. Writes
``benchmarks/results/timing_noise.md``.

    python benchmarks/timing_noise.py [--seconds 150 --gap 1.0 --rounds 5]
"""

from __future__ import annotations

import argparse
import datetime
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxremat.profiling.timing import interleaved_times

RESULTS = Path(__file__).resolve().parent / "results"
DIMS = ("NHWC", "HWIO", "NHWC")


def programs() -> dict:
    """A 3x3 convolution with a relu (16 x 32 x 32 x 32) and its gradient in both operands."""

    def loss(x, k):
        return jnp.sum(jax.nn.relu(jax.lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=DIMS)) ** 2)

    x, k = jnp.ones((16, 32, 32, 32)), jnp.ones((3, 3, 32, 32)) * 0.01
    return {"convolution": (jax.jit(loss), (x, k)), "its gradient": (jax.jit(jax.grad(loss, argnums=(0, 1))), (x, k))}


def spreads(times: np.ndarray, k: int, statistic) -> np.ndarray:
    """``|a - b| / max(a, b)`` between consecutive groups of ``k`` timings, each reduced by ``statistic``."""
    groups = np.array([statistic(times[i : i + k]) for i in range(0, len(times) - k + 1, k)])
    return np.abs(np.diff(groups)) / np.maximum(groups[1:], groups[:-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=150.0)
    parser.add_argument("--gap", type=float, default=1.0, help="seconds between two timings")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per timing (the profiler's repeats)")
    args = parser.parse_args()
    progs = programs()
    rows, end = [], time.time() + args.seconds
    while time.time() < end:
        rows.append(interleaved_times(progs, args.rounds))
        time.sleep(args.gap)
    names = list(progs)
    t = np.array([[r[n] for n in names] for r in rows])
    lines = [
        "# Wall-clock noise and the statistic over several timings",
        "",
        f"Measured {datetime.date.today().isoformat()}, CPU, jax {jax.__version__}. Command: "
        f"`python benchmarks/timing_noise.py --seconds {args.seconds:g} --gap {args.gap:g} --rounds {args.rounds}`",
        "",
        f"{len(rows)} timings of each program ({args.rounds} interleaved rounds each, the fastest kept), one every "
        f"{args.gap:g} s or so. Fastest / slowest timing: "
        + ", ".join(f"{n} {1e3 * t[:, j].min():.2f} / {1e3 * t[:, j].max():.2f} ms" for j, n in enumerate(names))
        + ".",
        "",
        "Consecutive groups of k timings, each group reduced to one time: the share of neighbouring groups more "
        "than 15% apart, and the largest and mean `|a - b| / max(a, b)`.",
        "",
        "| program | statistic | k = 1 | k = 2 | k = 3 | k = 4 |",
        "|---|---|---|---|---|---|",
    ]
    for j, n in enumerate(names):
        for label, stat in (("fastest", np.min), ("middle", np.median)):
            cells = []
            for k in (1, 2, 3, 4):
                s = spreads(t[:, j], k, stat)
                cells.append(f"{(s > 0.15).mean():.0%} (max {s.max():.0%}, mean {s.mean():.1%})")
            lines.append(f"| {n} | {label} | " + " | ".join(cells) + " |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "timing_noise.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
