"""Wall-clock times a plan can trust: the programs of a stage timed in interleaved rounds.

A busy machine drifts over seconds; timing one program after another puts the drift into their
differences. Here every round calls each program (several times back to back when it is short),
in a new order, after a warm-up call of each, and the fastest round is kept. A backward measured far below what its flops say
next to its forward is timed again with more rounds (:func:`check_against_flops`).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import jax
import numpy as np

Program = tuple[Callable[..., Any], tuple]  # a compiled function and its arguments


# Each program runs back to back within a round until the round's calls add up to this (at most
# MAX_CALLS calls): a program of a fraction of a millisecond timed by one call measures the
# dispatch and the scheduler's jitter more than itself (two profiles in a row disagreed by up to
# 39% on such stages, a few percent on the others). At 5 ms, programs of 1-5 ms still ran once
# to four times a round and the autoencoder's two profiles disagreed by 12-18% at worst in four
# pairs (15% or less in one); at 20 ms, by 7-18% in three (15% or less in two).
ROUND_SECONDS = 20e-3
MAX_CALLS = 100

# The statistic over the rounds: the fastest. Noise on a shared machine only adds time, and it
# comes in bursts that hit several rounds in a row: with the median of 5 rounds, two runs of two
# profiles in a row each had a stage of the four built-in models beyond 15% (the autoencoder's
# 4:Down; its 6:Up and the ResNet's stem: 17-36%, different stages each time); with the fastest
# round, two runs had none (every stage of at least 1% of the model's time within 15%).
STATISTIC = np.min


def _calls(fn: Callable[..., Any], args: tuple) -> int:
    """Calls per round for ``fn``: enough to fill :data:`ROUND_SECONDS`, from one timed call."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    took = time.perf_counter() - t0
    return int(min(MAX_CALLS, max(1, np.ceil(ROUND_SECONDS / max(took, 1e-9)))))


def interleaved_times(programs: dict[str, Program], rounds: int, seed: int = 0) -> dict[str, float]:
    """Each program's wall time per call (seconds): the fastest of ``rounds`` interleaved rounds
    (:data:`STATISTIC`); within a round a short program runs several times back to back."""
    for fn, args in programs.values():  # warm up: first calls allocate and page in
        jax.block_until_ready(fn(*args))
    names = list(programs)
    calls = {n: _calls(*programs[n]) for n in names}
    times: dict[str, list[float]] = {n: [] for n in names}
    order = np.random.default_rng(seed)
    for _ in range(max(rounds, 1)):
        for j in order.permutation(len(names)):
            fn, args = programs[names[j]]
            c = calls[names[j]]
            t0 = time.perf_counter()
            for _ in range(c - 1):
                fn(*args)
            jax.block_until_ready(fn(*args))
            times[names[j]].append((time.perf_counter() - t0) / c)
    return {n: float(STATISTIC(t)) for n, t in times.items()}


# A backward below this share of the time its flops predict from the forward's rate is suspect.
SUSPECT = 0.25


def suspect(fwd_time: float, bwd_time: float, fwd_flops: float, bwd_flops: float) -> bool:
    """Whether a backward's time is far below its share of flops next to its forward's."""
    if fwd_time <= 0 or fwd_flops <= 0 or bwd_flops <= 0:
        return False
    return bwd_time < SUSPECT * fwd_time * (bwd_flops / fwd_flops)


def check_against_flops(
    programs: dict[str, Program], rounds: int, flops: dict[str, float], backward: dict[str, str]
) -> tuple[dict[str, float], list[str]]:
    """Interleaved times of ``programs`` (:func:`interleaved_times`); every backward
    (``backward[name]`` is its forward's name) measured far below its share of flops is timed
    again with four times the rounds, and named in the returned flags if it still is."""
    t = interleaved_times(programs, rounds)
    bad = [b for b, f in backward.items() if suspect(t[f], t[b], flops[f], flops[b])]
    flags: list[str] = []
    if bad:
        again = interleaved_times({n: programs[n] for n in {*bad, *(backward[b] for b in bad)}}, 4 * rounds, seed=1)
        t.update(again)
        flags = [
            f"{b} time {1e3 * t[b]:.3g} ms is below {SUSPECT:.0%} of its flops' share next to {backward[b]}"
            for b in bad if suspect(t[backward[b]], t[b], flops[backward[b]], flops[b])
        ]
    return t, flags


__all__ = ["check_against_flops", "interleaved_times", "suspect"]
