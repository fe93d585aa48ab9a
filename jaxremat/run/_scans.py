"""Loops over alike units: one ``lax.scan`` routine for pattern loops and stacked runs, and the
selective loop's adapter."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxremat.model.stage import Stage, stage_rngs
from jaxremat.run._variables import Env
from jaxremat.run.loop_plan import CopyKind
from jaxremat.run.offload_loop import offload_scan
from jaxremat.run.selective import selective_scan

_CUTS = frozenset({lax.slice_p, lax.squeeze_p, lax.reshape_p, lax.split_p, lax.dynamic_slice_p})


def _save_all_but_cuts(prim: Any, *args: Any, **params: Any) -> bool:
    """Checkpoint policy: save every residual except cuts of the variables (recomputed)."""
    return prim not in _CUTS


def scatter_updates(updates: dict, ys: dict[int, Any], stride: int, n: int) -> None:
    """Per-iteration updates stacked by a loop (``ys[i]`` for stage ``i`` of the first
    iteration) written back per stage: iteration ``u`` ran stage ``i + u * stride``."""
    for i, tree in ys.items():
        for u in range(n):
            updates[i + u * stride] = jax.tree.map(lambda t: t[u], tree)


def scan_units(
    apply: Callable[[Env, Any, dict], Any],
    first: int,
    stages: int,
    n: int,
    a: Any,
    updates: dict,
    stacked: Any,
    views: Callable[[Any], list[Any]],
    *,
    cut_in_checkpoint: bool,
) -> Any:
    """``n`` iterations of ``apply(env, a, local) -> a`` (a pattern of units over ``stages``
    stages from stage ``first``) as one ``lax.scan`` over ``stacked``; ``views(slice)`` gives an
    iteration's variables per stage.

    Each iteration's variables are then exactly a slice of the scanned inputs, which JAX hands
    to the backward loop as they are; a value computed from them inside the loop (a reshape, a
    cut into stages) would be saved per iteration instead, a copy of the parameters. With
    ``cut_in_checkpoint`` the cut runs inside a checkpoint whose policy recomputes it in the
    backward loop rather than saving it (the cut's gradient is one concatenate).
    """

    def iteration(P: Any, a: Any, u: jax.Array) -> tuple[Any, dict]:
        local: dict = {}
        env = Env(dict(zip(range(first, first + stages), views(P))), u * stages, {}, looped=True)
        return apply(env, a, local), local

    step = jax.checkpoint(iteration, policy=_save_all_but_cuts) if cut_in_checkpoint else iteration
    a, ys = lax.scan(lambda a, xs: step(xs[0], a, xs[1]), a, (stacked, jnp.arange(n)))
    scatter_updates(updates, ys, stages, n)
    return a


def run_selective(
    stage: Stage, first: int, stored: tuple[bool, ...], a: Any, updates: dict, stacked: Any, rngs: Any
) -> Any:
    """A Repeat's copies (stage ``first`` onwards), stored or checkpointed one by one, as one
    :func:`~jaxremat.run.selective.selective_scan`."""

    def step(p: Any, keys: Any, a: Any, u: jax.Array) -> tuple[Any, Any]:
        return stage.apply(p, a, stage_rngs(keys, first + u))

    a, ys = selective_scan(step, stored, stacked, a, rngs)
    if jax.tree.leaves(ys):
        scatter_updates(updates, {first: ys}, 1, len(stored))
    return a


def run_offload_loop(
    stage: Stage,
    first: int,
    kinds: tuple[CopyKind, ...],
    a: Any,
    updates: dict,
    stacked: Any,
    rngs: Any,
    policies: dict[tuple[int, int], Any],
) -> Any:
    """A Repeat's copies (stage ``first`` onwards), stored or checkpointed one by one with some
    buffers in host memory, as one :func:`~jaxremat.run.offload_loop.offload_scan`;
    ``policies[(stage, option)]`` is the checkpoint policy of a store option."""
    by_option = {k.option: policies[(first + u, k.option)] for u, k in enumerate(kinds) if k.option}

    def step_for(option: int) -> Callable:
        apply = jax.checkpoint(stage.apply, policy=by_option[option]) if option else stage.apply

        def step(p: Any, keys: Any, a: Any, u: jax.Array) -> tuple[Any, Any]:
            return apply(p, a, stage_rngs(keys, first + u))

        return step

    a, ys = offload_scan(step_for, kinds, stacked, a, rngs)
    if jax.tree.leaves(ys):
        scatter_updates(updates, {first: ys}, 1, len(kinds))
    return a


__all__ = ["run_offload_loop", "run_selective", "scan_units", "scatter_updates"]
