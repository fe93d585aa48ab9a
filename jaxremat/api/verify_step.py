"""The training step that verification compiles for a :func:`jaxremat.remat` plan: the gradient of
the function's loss with respect to its first argument's float leaves, consumed by an Adam
update with the parameters and its state donated, as users compile their step."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import optax

from jaxremat.api.calibrate import measured_loss, measured_optimizer
from jaxremat.api.verify import Measured
from jaxremat.core.compile import as_planned, held_bytes, measuring_options
from jaxremat.core.schedule import Schedule
from jaxremat.model.jaxpr_chain import JaxprChain
from jaxremat.model.trees import sharding_of
from jaxremat.run.executor import execute


def step_loss(out: Sequence[Any]) -> tuple[jax.Array, list]:
    """The scalar the verification step differentiates and what the step returns beside it: the
    function's first output leaf where that is a float scalar (a loss, or ``(loss, aux)`` as with
    ``has_aux``) with the other leaves (the aux: a step built with ``has_aux`` returns it, batch
    statistics for the next step), else :func:`~jaxremat.api.calibrate.measured_loss` of its float
    outputs and nothing.

    The aux counts: XLA schedules a step that returns its BatchNorm statistics differently. A
    linen CNN's 50% plan measured 10.54 MiB without them and 11.04 in the step that returns them,
    over its 10.77 MiB budget (CPU, 2026-12-06)."""
    floats = [o for o in out if jnp.issubdtype(jnp.result_type(o), jnp.inexact)]
    if out and jnp.ndim(out[0]) == 0 and floats and floats[0] is out[0]:
        return out[0].astype(jnp.float32), list(out[1:])
    return measured_loss(floats), []


def differentiated(flat: Sequence[Any], first: int) -> list[int]:
    """The leaves of ``flat`` the step differentiates: the float leaves among the first ``first``
    (the first argument's, as ``jax.grad``'s default ``argnums=0``), else every float leaf."""
    floats = [n for n, s in enumerate(flat) if jnp.issubdtype(s.dtype, jnp.inexact)]
    return [n for n in floats if n < first] or floats


def step_measure(
    traced: JaxprChain, flat: Sequence[Any], first: int, policies: Any = None, optimizer: Any = None
) -> Callable[[Schedule], Measured]:
    """``measure(schedule)``: XLA's temp bytes and flops of the training step under
    ``schedule``, compiled as users compile it (:func:`~jaxremat.compiler_options`; never run, so
    with :func:`~jaxremat.core.compile.measuring_options`, which leave its analyses as they are): the
    gradient of :func:`step_loss`'s scalar (its aux returned) with respect to the float leaves of
    the first argument (the parameters, as ``jax.grad``'s default ``argnums=0`` takes them; every
    float input if it has none), the first ``first`` of ``flat``, consumed by an Adam update with the parameters and
    its state donated, so no gradient is an output (the step whose memory the profile counts,
    :func:`~jaxremat.api.calibrate.update_step`). ``optimizer``: the update's (default Adam,
    :func:`~jaxremat.api.calibrate.measured_optimizer`)."""
    diff = differentiated(flat, first)
    other = [n for n in range(len(flat)) if n not in diff]
    opt = optimizer or measured_optimizer()

    def measure(schedule: Schedule) -> Measured:
        forward = execute(traced.chain, schedule, policies=policies)

        def loss(d: list, o: list) -> jax.Array:
            leaves: list = [None] * len(flat)
            for n, v in zip(diff, d):
                leaves[n] = v
            for n, v in zip(other, o):
                leaves[n] = v
            out, _ = forward(traced.variables(leaves), ())
            return step_loss(list(out))

        def step(d: list, state: Any, o: list) -> tuple:
            value, g = jax.value_and_grad(loss, has_aux=True)(d, o)
            updates, state = opt.update(g, state, d)
            return value, optax.apply_updates(d, updates), state

        shapes = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding_of(s)) for s in flat]
        d, o = [shapes[n] for n in diff], [shapes[n] for n in other]
        state = jax.eval_shape(opt.init, d)
        lowered = jax.jit(as_planned(step), donate_argnums=(0, 1)).lower(d, state, o)
        compiled = lowered.compile(measuring_options(lowered=lowered) or None)
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        mem = compiled.memory_analysis()
        return Measured(int(mem.temp_size_in_bytes), float((cost or {}).get("flops", 0.0)), held_bytes(mem))

    return measure


__all__ = ["differentiated", "step_loss", "step_measure"]
