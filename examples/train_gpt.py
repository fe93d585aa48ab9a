"""Train a GPT-style decoder on synthetic tokens under a memory budget (about a minute on a CPU).

    python examples/train_gpt.py [--steps 30] [--budget 35%] [--stacked]

Sequences follow a fixed random permutation of the vocabulary (token t is followed by perm[t]),
so next-token prediction is learnable. The same model trains with and without the plan from the
same seeds: the losses agree, the step uses less memory, and the time overhead is printed next
to the plan's prediction. With ``--stacked`` the blocks are one ``jaxremat.Repeat`` (parameters
stacked, as with ``nn.scan``), run as one loop.
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
import numpy as np

from jaxremat.tools.models import gpt

from _common import run  # noqa: E402  (same folder)

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
    parser.add_argument("--stacked", action="store_true", help="the blocks as one jaxremat.Repeat")
    args = parser.parse_args()
    model = gpt(blocks=8, width=128, heads=4, vocab=VOCAB, stacked=args.stacked)
    name = "GPT-style decoder" + (" (Repeat)" if args.stacked else "")
    run(name, model, args.budget, jnp.zeros((BATCH, TOKENS), jnp.int32), batches, args.steps)


if __name__ == "__main__":
    main()
