"""One stage of a chain: ``a_{i+1} = apply(variables_i, a_i, rngs)``, and the keys it draws from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import jax

Variables = dict[str, Any]
Rngs = dict[str, jax.Array] | None
ApplyFn = Callable[[Variables, Any, Rngs], tuple[Any, Variables]]


@dataclass(frozen=True)
class Stage:
    """One stage ``a_{i+1} = apply(variables_i, a_i, rngs)``.

    ``apply`` returns ``(output, updated_collections)`` (an empty dict when nothing is mutable).
    ``init(rng, a)`` makes the stage's variables, or is ``None`` for stages built from plain
    functions with their parameters given. ``key`` is the stage's structure (module config or
    function code): stages with equal keys and equal variable shapes compute the same function
    (:func:`jaxremat.model.identity.stage_identity`); ``""`` means never equal to another.

    ``unwrapped``, for a stage holding the user's own ``jax.checkpoint`` / ``nn.remat``: the same
    function with those blocks run as their bodies. The executor runs it where the schedule
    recomputes the stage alone (a region of one stage), whose recomputation frees what the
    user's checkpoint would. Kept, the checkpoint inside the region held one activation more:
    a linen CNN with ``nn.remat`` on two of its four blocks, every block checkpointed, used
    12.08 MiB against the 11.11 of ``jax.checkpoint`` on every block in place of the user's
    (which jaxremat could then not match); run as its body, 11.08 (CPU, update step,
    2026-12-05; the flops the same).

    ``cost_key``, where it differs from ``key``: what the stage costs, equal for stages that
    compute alike on data sliced from different places (the profiler measures such stages once:
    an equinox transformer's 8 blocks, each drawing dropout keys from its own row, were 17
    distinct stages of 48 by ``key``, 8 by this).
    """

    name: str
    kind: str
    apply: ApplyFn = field(repr=False)
    init: Callable[[jax.Array, Any], Variables] | None = field(default=None, repr=False)
    mutable: tuple[str, ...] = ()
    rng_streams: tuple[str, ...] = ()
    key: str = ""
    unwrapped: ApplyFn | None = field(default=None, repr=False)
    cost_key: str = ""


def stage_rngs(rngs: Rngs, i: int) -> Rngs:
    """Stage ``i``'s keys: each stream folded with the stage index (the same on a recompute)."""
    if not rngs:
        return None
    return {k: jax.random.fold_in(r, i) for k, r in rngs.items()}


def any_rngs(stage: Stage) -> Rngs:
    """Keys for shape evaluation only (the values do not matter)."""
    return {s: jax.random.key(0) for s in stage.rng_streams} or None


def convolves(fn: Callable, *args: Any) -> bool:
    """Whether ``fn(*args)`` runs a convolution (read from its jaxpr, sub-jaxprs included).

    The executor ties the weight gradients of stored stages that convolve to their input's
    cotangent (:mod:`jaxremat.run._grad_tie`), and the profiler leaves copies of their kernels
    out of a stage's ``xbar`` (:func:`jaxremat.profiling.stage_memory.kept_bytes`)."""
    return "conv_general_dilated" in str(jax.make_jaxpr(fn)(*args))


__all__ = ["ApplyFn", "Rngs", "Stage", "Variables", "any_rngs", "convolves", "stage_rngs"]
