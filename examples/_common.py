"""Shared by the examples: train with optax and report memory and time against the plain model."""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import optax

import jaxremat as jr


def train(
    loss_fn: Callable, variables: Any, batches: Iterator, steps: int, jit: Callable
) -> tuple[list[float], float, int]:
    """Adam for ``steps`` batches, the variables and optimizer state donated (so XLA reuses their
    buffers, as a training loop should). Returns (losses, seconds per step after the first, XLA
    temp bytes of the compiled step)."""
    opt = optax.adam(1e-3)

    def step(v, s, batch):
        loss, g = jax.value_and_grad(loss_fn)(v, batch)
        updates, s = opt.update(g, s, v)
        return optax.apply_updates(v, updates), s, loss

    variables = jax.tree.map(jnp.copy, variables)  # the caller's stay usable: these are donated
    state = opt.init(variables)
    first = next(batches)
    compiled = jit(step, donate_argnums=(0, 1)).lower(variables, state, first).compile()
    temp = int(compiled.memory_analysis().temp_size_in_bytes)
    losses, t0 = [], None
    batch = first
    for i in range(steps):
        variables, state, loss = compiled(variables, state, batch)
        losses.append(float(loss))  # waits for the step
        if i == 0:
            t0 = time.perf_counter()
        batch = next(batches)
    return losses, (time.perf_counter() - t0) / max(1, steps - 1), temp


def run(name: str, model, budget, x0, batches, steps: int) -> None:
    """Wrap ``model`` with ``remat_chain(budget)``, print the plan, train the plain and the wrapped
    model from the same seeds on ``batches()`` (cross-entropy on integer labels) and report."""
    import optax

    wrapped = jr.remat_chain(budget)(model)
    variables = wrapped.init(jax.random.key(0), x0)
    plan = wrapped.plan(variables, x0)  # profiles the stages (cached on disk) and solves
    print(plan.report())

    def loss_fn(apply):
        return lambda v, batch: optax.softmax_cross_entropy_with_integer_labels(apply(v, batch[0]), batch[1]).mean()

    plain = train(loss_fn(model.apply), variables, batches(), steps, jax.jit)
    remat = train(loss_fn(wrapped.apply), variables, batches(), steps, jr.jit)
    report(name, plan, plain, remat)


def report(name: str, plan: jr.Plan, plain: tuple, remat: tuple) -> None:
    (l0, t0, m0), (l1, t1, m1) = plain, remat
    diff = max(abs(a - b) for a, b in zip(l0, l1))
    print(
        f"\n{name}: {len(l0)} steps, loss {l0[0]:.4f} -> {l0[-1]:.4f} (plain) and {l1[0]:.4f} -> {l1[-1]:.4f} "
        f"(under the plan); largest difference {diff:.2e}"
    )
    print(
        f"XLA temp memory of the training step: plain {jr.format_bytes(m0)}, under the plan "
        f"{jr.format_bytes(m1)} ({1 - m1 / m0:.0%} saved; plan predicted activations "
        f"{jr.format_bytes(plan.predicted_peak)} of store-all {jr.format_bytes(jr.store_all_peak(plan.costs))})"
    )
    print(
        f"step time: plain {t0 * 1e3:.1f} ms, under the plan {t1 * 1e3:.1f} ms ({t1 / t0:.2f}x; "
        f"plan predicted {plan.predicted_overhead:.2f}x)"
    )
