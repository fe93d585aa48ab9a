"""Training steps timed side by side, in interleaved rounds: each round visits the steps in a new
shuffled order and times a few consecutive calls of each after one untimed call, so that a slow
spell of the machine, a cold cache or a position in the order favours no strategy. (Timed one after
another, 3 calls each right after its compile, a GPT's ``remat every block`` and jaxremat's plan
at batch 6 measured 1.29x apart; interleaved, within 3% of each other; CPU, 2026-12-06.)

Used by :mod:`~jaxremat.tools.compare` (strategies at their memory) and :mod:`~jaxremat.tools.fit`
(strategies at their largest batch).
"""

from __future__ import annotations

import random
import time
from typing import Any, Callable, Sequence

import jax


class CarriedStep:
    """A compiled training step ``step(params, state, *rest) -> (loss, params, state)`` that
    donates its parameters and optimizer state, with the copies it carries from call to call."""

    def __init__(self, step: Callable, params: Any, state: Any, *rest: Any):
        self._step, self._params, self._state, self._rest = step, params, state, rest

    def __call__(self) -> None:
        """One step, waited for."""
        out = jax.block_until_ready(self._step(self._params, self._state, *self._rest))
        _, self._params, self._state = out


def interleaved(steps: Sequence[CarriedStep], *, rounds: int, calls: int, seed: int = 0) -> list[list[float]]:
    """The wall time of every timed call of each of ``steps``: ``rounds`` rounds, each in a new
    shuffled order, of one untimed call then ``calls`` timed ones of each."""
    order = random.Random(seed)
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(rounds):
        for j in order.sample(range(len(steps)), len(steps)):
            steps[j]()
            for _ in range(calls):
                t0 = time.perf_counter()
                steps[j]()
                times[j].append(time.perf_counter() - t0)
    return times


__all__ = ["CarriedStep", "interleaved"]
