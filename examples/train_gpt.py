"""Train a GPT-style decoder on synthetic tokens under a memory budget (about a minute on a CPU).

    python examples/train_gpt.py [--steps 30] [--budget 35%]

Sequences follow a fixed random permutation of the vocabulary (token t is followed by perm[t]),
so next-token prediction is learnable. The same model trains with and without the plan from the
same seeds: the losses agree, the step uses less memory, and the time overhead is printed next
to the plan's prediction.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxremat as jr
from jaxremat.models import gpt

from _common import report, train  # noqa: E402  (same folder)

BATCH, TOKENS, VOCAB = 8, 128, 256


def batches(seed: int = 0):
    rng = np.random.default_rng(seed)
    perm = rng.permutation(VOCAB)
    while True:
        seq = np.empty((BATCH, TOKENS + 1), np.int32)
        seq[:, 0] = rng.integers(0, VOCAB, BATCH)
        for t in range(TOKENS):
            seq[:, t + 1] = perm[seq[:, t]]
        yield seq[:, :-1], seq[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--budget", default="35%")
    args = parser.parse_args()
    model = gpt(blocks=8, width=128, heads=4, vocab=VOCAB)
    wrapped = jr.remat_chain(args.budget)(model)
    x0 = jnp.zeros((BATCH, TOKENS), jnp.int32)
    variables = wrapped.init(jax.random.key(0), x0)
    plan = wrapped.plan(variables, x0)  # profiles the stages (cached on disk) and solves
    print(plan.report())

    def loss_fn(apply):
        return lambda v, batch: optax.softmax_cross_entropy_with_integer_labels(apply(v, batch[0]), batch[1]).mean()

    plain = train(loss_fn(model.apply), variables, batches(), args.steps, jax.jit)
    remat = train(loss_fn(wrapped.apply), variables, batches(), args.steps, jr.jit)
    report("GPT-style decoder", plan, plain, remat)


if __name__ == "__main__":
    main()
