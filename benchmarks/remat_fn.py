"""``jaxremat.remat`` on a model written the usual way, against ``remat_chain`` on a Sequential.

A 24-block GPT-style decoder written with a Python loop over its blocks (``__call__`` calls
them in turn) is planned by ``jaxremat.remat`` (cut from its jaxpr at the blocks' module scope),
and the same blocks as an ``nn.Sequential`` by ``remat_chain``. For budgets of 30%, 50% and 75%:
compile time of the training step (loss and gradients, CPU, remat made real), XLA's temp
against the plan's peak, and the temp against the plain step's.

Second table: a U-Net whose encoder outputs are added to the decoder's (skip tensors carried by
many activations, one buffer each in XLA): the plan counting them once (``ChainCosts.shared``)
against the plan that counts them in every activation that carries them, at the same budgets.
Writes ``benchmarks/results/remat_fn.md``.

    python benchmarks/remat_fn.py
"""

from __future__ import annotations

import datetime
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp

import jaxremat as jr
from jaxremat.tools.models import DecoderBlock, Embed, LMHead, gpt, sample_input

BLOCKS, WIDTH, HEADS, VOCAB, SHAPE = 24, 64, 4, 256, (4, 128)


class LoopDecoder(nn.Module):
    """The same decoder, written as a Python loop in ``__call__``."""

    @nn.compact
    def __call__(self, tok):
        x = Embed(VOCAB, WIDTH)(tok)
        for _ in range(BLOCKS):
            x = DecoderBlock(WIDTH, HEADS)(x)
        return LMHead(VOCAB)(x)


class UNet(nn.Module):
    """Four levels, two convolutions each, encoder outputs added after upsampling."""

    @nn.compact
    def __call__(self, x):
        skips = []
        for f in (16, 32, 64, 128):
            x = nn.gelu(nn.Conv(f, (3, 3))(nn.gelu(nn.Conv(f, (3, 3))(x))))
            skips.append(x)
            x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = nn.gelu(nn.Conv(128, (3, 3))(x))
        for f, s in zip((128, 64, 32, 16), reversed(skips)):
            x = jax.image.resize(nn.gelu(nn.Conv(f, (3, 3))(x)), s.shape, "nearest") + s
            x = nn.gelu(nn.Conv(f, (3, 3))(x))
        return nn.Conv(3, (1, 1))(x)


def unet_rows() -> list[str]:
    """The U-Net table: shared skips against skips counted in every activation."""
    m = UNet()
    x = jax.random.normal(jax.random.key(1), (8, 64, 64, 3))
    v = m.init(jax.random.key(0), x)
    loss = lambda v, x: jnp.mean((m.apply(v, x) - x) ** 2)  # noqa: E731
    _, plain_temp = _compile(loss, v, x)
    fn = jr.remat(loss, "50%", method="xla")
    costs = fn.plan(v, x).schedule.costs
    base = jr.simulate(costs, jr.solve(costs, None, algorithm="store_all").ops).time
    lines = [
        "",
        f"## A U-Net ({costs.length} stages, {len(costs.shared)} skip tensors of "
        f"{', '.join(jr.format_bytes(s.nbytes) for s in costs.shared)}), input 8 x 64 x 64 x 3",
        "",
        f"Plain step: XLA temp {jr.format_bytes(plain_temp)}. Bytes made from constants at the step's start "
        f"(`held`): {jr.format_bytes(int(costs.held.sum()))}. Times are the plans' predictions over store-all.",
        "",
        "| budget | skips counted once: time | XLA temp | temp / plan | temp / plain | counted in every activation: "
        "time |",
        "|---|---|---|---|---|---|",
    ]
    for budget in ("30%", "50%", "75%"):
        f = fn.with_budget(budget)
        sched = f.plan(v, x).schedule
        _, temp = _compile(f, v, x)
        try:
            blind = f"{jr.solve(costs.without_shared(), sched.budget).time / base:.3f}x"
        except jr.InfeasibleBudget as e:
            blind = f"does not fit (least {jr.format_bytes(e.min_budget)})"
        lines.append(
            f"| {budget} | {sched.time / base:.3f}x | {jr.format_bytes(temp)} | {temp / sched.peak:.2f} | "
            f"{temp / plain_temp:.2f} | {blind} |"
        )
        print(lines[-1], flush=True)
    return lines


def _loss(apply):
    def loss(v, tok):
        logits = apply(v, tok)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tok[..., None], -1))

    return loss


def _compile(fn, *args):
    t0 = time.perf_counter()
    compiled = jr.jit(jax.value_and_grad(fn)).lower(*args).compile()
    return time.perf_counter() - t0, int(compiled.memory_analysis().temp_size_in_bytes)


def main() -> None:
    tok = sample_input(SHAPE, "int32", high=VOCAB)
    loop, seq = LoopDecoder(), gpt(blocks=BLOCKS, width=WIDTH, heads=HEADS, vocab=VOCAB)
    v_loop, v_seq = loop.init(jax.random.key(0), tok), seq.init(jax.random.key(0), tok)
    plain_s, plain_temp = _compile(_loss(loop.apply), v_loop, tok)
    fn = jr.remat(_loss(loop.apply), "50%", method="xla")
    chained = jr.remat_chain("50%", method="xla")(seq)
    rows = []
    for budget in ("30%", "50%", "75%"):
        f, m = fn.with_budget(budget), chained.with_budget(budget)
        f.plan(v_loop, tok), jr.plan(m, v_seq, tok)  # plans made before the timed compiles
        fs, ft = _compile(f, v_loop, tok)
        ms, mt = _compile(_loss(m.apply), v_seq, tok)
        rows.append((budget, f.plan(v_loop, tok), fs, ft, jr.plan(m, v_seq, tok), ms, mt))
        print(budget, round(fs, 2), round(ms, 2), ft, mt, flush=True)
    how = fn.plan(v_loop, tok).schedule.note
    lines = [
        "# `jaxremat.remat` on a decoder written as a Python loop, against `remat_chain` on a Sequential",
        "",
        f"Measured {datetime.date.today().isoformat()}, CPU, jax {jax.__version__}, `cse_barrier_expander` disabled; "
        f"{BLOCKS} blocks, width {WIDTH}, {HEADS} heads, vocab {VOCAB}, {SHAPE[0]} x {SHAPE[1]} tokens; plans from "
        '`method="xla"`. Command: `python benchmarks/remat_fn.py`',
        "",
        f"`remat` cut: {how}. Plain step (no remat): compile {plain_s:.1f} s, XLA temp {jr.format_bytes(plain_temp)}.",
        "",
        "| budget | `remat`: compile s | over `remat_chain` | XLA temp | temp / plan | temp / plain | "
        "`remat_chain`: compile s | XLA temp | temp / plan |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for budget, fp, fs, ft, mp, ms, mt in rows:
        lines.append(
            f"| {budget} | {fs:.1f} | {fs / ms:.2f}x | {jr.format_bytes(ft)} | {ft / fp.schedule.peak:.2f} | "
            f"{ft / plain_temp:.2f} | {ms:.1f} | {jr.format_bytes(mt)} | {mt / mp.schedule.peak:.2f} |"
        )
    lines += unet_rows()
    out = Path(__file__).resolve().parent / "results" / "remat_fn.md"
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())


if __name__ == "__main__":
    main()
