"""Compile time of a deep transformer under jaxremat against nn.scan(nn.remat(block)).

    python benchmarks/compile_time.py [--blocks 48]

With ``scan=True`` runs of identical stages execute as one ``lax.scan``. Writes ``benchmarks/results/compile_time.md``.
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
from jaxremat.profiler import Rates
from profile_fidelity import TransformerBlock  # noqa: E402  (same directory)

WIDTH, HEADS, TOKENS, BATCH = 128, 4, 64, 2


class Scanned(nn.Module):
    """The hand-written baseline: nn.scan over nn.remat(block)."""

    blocks: int

    @nn.compact
    def __call__(self, x):
        block = nn.scan(
            nn.remat(lambda mdl, x, _: (TransformerBlock(HEADS, WIDTH, parent=mdl)(x), None)),
            variable_axes={"params": 0}, split_rngs={"params": True}, length=self.blocks,
        )
        return block(self, x, None)[0]


def compile_seconds(fn, *args) -> float:
    t0 = time.perf_counter()
    jax.jit(fn).lower(*args).compile(jr.compiler_options())
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=48)
    args = parser.parse_args()
    x = jnp.ones((BATCH, TOKENS, WIDTH))
    base = Scanned(args.blocks)
    bv = base.init(jax.random.key(0), x)
    t_base = compile_seconds(jax.grad(lambda v: jnp.mean(base.apply(v, x) ** 2)), bv)
    rows = [("nn.scan(nn.remat(block))", t_base, "")]
    model = nn.Sequential([TransformerBlock(HEADS, WIDTH) for _ in range(args.blocks)])
    chain = jr.Chain.from_linen(model)
    v = chain.init(jax.random.key(0), x)
    costs = jr.profile(chain, v, x, method="xla", rates=Rates(1e10, 1e10), quiet=True)
    for algorithm, budget in (("every_stage", None), ("sqrt", None), ("optimal", "50%"), ("optimal", "30%")):
        sched = jr.solve(costs, budget, algorithm=algorithm)
        for scan in (False, True):
            f = jr.execute(chain, sched, scan=scan)
            t = compile_seconds(jax.grad(lambda v: jnp.mean(f(v, x)[0] ** 2)), v)
            name = f"jaxremat {algorithm}" + (f" at {budget}" if budget else "") + (", scan=True" if scan else "")
            rows.append((name, t, f"{sched.overhead:.3f}"))
    lines = [
        f"# Compile time, {args.blocks} transformer blocks (width {WIDTH}, {TOKENS} tokens), CPU",
        "",
        f"Measured {datetime.date.today().isoformat()}, jax {jax.__version__}. Command: "
        f"`python benchmarks/compile_time.py --blocks {args.blocks}`",
        "",
        "| step (loss and gradients) | compile time (s) | over nn.scan(nn.remat) | planned time overhead |",
        "|---|---|---|---|",
    ]
    lines += [f"| {name} | {t:.2f} | {t / t_base:.2f}x | {ov} |" for name, t, ov in rows]
    out = Path(__file__).resolve().parent / "results" / "compile_time.md"
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())


if __name__ == "__main__":
    main()
