"""Train an MLP with optax under a memory budget and compare with the plain model.

    python examples/train_mlp.py [--steps 300] [--budget 50%]

Both runs start from the same seeds; the losses agree step by step (remat changes what is
stored, not what is computed).
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxremat as jr


def make_model() -> nn.Sequential:
    layers = []
    for _ in range(6):
        layers += [nn.Dense(256), nn.gelu]
    return nn.Sequential(layers + [nn.Dense(1)])


def train(apply, variables, steps: int, jit) -> list[float]:
    opt = optax.adam(1e-3)
    state = opt.init(variables)
    rng = np.random.default_rng(0)
    w = rng.normal(size=(32, 1)).astype(np.float32)

    @jit
    def step(v, s, x, y):
        loss, g = jax.value_and_grad(lambda v: jnp.mean((apply(v, x) - y) ** 2))(v)
        updates, s = opt.update(g, s, v)
        return optax.apply_updates(v, updates), s, loss

    losses = []
    for _ in range(steps):
        x = rng.normal(size=(256, 32)).astype(np.float32)
        variables, state, loss = step(variables, state, x, np.tanh(x @ w))
        losses.append(float(loss))
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--budget", default="50%")
    args = parser.parse_args()
    model = make_model()
    wrapped = jr.remat_chain(args.budget, method="xla")(model)
    x0 = jnp.zeros((256, 32))
    variables = wrapped.init(jax.random.key(0), x0)
    plan = wrapped.plan(variables, x0)
    print(plan.report())
    plain = train(model.apply, variables, args.steps, jax.jit)
    remat = train(wrapped.apply, variables, args.steps, jr.jit)
    diff = max(abs(a - b) for a, b in zip(plain, remat))
    print(
        f"\nloss after {args.steps} steps: plain {plain[-1]:.6f}, under the plan {remat[-1]:.6f}; "
        f"largest difference over the run {diff:.2e}"
    )
    print(
        f"predicted activation peak {jr.format_bytes(plan.predicted_peak)} "
        f"(store-all {jr.format_bytes(jr.store_all_peak(plan.costs))}), "
        f"predicted time overhead {plan.predicted_overhead:.3f}x"
    )


if __name__ == "__main__":
    main()
