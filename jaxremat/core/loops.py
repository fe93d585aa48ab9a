"""The loop rules: how the stages of a :class:`~jaxremat.Repeat` run as one loop, and what the
loop costs in memory beyond its stages. The solvers plan with these rules and the executor runs
by them; both read them here.

A Repeat keeps its copies' parameters stacked on a leading axis, and the executor runs it
without copying them only as one ``lax.scan`` over that axis. Two loops do that:

* a *pattern loop* runs a pattern of top-level units (stored stages and checkpoint regions) over
  ``p`` stages as one iteration, ``n / p`` times (JAX's autodiff of the scan keeps the stored
  blocks' residuals; each block of the pattern is compiled);
* a *selective loop* runs copies that are each stored or checkpointed alone, in any mix, with one
  block body (:func:`jaxremat.run.selective.selective_scan`).

A mix of stored and checkpointed copies that repeats a pattern of at most
:data:`PATTERN_LOOP_UP_TO` copies runs as a pattern loop (it holds about one block's residuals
less: no packed row, and XLA fuses a checkpointed block's recomputation into its backward); any
other mix runs as a selective loop.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import numpy as np

from jaxremat.core.costs import ChainCosts
from jaxremat.core.ops import store_all_ops
from jaxremat.core.simulator import simulate

PATTERN_LOOP_UP_TO = 4
#: The longest pattern the solver repeats over a Repeat layer by default.
MAX_PERIOD = PATTERN_LOOP_UP_TO


class LoopGroup(NamedTuple):
    """Stages ``start .. start + length - 1`` are the copies of one Repeat layer."""

    start: int
    length: int


class Part(NamedTuple):
    """One unit of a loop's pattern: ``"store"`` (one stage stored, ``size == 1``, under store
    option ``option``), ``"region"`` (``size`` stages in a region, stored inside) or ``"nested"``
    (``size`` stages in a region, each checkpointed again inside)."""

    kind: str
    size: int
    option: int = 0


STORE, REGION = Part("store", 1), Part("region", 1)


def as_pattern(pattern: Sequence[Part | tuple[str, int]]) -> tuple[Part, ...]:
    """``pattern`` with plain ``(kind, size)`` pairs read as :class:`Part`."""
    return tuple(Part(*part) for part in pattern)


def runs_selective(stored: Sequence[bool]) -> bool:
    """Whether copies stored (``True``) or checkpointed alone (``False``) run as a selective loop:
    a mix of both that does not repeat a pattern of at most :data:`PATTERN_LOOP_UP_TO` copies."""
    n = len(stored)
    if len(set(stored)) < 2:
        return False
    stored = list(stored)
    return not any(n % p == 0 and stored == stored[:p] * (n // p) for p in range(1, min(PATTERN_LOOP_UP_TO, n - 1) + 1))


def period(pattern: Sequence[Part]) -> int:
    """Stages one repeat of ``pattern`` covers."""
    return sum(part.size for part in as_pattern(pattern))


def is_selective(pattern: Sequence[Part], n: int) -> bool:
    """Whether a group of ``n`` stages repeating ``pattern`` runs as a selective loop."""
    pattern = as_pattern(pattern)
    if not all(part in (STORE, REGION) for part in pattern) or n % len(pattern):
        return False
    return runs_selective([part == STORE for part in pattern] * (n // len(pattern)))


def compile_rank(pattern: Sequence[Part], n: int) -> float:
    """How much loop body a group's schedule compiles, in blocks: 1 for a pattern of one stage, 2
    for a selective loop (one block, its recomputation and the residual buffers), ``p + 0.5``
    for a loop over a pattern of ``p`` stages."""
    if is_selective(pattern, n):
        return 2.0
    p = period(pattern)
    return 1.0 if p == 1 else p + 0.5


def loop_costs(
    costs: ChainCosts, groups: Sequence[LoopGroup], pattern_of: dict[int, Sequence[Part]], param_bytes: Sequence[int]
) -> ChainCosts:
    """``costs`` with what a loop over a group adds to the transients.

    Each iteration of the scan over a group with period ``p`` materialises its slice of the
    stacked variables (``p`` stages' worth, ``w`` bytes each), and for ``p > 1`` cuts it into
    the stages' variables again; the backward loop does the same and also gathers the slice's
    gradient pieces before writing them into the stacked gradient. So a stage gets ``w`` more
    forward and ``2 w`` more backward transient when ``p == 1``, ``2 p w`` and ``4 p w`` when
    ``p > 1`` (read off XLA's buffer assignment of a 12-block transformer; without these the
    prediction was up to 1.7x low for patterns of 4 stages).

    A selective loop iterates one stage at a time (``w``, ``2 w``); a forward iteration reads the
    row it writes (the masked write of a checkpointed copy) and a backward iteration holds one
    copy's residuals packed in one row beside the unpacked ones: ``r = xbar - x_out`` more of
    each (without them XLA's peak was up to 1.05x the prediction on 48 transformer blocks).

    And every loop holds its stacked gradient (:func:`stacked_gradients`).
    """
    costs = stacked_gradients(costs, groups, param_bytes)
    fwd_add, bwd_add = np.zeros(costs.length, np.int64), np.zeros(costs.length, np.int64)
    for s, n in groups:
        pattern = pattern_of[s]
        selective = is_selective(pattern, n)
        p = period(pattern)
        f, b = (1, 2) if p == 1 or selective else (2 * p, 4 * p)
        r = max(int(costs.xbar[s]) - int(costs.x[s + 1]), 0) if selective else 0
        for i in range(s, s + n):
            fwd_add[i] += f * int(param_bytes[i]) + r
            bwd_add[i] += b * int(param_bytes[i]) + r
    return add_transients(costs, fwd_add, bwd_add)


def stacked_gradients(costs: ChainCosts, groups: Sequence[LoopGroup], param_bytes: Sequence[int]) -> ChainCosts:
    """``costs`` with each Repeat layer's stacked gradient held in every backward up to the
    layer's last copy's: the backward loop (or the slices' gradient pieces, when the layer is
    unrolled) fills it row by row, and the update reads it whole after the step's backward,
    while an unrolled stage's gradient is read by the update as soon as it is written. The
    12-block GPT as one Repeat used 1.25-1.33x its loop plans without this term."""
    bwd_add = np.zeros(costs.length, np.int64)
    for s, n in groups:
        bwd_add[: s + n] += sum(int(param_bytes[i]) for i in range(s, s + n))
    return add_transients(costs, np.zeros(costs.length, np.int64), bwd_add)


def loop_store_all_peak(costs: ChainCosts, groups: Sequence[LoopGroup], param_bytes: Sequence[int]) -> int:
    """The store-all peak of a chain whose Repeat layers each run as one loop of stored copies
    (plain autodiff of the model as written: ``nn.scan`` or ``jax.lax.scan`` over the stack),
    with the loops' transients and stacked gradients counted: what a share budget (``"40%"``) of
    such a chain is a share of."""
    stored = loop_costs(costs, groups, {s: (STORE,) for s, _ in groups}, param_bytes)
    return simulate(stored, store_all_ops(costs.length))[0]


def add_transients(costs: ChainCosts, fwd_add: np.ndarray, bwd_add: np.ndarray) -> ChainCosts:
    """``costs`` with ``fwd_add`` more forward and ``bwd_add`` more backward transient bytes per
    stage: in every store option's backward and in ``FB`` (which runs both) too."""
    options = None
    if costs.options is not None:
        options = tuple(
            tuple(dataclasses.replace(o, bwd_tmp=o.bwd_tmp + int(bwd_add[i])) for o in per)
            for i, per in enumerate(costs.options)
        )
    return dataclasses.replace(
        costs,
        fwd_tmp=costs.fwd_tmp + fwd_add,
        bwd_tmp=costs.bwd_tmp + bwd_add,
        fb_tmp=costs.fb_tmp + np.maximum(fwd_add, bwd_add),
        options=options,
    )


def copy_costs(costs: ChainCosts, groups: Sequence[LoopGroup], param_bytes: Sequence[int]) -> ChainCosts:
    """``costs`` with what slicing each Repeat's stacked variables costs when it does not run as
    one loop: XLA copies the slices and the gradient's pieces, up to twice the layer's variable
    bytes (measured), live from the layer's forward pass to the end of its backward pass."""
    add = np.zeros(costs.length, np.int64)
    for s, n in groups:
        add[s:] += 2 * sum(int(b) for b in param_bytes[s : s + n])
    return add_transients(costs, add, add)


__all__ = [
    "MAX_PERIOD",
    "PATTERN_LOOP_UP_TO",
    "STORE",
    "REGION",
    "LoopGroup",
    "Part",
    "add_transients",
    "as_pattern",
    "compile_rank",
    "copy_costs",
    "loop_store_all_peak",
    "stacked_gradients",
    "is_selective",
    "loop_costs",
    "period",
    "runs_selective",
]
