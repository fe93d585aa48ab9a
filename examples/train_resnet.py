"""Train a ResNet-style CNN on synthetic images under a memory budget (about a minute on a CPU).

    python examples/train_resnet.py [--steps 40] [--budget 50%]

Ten classes of 32x32 images, each a fixed random pattern plus noise. The same model trains with
and without the plan from the same seeds: the losses agree, the step uses less memory, and the
time overhead is printed next to the plan's prediction.
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
import numpy as np

from jaxremat.tools.models import resnet

from _common import run  # noqa: E402  (same folder)

BATCH, CLASSES = 32, 10


def batches(seed: int = 0):
    rng = np.random.default_rng(seed)
    patterns = rng.normal(size=(CLASSES, 32, 32, 3)).astype(np.float32)
    while True:
        y = rng.integers(0, CLASSES, BATCH)
        x = patterns[y] + 2.0 * rng.normal(size=(BATCH, 32, 32, 3)).astype(np.float32)
        yield x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--budget", default="50%")
    args = parser.parse_args()
    model = resnet(blocks=(2, 2, 2), width=16, classes=CLASSES)
    run("ResNet-style CNN", model, args.budget, jnp.zeros((BATCH, 32, 32, 3)), batches, args.steps)


if __name__ == "__main__":
    main()
