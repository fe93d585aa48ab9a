"""The largest input that fits a device, per strategy, and how fast it trains: ``jaxremat.fit``.

A user asks what batch (sequence length, resolution) their accelerator can train, and how fast.
For each strategy (no remat, the ``jax.checkpoint`` strategies written by hand, and jaxremat under a
:class:`~jaxremat.Device` budget) the largest size along one input axis whose training step fits
the device is found by bisection over a grid of sizes, each size judged by XLA's memory analysis
of the compiled step (temporaries, arguments and outputs, less the outputs written over donated
arguments), not by a prediction. The step at each size that fits is then timed: samples per
second is the size over the median step time.

The step is the one users write: ``jax.value_and_grad`` of the loss with respect to the first
argument, an optimizer update (Adam unless the device says otherwise), parameters and optimizer
state donated, compiled with :func:`jaxremat.compiler_options`.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import optax

from jaxremat.api.calibrate import measured_optimizer
from jaxremat.api.remat_fn import remat
from jaxremat.core.compile import as_planned, compiler_options, measuring_options, total_bytes
from jaxremat.core.device import Device
from jaxremat.core.schedule import InfeasibleBudget
from jaxremat.core.units import format_bytes
from jaxremat.profiling.progress import progress
from jaxremat.tools.step_timing import CarriedStep, interleaved

#: A strategy: ``make(size) -> (loss, args)``, the training loss of the model at that size
#: written with the strategy's remat, and its arguments (parameters first).
Strategy = Callable[[int], tuple[Callable, tuple]]

JAXREMAT = "jaxremat"


@dataclass(frozen=True)
class FitRow:
    """One strategy's largest fitting size (``None``: not even the smallest) and its speed there."""

    strategy: str
    size: int | None
    used: int  # XLA: the step's bytes at ``size`` (at the smallest size when none fits)
    step_s: float = math.nan  # median step time at ``size``
    curve: tuple[tuple[int, int, float], ...] = ()  # (size, bytes, step seconds or nan) per size tried

    @property
    def throughput(self) -> float:
        """Samples (sizes along the axis) per second at the largest size that fits."""
        return self.size / self.step_s if self.size and self.step_s == self.step_s else math.nan


@dataclass(frozen=True)
class Fit:
    """What :func:`fit` found for one model and one device."""

    model: str
    axis: str
    limit: int  # the device's memory
    usable: int  # less the headroom: what a step may use
    sizes: tuple[int, ...]  # the grid searched
    rows: tuple[FitRow, ...] = field(default=())

    def row(self, strategy: str) -> FitRow:
        return next(r for r in self.rows if r.strategy == strategy)

    def best_hand(self) -> FitRow | None:
        """The hand strategy (no remat included) of the largest size, the fastest of those."""
        hands = [r for r in self.rows if r.strategy != JAXREMAT and r.size]
        fastest = lambda r: (r.size, r.throughput if r.throughput == r.throughput else 0.0)  # noqa: E731
        return max(hands, key=fastest) if hands else None

    def least(self) -> int:
        """The least memory a step of the smallest size needed, over every strategy (XLA's)."""
        return min(point[1] for r in self.rows for point in r.curve if point[0] == self.sizes[0])

    def table(self) -> str:
        """A markdown table: per strategy, the largest size, its memory and its throughput."""
        lines = [
            f"| strategy | largest {self.axis} | step memory (XLA) | step ms | samples/s |",
            "|---|---|---|---|---|",
        ]
        for r in self.rows:
            size = str(r.size) if r.size else f"none (< {self.sizes[0]})"
            ms = f"{1e3 * r.step_s:.1f}" if r.step_s == r.step_s else "-"
            tp = f"{r.throughput:.1f}" if r.throughput == r.throughput else "-"
            lines.append(f"| {r.strategy} | {size} | {format_bytes(r.used)} | {ms} | {tp} |")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {**asdict(self), "rows": [{**asdict(r), "throughput": r.throughput} for r in self.rows]}


def size_grid(lo: int, hi: int) -> tuple[int, ...]:
    """Sizes from ``lo`` to ``hi``: ``lo``, ``hi`` and the powers of two and their halfway points
    (``2**k``, ``3 * 2**(k-1)``) between, so that different devices try the same sizes."""
    if not 1 <= lo <= hi:
        raise ValueError(f"jaxremat.fit: sizes must be 1 <= lo <= hi, got {lo}:{hi}")
    found = {lo, hi}
    k = 1
    while k <= hi:
        found |= {s for s in (k, 3 * k // 2) if lo < s < hi}
        k *= 2
    return tuple(sorted(found))


def largest(fits: Callable[[int], bool], sizes: Sequence[int]) -> int | None:
    """The largest of ``sizes`` (ascending) for which ``fits`` holds, by bisection: ``fits`` is
    taken to hold for every size below one that fits. ``None`` if the smallest does not fit."""
    if not fits(sizes[0]):
        return None
    lo, hi = 0, len(sizes) - 1
    if fits(sizes[hi]):
        return sizes[hi]
    while hi - lo > 1:  # sizes[lo] fits, sizes[hi] does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(sizes[mid]) else (lo, mid)
    return sizes[lo]


def training_step(loss: Callable, optimizer: optax.GradientTransformation) -> Callable:
    """The step users write: loss and gradient with respect to the first argument, the update."""

    def step(params: Any, state: Any, *rest: Any) -> tuple:
        value, grads = jax.value_and_grad(loss)(params, *rest)
        updates, state = optimizer.update(grads, state, params)
        return value, optax.apply_updates(params, updates), state

    return as_planned(step)


def step_bytes(loss: Callable, args: tuple, optimizer: optax.GradientTransformation) -> int:
    """What the compiled step of ``loss`` uses on the device, by XLA's memory analysis."""
    state = jax.eval_shape(optimizer.init, args[0])
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), a.dtype), args)
    lowered = jax.jit(training_step(loss, optimizer), donate_argnums=(0, 1)).lower(shapes[0], state, *shapes[1:])
    return total_bytes(lowered.compile(measuring_options(lowered=lowered) or None).memory_analysis())


def carried_step(loss: Callable, args: tuple, optimizer: optax.GradientTransformation) -> CarriedStep:
    """The training step of ``loss`` (:func:`training_step`), compiled and called once, with the
    parameters and optimizer state it carries from call to call."""
    options = compiler_options() or None
    run = jax.jit(training_step(loss, optimizer), donate_argnums=(0, 1), compiler_options=options)
    step = CarriedStep(run, jax.tree.map(jnp.copy, args[0]), optimizer.init(args[0]), *args[1:])
    step()  # compiled before any timing
    return step


def time_steps(steps: Sequence[CarriedStep], calls: int, rounds: int = 3) -> list[float]:
    """The median step time of each of ``steps``, timed in ``rounds`` interleaved rounds of
    ``calls`` calls each (:func:`~jaxremat.tools.step_timing.interleaved`)."""
    return [statistics.median(t) for t in interleaved(steps, rounds=rounds, calls=calls)]


def fit(
    strategies: Any,
    memory: Device | int | str,
    *,
    input_shape: Sequence[int] | None = None,
    dtype: str = "float32",
    sizes: tuple[int, int] = (1, 1024),
    model: str = "model",
    axis: str | int = "batch",
    plain: str = "no remat",
    steps: int = 5,
    time_all: bool = False,
    quiet: bool = False,
) -> Fit:
    """The largest size of ``axis`` that fits ``memory`` under each strategy, and its speed.

    Args:
      strategies: a Flax linen model (its strategies are :func:`model_strategies`', its input
        ``input_shape`` and ``dtype``, ``axis`` ``"batch"`` the first dimension, ``"sequence"``
        the second), or name -> ``make(size) -> (loss, args)``: the model's training loss at
        ``size`` written with that strategy's remat.
      memory: a :class:`~jaxremat.Device`, or its size (``"16GiB"``; 5% headroom).
      sizes: ``(lo, hi)``: the range searched (:func:`size_grid`).
      plain: the strategy without remat: jaxremat plans its loss under ``memory``
        (``jaxremat.remat(loss, Device)``), a row of its own named ``"jaxremat"``.
      steps: timed steps per round (3 interleaved rounds) at each strategy's largest size, and at
        every size jaxremat fits (0: no timing).
      time_all: time every size tried that fits, not only the largest (a throughput curve).

    Raises:
      InfeasibleBudget: even the smallest size fits under no strategy; it names the least memory
        XLA measured for it.
    """
    if not isinstance(strategies, dict):
        if input_shape is None:
            raise ValueError("jaxremat.fit(model, memory, input_shape=...): a model needs its input's shape")
        index = {"batch": 0, "sequence": 1}.get(axis, axis)
        if not isinstance(index, int):
            raise ValueError(f"jaxremat.fit: axis is 'batch', 'sequence' or an input dimension, got {axis!r}")
        strategies = model_strategies(strategies, input_shape, dtype, index)
        axis = str(axis)
    device = memory if isinstance(memory, Device) else Device(memory)
    usable, optimizer = device.usable(), device.optimizer or measured_optimizer()
    if plain not in strategies:
        raise ValueError(f"jaxremat.fit: the strategies need {plain!r} (the model without remat) for jaxremat to plan")
    grid = size_grid(*sizes)
    made: dict[tuple[str, int], tuple[Callable, tuple]] = {}
    used: dict[tuple[str, int], int] = {}

    def loss_and_args(name: str, size: int) -> tuple[Callable, tuple]:
        if (name, size) not in made:
            if name == JAXREMAT:
                loss, args = loss_and_args(plain, size)
                made[name, size] = (remat(loss, device, quiet=True), args)
            else:
                made[name, size] = strategies[name](size)
        return made[name, size]

    rows = []
    names = [*strategies, JAXREMAT]
    with progress(None, f"fitting {model} in {format_bytes(device.limit())}", quiet) as advance:

        def fits(name: str, size: int) -> bool:
            loss, args = loss_and_args(name, size)
            if name == JAXREMAT:
                try:
                    loss.plan(*args)
                except InfeasibleBudget as e:  # the least it needs, in the device's terms
                    used[name, size] = e.min_budget
                    return False
            used[name, size] = step_bytes(loss, args, optimizer)
            advance(f"{name} at {axis} {size}: {format_bytes(used[name, size])}")
            return used[name, size] <= usable

        found = {name: largest(lambda s: fits(name, s), grid) for name in names}
        # what is timed: each strategy's largest size, and every size jaxremat fits (its largest
        # is planned the tightest), or every size that fits with time_all
        chosen = [
            (n, s) for (n, s), b in used.items()
            if steps and 0 <= b <= usable and (time_all or n == JAXREMAT or s == found[n])
        ]
        seconds = {}
        if jax.default_backend() == "cpu":  # all held at once: interleaved
            ready = []
            for n, s in chosen:
                ready.append(carried_step(*loss_and_args(n, s), optimizer))
                advance(f"{n} compiled to be timed at {axis} {s}")
            seconds = dict(zip(chosen, time_steps(ready, steps)))
        else:  # each fills the device: one at a time, its buffers freed before the next
            for n, s in chosen:
                seconds[n, s] = time_steps([carried_step(*loss_and_args(n, s), optimizer)], steps)[0]
                advance(f"{n} timed at {axis} {s}")
        for name in names:
            curve = tuple((s, b, seconds.get((n, s), math.nan)) for (n, s), b in sorted(used.items()) if n == name)
            at = found[name] if found[name] is not None else grid[0]
            step_s = seconds.get((name, found[name]), math.nan)
            rows.append(FitRow(name, found[name], used.get((name, at), -1), step_s, curve))
    result = Fit(model, axis, device.limit(), usable, grid, tuple(rows))
    if all(r.size is None for r in rows):
        raise InfeasibleBudget(
            "every strategy",
            usable,
            result.least(),
            note=f"measured by XLA at {axis} {grid[0]}, the smallest asked; {device.describe()}",
        )
    return result


def model_strategies(model: Any, shape: Sequence[int], dtype: str = "float32", axis: int = 0) -> dict[str, Strategy]:
    """The strategies of a Flax linen model, its loss the mean square of its output, its input of
    ``shape`` with ``axis`` set to each size: ``"no remat"`` (the model as written); for an
    ``nn.Sequential`` (or a list of modules) the hand strategies of
    :func:`~jaxremat.tools.compare.manual_strategies` over its layers (``jax.checkpoint`` on every
    block, on every 2-4 blocks, every block under ``dots_saveable`` and
    ``dots_with_no_batch_dims_saveable``); for a model with a ``remat`` field taking
    :data:`~jaxremat.tools.models.SCAN_REMAT` (a scanned decoder), the model with each."""
    import flax.linen as nn

    from jaxremat.model.chain import Chain
    from jaxremat.tools.compare import manual_strategies
    from jaxremat.tools.models import SCAN_REMAT, sample_input

    def sample(size: int) -> jax.Array:
        return sample_input(tuple(size if d == axis else n for d, n in enumerate(shape)), dtype)

    def applied(m: Any) -> Strategy:
        def make(size: int) -> tuple[Callable, tuple]:
            x = sample(size)
            v = m.init(jax.random.key(0), x)
            rest = {k: c for k, c in v.items() if k != "params"}

            def loss(params: Any, rest: Any, x: jax.Array) -> jax.Array:
                return jnp.mean(jnp.square(m.apply({"params": params, **rest}, x)).astype(jnp.float32))

            return loss, (v["params"], rest, x)

        return make

    found = {"no remat": applied(model)}
    if getattr(model, "remat", None) in SCAN_REMAT:
        names = {"full": "remat every block", "dots_saveable": "policy dots_saveable",
                 "dots_with_no_batch_dims_saveable": "policy dots_with_no_batch_dims_saveable"}
        found |= {name: applied(model.clone(remat=r)) for r, name in names.items()}
    elif isinstance(model, (nn.Sequential, list, tuple)):
        chain = Chain.from_linen(model)

        def hand(name: str) -> Strategy:
            def make(size: int) -> tuple[Callable, tuple]:
                x = sample(size)
                per_stage = chain.split(chain.init(jax.random.key(0), x))
                forward = manual_strategies(chain)[name]

                def loss(params: list, rest: list, x: jax.Array) -> jax.Array:
                    out = forward([{**r, "params": p} for p, r in zip(params, rest)], x)
                    return jnp.mean(jnp.square(out).astype(jnp.float32))

                params = [u.get("params", {}) for u in per_stage]
                return loss, (params, [{k: c for k, c in u.items() if k != "params"} for u in per_stage], x)

            return make

        kinds = ("remat every", "checkpoint every", "policy dots")
        wanted = [n for n in manual_strategies(chain) if n.startswith(kinds)]
        found |= {name: hand(name) for name in wanted}
    return found


def write_json(result: Fit, path: str) -> None:
    with open(path, "w") as f:
        json.dump(result.to_json(), f, indent=1)


__all__ = [
    "Fit", "FitRow", "JAXREMAT", "Strategy", "fit", "largest", "model_strategies", "size_grid", "step_bytes",
    "carried_step", "time_steps", "write_json",
]
