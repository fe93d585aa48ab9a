"""Wall-clock times a plan can trust: the programs of a stage timed in interleaved rounds.

A busy machine drifts over seconds; timing one program after another puts the drift into their
differences. Here every round calls each program (several times back to back when it is short),
in a new order, after a warm-up call of each, and the fastest round is kept. A backward measured
far below what its flops say next to its forward is timed again with more rounds
(:func:`check_against_flops`). A stage's rounds take a second or less, and a slow spell of the
machine can outlast them all: the profiler times every stage :data:`TIMINGS` times once all are
compiled, a pass over the stages apart, and keeps each program's fastest (:class:`StageTimes`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
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
) -> dict[str, float]:
    """Interleaved times of ``programs`` (:func:`interleaved_times`); every backward
    (``backward[name]`` is its forward's name) measured far below its share of flops is timed
    again with four times the rounds (:attr:`StageTimes.flags` names those still low)."""
    t = interleaved_times(programs, rounds)
    bad = [b for b, f in backward.items() if suspect(t[f], t[b], flops[f], flops[b])]
    if bad:
        t.update(interleaved_times({n: programs[n] for n in {*bad, *(backward[b] for b in bad)}}, 4 * rounds, seed=1))
    return t


def fused_time(fb: float, fwd: float, bwd: float, fb_flops: float, fwd_flops: float, bwd_flops: float) -> float:
    """``FB``'s time: as measured, but at most what ``Fall; B`` takes with the forward's time
    scaled by the share of the forward's flops that ``FB`` still runs.

    ``FB`` is the stage's backward plus the forward work the backward reads (XLA drops the
    rest), so in the step it costs no more than ``Fall; B``. Timed alone it can come out slower:
    a 12-block GPT's block measured 8.5 ms against 2.7 + 5.4 ms for its forward and backward
    while running 0.91 of their flops, so plans recomputed blocks with ``Fall; B`` (1.05x the
    compiled flops) and ran 0.92 of no remat's time where every block fused (``remat every
    block``) ran 0.88. The bound is never below the backward's own time. Flops unknown (zero):
    ``fwd + bwd``.
    """
    return min(fb, bwd + fwd * rerun_share(fb_flops, fwd_flops, bwd_flops))


def rerun_share(flops: float, fwd_flops: float, bwd_flops: float) -> float:
    """The share of a stage's forward that a program of ``flops`` re-runs on top of the
    backward's ``bwd_flops`` (``FB``, or a backward under a policy), in [0, 1]; 1 where flops
    are unknown (zero)."""
    if fwd_flops > 0 and flops > 0:
        return min(1.0, max(0.0, flops - bwd_flops) / fwd_flops)
    return 1.0


def roofline_floor(roof: float, bwd: float, fwd: float, flops: float, fwd_flops: float, bwd_flops: float) -> float:
    """A roofline time (``method="xla"``) for ``FB`` or a backward under a policy: at least the
    backward's own roofline time plus the forward's, scaled by the share of the forward the
    program re-runs (:func:`rerun_share`).

    The roofline takes the larger of flops over the device's flop/s and XLA's bytes accessed
    over its bandwidth, and XLA counts fewer bytes for ``FB`` than for the backward alone (the
    backward reads its residuals from memory; ``FB`` makes them inside its fusions). So a
    12-layer MLP's stage (width 256, 8x128 tokens, XLA:CPU) came out 13.4 ms for ``FB`` against
    15.3 for the backward and 4.5 for the forward, at 1.50x the backward's flops: recomputing
    every stage looked faster than storing it, and the plan at 75% of the store-all peak
    recomputed what the plan at 50% did, at 0.50 of its budget and 1.34x the flops of
    ``jax.checkpoint(block, policy=dots_saveable)``. A program that runs the backward's work
    and more takes at least the backward's time.
    """
    return max(roof, bwd + fwd * rerun_share(flops, fwd_flops, bwd_flops))


def option_time(measured: float, bwd: float, fb: float) -> float:
    """A store option's backward time: as measured, but at most ``FB``'s (itself capped by
    :func:`fused_time`) where that is above the store-all backward's.

    The backward under a policy is the stage's backward plus the recomputation of the residuals
    the policy did not keep, a part of what ``FB`` recomputes; so it costs no more than ``FB``.
    Timed alone it can come out slower: a 12-block GPT's LM head measured 1.91 ms under
    ``dots_with_no_batch_dims_saveable`` against 1.37 for its backward and 1.38 for ``FB``, so the
    schedule storing every block under ``dots_saveable`` and the head under the policy (what
    ``jax.checkpoint(block, policy=dots_saveable)`` around every block runs) was predicted 0.4%
    slower than a plan that recomputes a block and the head whole, in 1.8% more flops.
    """
    return min(measured, max(bwd, fb))


# How often the profiler times every stage, a pass over all the stages apart; each program's time
# is its fastest over all (see StageTimes).
TIMINGS = 4


@dataclass(frozen=True)
class StageTimes:
    """A stage's programs (``"forward"``, ``"backward"``, ``"FB"`` and one ``"backward under
    <policy>"`` per store option), their flops and their timings (each program's fastest round).

    The profiler compiles every stage first, then times each :data:`TIMINGS` times, a pass over
    all the stages apart (:func:`~jaxremat.profiling.profiler.profile_stages`), and keeps each
    program's fastest time. Timed once right after its compile, as it was, a stage came out slow
    in every round now and then: two profiles of a ResNet in one process gave its stem and first
    block forwards and backwards 15-20% apart, an autoencoder's convolution's backward 29% on
    another day. Timed right after its compile and again once every stage was, 3 of a ResNet's
    14 stage timings (two profiles) were 20-26% slower the first time, every program of the stage
    together: a stage's rounds fall within a second, and a slow spell covers them all.

    Slow spells on this 2-core VM last seconds to tens of seconds: a convolution and its gradient
    timed in 5 rounds about every second for 150 s (``python benchmarks/timing_noise.py``, two
    runs) had their fastest round vary 1.5-1.95x. Split into groups of k timings, as k timings of
    one profile, a group's fastest time differed from the next group's by more than 15% in 0-7%
    of the pairs for k = 4 (mean 3-5%), 5-8% for k = 3, and 18% for one timing alone; the middle
    timing of a group did worse (4-15% for k = 4). Noise only adds time, so the fastest of all
    the timings is kept.
    """

    build: Callable[[], dict[str, Program]]  # the programs, with fresh concrete arguments
    flops: dict[str, float]
    runs: tuple[dict[str, float], ...] = ()  # each timing's times

    def timed(self, rounds: int) -> "StageTimes":
        """Timed once more, in ``rounds`` interleaved rounds; the programs' arguments are freed
        when this returns."""
        backward = {n: "forward" for n in self.flops if n.startswith("backward")}
        t = check_against_flops(self.build(), rounds, self.flops, backward)
        return replace(self, runs=(*self.runs, t))

    @property
    def raw(self) -> dict[str, float]:
        """Each program's time: the fastest round of all its timings."""
        return {n: min(t[n] for t in self.runs) for n in self.runs[0]}

    @property
    def flags(self) -> tuple[str, ...]:
        """The backwards whose time is still far below their flops' share (:func:`suspect`)."""
        f, t = self.flops, self.raw
        low = [b for b in t if b.startswith("backward") and suspect(t["forward"], t[b], f["forward"], f[b])]
        share = f"is below {SUSPECT:.0%} of its flops' share next to forward"
        return tuple(f"{b} time {1e3 * t[b]:.3g} ms {share}" for b in low)

    @property
    def forward(self) -> float:
        return self.raw["forward"]

    @property
    def backward(self) -> float:
        return self.raw["backward"]

    @property
    def fused(self) -> float:
        """``FB``'s time, bounded by :func:`fused_time`."""
        f = self.flops
        return fused_time(self.raw["FB"], self.forward, self.backward, f["FB"], f["forward"], f["backward"])

    def option(self, name: str) -> float:
        """The backward's time under the policy ``name``, bounded by :func:`option_time`."""
        return option_time(self.raw[f"backward under {name}"], self.backward, self.fused)


__all__ = [
    "TIMINGS",
    "StageTimes",
    "check_against_flops",
    "fused_time",
    "interleaved_times",
    "option_time",
    "rerun_share",
    "roofline_floor",
    "suspect",
]
