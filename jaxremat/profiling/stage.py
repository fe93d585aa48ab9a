"""Measuring one stage: what XLA keeps for its backward, its transients, its times and flops."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jax_core

from jaxremat.core.compile import REMAT_OPTIONS
from jaxremat.model.stage import Stage
from jaxremat.model.trees import abstract, tree_bytes
from jaxremat.profiling.rates import Rates, median_time
from jaxremat.profiling.xla_buffers import bytes_kept_across_barrier, transient_bytes


@dataclass(frozen=True)
class StageProfile:
    """What the profiler measured for one stage (bytes, seconds, flops)."""

    name: str
    kind: str
    out_shape: str
    x_out: int
    xbar: int
    fwd_tmp: int
    bwd_tmp: int
    fwd_flops: float
    bwd_flops: float
    fwd_bytes: float
    bwd_bytes: float
    fwd_time: float
    bwd_time: float


def _split_params(v: dict) -> tuple[Any, dict]:
    return v.get("params", {}), {k: t for k, t in v.items() if k != "params"}


def _stage_fn(st: Stage):
    def g(params, a, rest, rng):
        rngs = {s: jax.random.fold_in(rng, k) for k, s in enumerate(st.rng_streams)} if st.rng_streams else None
        return st.apply({**rest, "params": params}, a, rngs)[0]

    return g


def _sum_leaves(tree: Any) -> jax.Array:
    return sum(jnp.sum(leaf.astype(jnp.float32)) for leaf in jax.tree.leaves(tree))


def _cost(compiled: Any) -> tuple[float, float]:
    ca = compiled.cost_analysis()
    if isinstance(ca, list):
        ca = ca[0] if ca else {}
    return float(ca.get("flops", 0.0)), float(ca.get("bytes accessed", 0.0))


def kept_bytes(g, params, a_shape, rest, rng, cot_shape) -> int:
    """``xbar``: the bytes XLA keeps from the stage's forward for its backward, plus its output.

    Compiled as forward, an optimisation barrier on (output, cotangent), backward, and read from
    the buffers live across the barrier (:func:`~jaxremat.xla_memory.live_across_barrier`; the
    stage input's leaves are the activations there).
    """

    def kept(params, a, rest, rng, cot):
        out, vjp = jax.vjp(lambda p, x: g(p, x, rest, rng), params, a)
        done, cot, out = lax.optimization_barrier((_sum_leaves(out), cot, out))
        return done, vjp(cot), out

    n_params, n_input = len(jax.tree.leaves(params)), len(jax.tree.leaves(a_shape))
    acts = range(n_params, n_params + n_input)
    return bytes_kept_across_barrier(kept, params, a_shape, rest, rng, cot_shape, activations=acts)[1]


def scan_residual_bytes(g: Callable, params: Any, a_shape: Any, rest: Any, rng: Any) -> int:
    """Bytes a ``lax.scan`` saves per iteration for a stage's backward, output included.

    A loop keeps its body's residuals as JAX's autodiff chooses them (stacked outputs of the
    forward loop), not as XLA would after fusing the backward: these are the residuals of
    ``jax.vjp`` that are not the stage's inputs (parameters are scanned inputs, handed to the
    backward loop as they are; the input is the previous stage's output), plus the output.
    """
    def residuals(p, x, r, k):
        out, pull = jax.vjp(lambda p, x: g(p, x, r, k), p, x)
        return jax.tree.leaves(pull), out

    closed = jax.make_jaxpr(residuals)(params, a_shape, rest, rng)
    inputs = set(closed.jaxpr.invars)
    seen: set = set()
    total = 0
    for v in closed.jaxpr.outvars:
        if isinstance(v, jax_core.Var) and v not in inputs and v not in seen:
            seen.add(v)
            total += int(np.prod(v.aval.shape)) * np.dtype(v.aval.dtype).itemsize
    return total


def profile_stage(
    st: Stage, variables: dict, a_shape: Any, *, method: str, rates: Rates | None, repeats: int = 5,
    input_grad: bool = True, scanned: bool = False,
) -> StageProfile:
    """Measure one stage. ``input_grad=False`` (the chain's first stage) leaves the input's
    gradient out of the backward, as a training step never computes it. ``scanned=True`` (a
    :class:`~jaxremat.Repeat`'s copies, stored inside a loop) counts in ``xbar`` at least what
    the loop saves (:func:`scan_residual_bytes`)."""
    g = _stage_fn(st)
    params, rest = _split_params(abstract(variables))  # shapes only: works under a trace
    rng = jax.random.key(0)
    out_shape = jax.eval_shape(g, params, a_shape, rest, rng)
    cot_shape = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), out_shape)
    xbar = kept_bytes(g, params, a_shape, rest, rng, cot_shape)
    if scanned:
        xbar = max(xbar, scan_residual_bytes(g, params, a_shape, rest, rng))

    fwd_c = jax.jit(g).lower(params, a_shape, rest, rng).compile(REMAT_OPTIONS)
    def pullback(p, x, r, k):
        if input_grad:
            return jax.vjp(lambda p, x: g(p, x, r, k), p, x)[1]
        return jax.vjp(lambda p: g(p, x, r, k), p)[1]

    vjp_shape = jax.eval_shape(pullback, params, a_shape, rest, rng)
    bwd_c, bwd_tmp = transient_bytes(lambda f, c: f(c), vjp_shape, cot_shape)
    ff, fb = _cost(fwd_c)
    bf, bb = _cost(bwd_c)
    if method == "xla":
        assert rates is not None
        ft = max(ff / rates.flops, fb / rates.bandwidth)
        bt = max(bf / rates.flops, bb / rates.bandwidth)
    else:
        concrete = lambda s: jnp.zeros(s.shape, s.dtype)  # noqa: E731
        a, params, rest = jax.tree.map(concrete, (a_shape, params, rest))
        cot = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), cot_shape)
        ft = median_time(fwd_c, params, a, rest, rng, repeats=repeats)
        both = jax.jit(lambda p, x, r, k, c: pullback(p, x, r, k)(c))
        bt = max(median_time(both, params, a, rest, rng, cot, repeats=repeats) - ft, 0.0)
    shape_txt = str(jax.tree.map(lambda s: tuple(s.shape), out_shape))
    return StageProfile(
        name=st.name, kind=st.kind, out_shape=shape_txt, x_out=tree_bytes(out_shape), xbar=int(xbar),
        fwd_tmp=int(fwd_c.memory_analysis().temp_size_in_bytes),
        bwd_tmp=int(bwd_tmp),
        fwd_flops=ff, bwd_flops=bf, fwd_bytes=fb, bwd_bytes=bb, fwd_time=ft, bwd_time=bt,
    )


__all__ = ["StageProfile", "kept_bytes", "profile_stage", "scan_residual_bytes"]
