"""The README's main job: a real Flax model profiled, planned for a budget, trained under the plan,
and measured by XLA next to the ``jax.checkpoint`` strategies users write by hand."""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxremat.model.chain import Chain
from jaxremat.tools.compare import compare
from jaxremat.core.compile import jit
from jaxremat.run.executor import execute
from jaxremat.api.planner import plan as make_plan
from jaxremat.api.calibrate import measured_loss
from jaxremat.profiling.profiler import profile_stages, report
from jaxremat.core.budgets import parse_budget, store_all_peak
from jaxremat.core.units import format_bytes

MANUAL = ("remat every block", "checkpoint whole chain", "policy dots_saveable")


def train(chain: Chain, forward: Any, variables: Any, x: Any, steps: int) -> tuple[list[float], float]:
    """``steps`` of Adam on a regression to fixed random targets; (losses, seconds per step)."""
    out = jax.eval_shape(lambda v: chain.apply(v, x), variables)
    target = jax.tree.map(lambda s: jax.random.normal(jax.random.key(7), s.shape, jnp.float32), out)
    params = {k: v for k, v in variables.items() if k == "params"} if isinstance(variables, dict) else variables
    opt = optax.adam(1e-3)

    def loss_fn(params: Any) -> jax.Array:
        y = forward({**variables, **params} if isinstance(variables, dict) else params, x)
        return sum(
            jnp.mean((a.astype(jnp.float32) - t) ** 2) for a, t in zip(jax.tree.leaves(y), jax.tree.leaves(target))
        )

    def update(params: Any, state: Any) -> tuple[Any, Any, jax.Array]:
        loss, g = jax.value_and_grad(loss_fn)(params)
        updates, state = opt.update(g, state, params)
        return optax.apply_updates(params, updates), state, loss

    step = jit(update, donate_argnums=(0, 1))  # the parameters and optimizer state are updated in place
    params = jax.tree.map(jnp.copy, params)  # the caller's stay usable: these are donated
    state, losses = opt.init(params), []
    params, state, loss = step(params, state)  # compile
    losses.append(float(loss))
    t0 = time.perf_counter()
    for _ in range(steps - 1):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    return losses, (time.perf_counter() - t0) / max(1, steps - 1)


def run_demo(
    label: str,
    model: Any,
    chain: Chain,
    variables: Any,
    x: Any,
    budget: Any = "50%",
    *,
    steps: int = 5,
    method: str = "measure",
    quiet: bool = False,
    calibrate: bool = False,
) -> None:
    shapes = jax.tree.map(lambda a: f"{a.dtype}{list(a.shape)}", x)
    print(f"jaxremat demo: {label} ({type(model).__name__}, {len(chain)} stages), input {shapes}\n")
    # the steps measured below apply jaxremat's mean-square loss to the output; plan for it
    costs, stages = profile_stages(chain, variables, x, method=method, quiet=quiet, loss=measured_loss)
    b = parse_budget(budget, costs)
    print(report(stages), "\n")
    p = make_plan(chain, variables, x, b, costs=costs, calibrate=calibrate)
    print(p.report(), "\n")

    f = execute(chain, p.schedule)
    losses, per_step = train(chain, lambda v, a: f(v, a)[0], variables, x, steps)
    plain, _ = train(chain, chain.apply, variables, x, steps)
    diff = max(abs(a - c) for a, c in zip(losses, plain))
    print(
        f"trained {steps} Adam steps under the plan: loss {losses[0]:.5f} -> {losses[-1]:.5f} "
        f"({per_step * 1e3:.1f} ms/step); the plain model's losses differ by at most {diff:.2g}\n"
    )

    print("measuring the training step under each strategy with XLA (compiled for real remat on the CPU)...")
    cmp = compare(
        label,
        chain,
        variables,
        x,
        costs,
        budgets=[],
        algorithms=("optimal",),
        manual=MANUAL,
        match=False,
        schedules=[p.schedule],
    )
    x0 = int(costs.x[0])
    print(
        f"\n{'strategy':<34} {'XLA temp':>11} {'predicted':>11} {'flops':>6} {'time':>6}   (flops and time over no "
        "remat)"
    )
    for q in cmp.points:
        pred = format_bytes(q.predicted_peak) if q.predicted_peak is not None else ""
        name = "jaxremat optimal" if q.kind == "jaxremat" else q.strategy
        print(f"{name:<34} {format_bytes(q.temp):>11} {pred:>11} {cmp.flops_ratio(q):>6.2f} {cmp.overhead(q):>6.2f}")
    mine = next(q for q in cmp.points if q.kind == "jaxremat")
    print(
        f"\nbudget {format_bytes(b)} ({b / store_all_peak(costs):.0%} of store-all, the input a_0 of "
        f"{format_bytes(x0)} included): predicted peak {format_bytes(mine.predicted_peak + x0)}, XLA-measured "
        f"{format_bytes(mine.temp + x0)} ({mine.temp / mine.predicted_peak:.2f}x predicted); time over no remat "
        f"predicted {mine.predicted_overhead:.2f}x, measured {cmp.overhead(mine):.2f}x."
    )
    fits = [q for q in cmp.points if q.kind == "manual" and q.temp + x0 <= b]
    if fits:
        best = min(fits, key=cmp.overhead)
        print(f"fastest hand-written strategy within the budget: {best.strategy} at {cmp.overhead(best):.2f}x.")
    else:
        print("no hand-written strategy above fits within the budget.")
