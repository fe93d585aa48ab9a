"""A decoder written with ``nn.scan`` as MaxText writes it, against the hand policies its users
pick, written as they write them: ``nn.remat`` over the scanned layer with nothing saveable
(MaxText's ``full``), ``dots_with_no_batch_dims_saveable`` (``minimal``), ``dots_saveable`` and
``save_only_these_names`` over the attention projections (a ``save_dot_except_mlp``-style set).

For each policy: its training step's XLA temp (gradient, Adam, donated), step time and compile
time; then ``jaxremat.remat`` over the same decoder without remat (the scan is planned per layer
and run as loops; the names policy given as a store option, as its user would), given the
policy's measured memory as its budget: its XLA temp, step time and
compile time over the policy's, and the flops the profile predicts for both (XLA's cost analysis
counts a loop's body once, so its flops are not comparable between loops of different trip
counts; the profile counts every layer). Goal: at every policy's memory jaxremat fits and is no
slower; compile time at most 1.2x the policy's.

    python benchmarks/scan.py [layers] [width]

Writes ``benchmarks/results/scan.md``. CPU, ``cse_barrier_expander`` off, roofline time model.
"""

from __future__ import annotations

import datetime
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name

import jaxremat as jr
from jaxremat.api.calibrate import measured_optimizer
from jaxremat.api.verify import hand_strategies
from jaxremat.core.simulator import predicted_flops

POLICIES = {
    "full (nothing saveable)": None,
    "minimal (dots_with_no_batch_dims_saveable)": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "save_dot_except_mlp (names)": jax.checkpoint_policies.save_only_these_names(
        "query_proj", "key_proj", "value_proj", "out_proj"
    ),
}
# the hand strategy of jaxremat's schedule space each policy is: for the predicted flops
AS_SCHEDULE = {
    "full (nothing saveable)": "every stage checkpointed",
    "minimal (dots_with_no_batch_dims_saveable)": "every stage under dots_with_no_batch_dims_saveable",
    "dots_saveable": "every stage under dots_saveable",
    "save_dot_except_mlp (names)": "every stage under save_dot_except_mlp",
}


class Layer(nn.Module):
    width: int
    heads: int

    @nn.compact
    def __call__(self, h, _):
        name = checkpoint_name
        b, t, d = h.shape
        y = nn.LayerNorm()(h)
        q, k, v = (name(nn.Dense(d, name=n)(y), n) for n in ("query_proj", "key_proj", "value_proj"))
        split = lambda z: z.reshape(b, t, self.heads, d // self.heads)  # noqa: E731
        mask = jnp.tril(jnp.ones((t, t), bool))
        att = jnp.einsum("bthd,bshd->bhts", split(q), split(k)) / jnp.sqrt(d // self.heads)
        att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
        o = jnp.einsum("bhts,bshd->bthd", att, split(v)).reshape(b, t, d)
        h = h + name(nn.Dense(d, name="out")(o), "out_proj")
        y = nn.Dense(4 * d, name="mlp_up")(nn.LayerNorm()(h))
        return h + nn.Dense(d, name="mlp_down")(nn.gelu(y)), None


class Decoder(nn.Module):
    layers: int
    width: int
    heads: int
    vocab: int
    policy: Any = "none"  # "none": no remat; else nn.remat's policy (None: nothing saveable)

    @nn.compact
    def __call__(self, tokens):
        layer = Layer if self.policy == "none" else nn.remat(Layer, policy=self.policy, prevent_cse=False)
        stack = nn.scan(layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.layers)
        h = nn.Embed(self.vocab, self.width)(tokens)
        h, _ = stack(self.width, self.heads, name="layers")(h, None)
        return nn.Dense(self.vocab, name="head")(nn.LayerNorm()(h))


def loss_of(layers: int, width: int, heads: int, vocab: int, policy: Any = "none"):
    """The decoder's next-token loss ``loss(params, tokens)`` under ``policy`` (see :class:`Decoder`)."""
    model = Decoder(layers, width, heads, vocab, policy)

    def loss(params, tokens):
        logits = model.apply(params, tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()

    return loss


def compile_update(loss, params, tokens) -> tuple[Any, float]:
    """The training step of ``loss`` (gradient, Adam, parameters and state donated), compiled:
    ``compiled(params, state, tokens) -> (loss, params, state)``, and its compile seconds."""
    opt = measured_optimizer()

    def step(params, state, tokens):
        value, g = jax.value_and_grad(loss)(params, tokens)
        updates, state = opt.update(g, state, params)
        return value, optax.apply_updates(params, updates), state

    t0 = time.perf_counter()
    compiled = jr.jit(step, donate_argnums=(0, 1)).lower(params, opt.init(params), tokens).compile()
    return compiled, time.perf_counter() - t0


def measure(loss, params, tokens) -> tuple[int, Any, float]:
    """XLA temp of the step, the compiled step and its compile time (s)."""
    compiled, compile_s = compile_update(loss, params, tokens)
    return int(compiled.memory_analysis().temp_size_in_bytes), compiled, compile_s


def step_times(steps: list, params, tokens, rounds: int = 5, calls: int = 3) -> list[float]:
    """Median step time (s) of each compiled step, timed in interleaved rounds (this machine's
    timings drift by tens of percent between runs: a pair is compared within one run)."""
    carried = [(jax.tree.map(jnp.copy, params), measured_optimizer().init(params)) for _ in steps]
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(rounds):
        for j, step in enumerate(steps):
            p, s = carried[j]
            value, p, s = step(p, s, tokens)
            jax.block_until_ready(value)
            for _ in range(calls):
                t0 = time.perf_counter()
                value, p, s = step(p, s, tokens)
                jax.block_until_ready(value)
                times[j].append(time.perf_counter() - t0)
            carried[j] = (p, s)
    return [statistics.median(t) for t in times]


def main() -> None:
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 24
    width = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    heads, vocab, batch, seq = 4, 256, 4, 128
    tokens = jax.random.randint(jax.random.key(1), (batch, seq), 0, vocab)
    params = Decoder(layers, width, heads, vocab).init(jax.random.key(0), tokens)

    plain = loss_of(layers, width, heads, vocab)
    plain_temp, plain_step, plain_compile = measure(plain, params, tokens)
    (plain_time,) = step_times([plain_step], params, tokens)
    # the names policy as a store option, as a user who wrote it gives it (the defaults stay)
    names = {"save_dot_except_mlp": POLICIES["save_dot_except_mlp (names)"]}
    base = jr.remat(plain, None, method="xla", cache=False, policies=names)
    t0 = time.perf_counter()
    costs = base.plan(params, tokens).costs
    first_call = time.perf_counter() - t0
    rows = []
    for name, policy in POLICIES.items():
        memory, hand_step, c_hand = measure(loss_of(layers, width, heads, vocab, policy), params, tokens)
        hand = hand_strategies(costs).get(AS_SCHEDULE.get(name, ""))
        f_hand = predicted_flops(costs, hand.ops) if hand is not None else None
        try:
            f = base.with_budget(memory)
            plan = f.plan(params, tokens)
        except jr.InfeasibleBudget as e:
            (t_hand,) = step_times([hand_step], params, tokens)
            rows.append(
                f"| {name} | {jr.format_bytes(memory)} | refused (least {jr.format_bytes(e.min_budget)}) | | "
                f"{t_hand * 1e3:.1f} | | | MISSED |"
            )
            print(rows[-1], flush=True)
            continue
        temp, mine_step, c_mine = measure(f, params, tokens)
        t_hand, t_mine = step_times([hand_step, mine_step], params, tokens)
        f_mine = predicted_flops(costs, plan.schedule.ops)
        flops = f"{f_mine / f_hand:.3f}" if f_hand and f_mine else "n/a"
        verdict = "no slower" if t_mine <= t_hand * 1.03 else "SLOWER"
        rows.append(
            f"| {name} | {jr.format_bytes(memory)} | {temp / memory:.3f} | {flops} | {t_hand * 1e3:.1f} | "
            f"{t_mine / t_hand:.3f} | {c_mine / c_hand:.2f} | {verdict} |"
        )
        print(rows[-1], flush=True)
    lines = [
        "# A scanned decoder (nn.scan, as MaxText writes it) against its users' hand policies",
        "",
        f"Measured {datetime.date.today().isoformat()}, CPU, jax {jax.__version__}, `cse_barrier_expander` disabled; "
        f"{layers} layers, width {width}, {heads} heads, batch {batch} x {seq} tokens, vocab {vocab}; plans from "
        '`method="xla"`. Command: `python benchmarks/scan.py` (its last run: '
        f"`python benchmarks/scan.py {layers} {width}`)",
        "",
        f"No remat: XLA temp {jr.format_bytes(plain_temp)}, step {plain_time * 1e3:.1f} ms, compile "
        f"{plain_compile:.1f} s. jaxremat's first call (trace, profile of {costs.length} stages, plan, verification): "
        f"{first_call:.1f} s.",
        "",
        "| hand policy (nn.remat over the scanned layer) | its XLA temp | jaxremat temp / that | predicted flops, "
        "jaxremat / policy | policy step ms | jaxremat step / policy | jaxremat compile / policy | |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    out = Path(__file__).resolve().parent / "results" / "scan.md"
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())


if __name__ == "__main__":
    main()
