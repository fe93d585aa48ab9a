"""From a :class:`~jaxremat.chain.Chain` to the :class:`~jaxremat.ChainCosts` XLA will really use."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxremat.chain import Chain, Stage, tree_bytes
from jaxremat.costs import ChainCosts
from jaxremat.xla_memory import REMAT_OPTIONS, bytes_kept_across_barrier


@dataclass(frozen=True)
class Rates:
    """Device rates for the ``"xla"`` roofline estimate: flop/s and bytes/s."""

    flops: float
    bandwidth: float


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


def _median_time(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def profile_stage(
    st: Stage, variables: dict, a_shape: Any, *, method: str, rates: Rates | None, repeats: int = 5
) -> StageProfile:
    g = _stage_fn(st)
    params, rest = _split_params(variables)
    rng = jax.random.key(0)
    out_shape = jax.eval_shape(g, params, a_shape, rest, rng)
    cot_shape = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), out_shape)

    def kept(params, a, rest, rng, cot):
        out, vjp = jax.vjp(lambda p, x: g(p, x, rest, rng), params, a)
        done, cot, out = lax.optimization_barrier((_sum_leaves(out), cot, out))
        return done, vjp(cot), out

    _, xbar = bytes_kept_across_barrier(kept, params, a_shape, rest, rng, cot_shape)

    fwd_c = jax.jit(g).lower(params, a_shape, rest, rng).compile(REMAT_OPTIONS)
    vjp_shape = jax.eval_shape(lambda p, x, r, k: jax.vjp(lambda p, x: g(p, x, r, k), p, x)[1], params, a_shape, rest, rng)
    bwd_c = jax.jit(lambda f, c: f(c)).lower(vjp_shape, cot_shape).compile(REMAT_OPTIONS)
    ff, fb = _cost(fwd_c)
    bf, bb = _cost(bwd_c)
    if method == "xla":
        assert rates is not None
        ft = max(ff / rates.flops, fb / rates.bandwidth)
        bt = max(bf / rates.flops, bb / rates.bandwidth)
    else:
        concrete = lambda s: jnp.zeros(s.shape, s.dtype)  # noqa: E731
        a = jax.tree.map(concrete, a_shape)
        cot = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), cot_shape)
        ft = _median_time(fwd_c, params, a, rest, rng, repeats=repeats)
        both = jax.jit(lambda p, x, r, k, c: jax.vjp(lambda p, x: g(p, x, r, k), p, x)[1](c))
        bt = max(_median_time(both, params, a, rest, rng, cot, repeats=repeats) - ft, 0.0)
    shape_txt = str(jax.tree.map(lambda s: tuple(s.shape), out_shape))
    return StageProfile(
        name=st.name, kind=st.kind, out_shape=shape_txt, x_out=tree_bytes(out_shape), xbar=int(xbar),
        fwd_tmp=int(fwd_c.memory_analysis().temp_size_in_bytes),
        bwd_tmp=int(bwd_c.memory_analysis().temp_size_in_bytes),
        fwd_flops=ff, bwd_flops=bf, fwd_bytes=fb, bwd_bytes=bb, fwd_time=ft, bwd_time=bt,
    )


def measure_rates(size: int = 1024, repeats: int = 5) -> Rates:
    """This device's matmul flop/s and copy bytes/s (a short micro-benchmark)."""
    a = jnp.ones((size, size), jnp.float32)
    mm = jax.jit(lambda a: a @ a)
    t = _median_time(mm, a, repeats=repeats)
    big = jnp.ones((16 * 2**20,), jnp.float32)
    cp = jax.jit(lambda b: b * 1.0001)
    tc = _median_time(cp, big, repeats=repeats)
    return Rates(flops=2 * size**3 / t, bandwidth=2 * big.nbytes / tc)


def profile_stages(
    chain: Chain,
    variables: Any,
    sample: Any,
    *,
    method: str = "measure",
    rates: Rates | None = None,
    repeats: int = 5,
) -> tuple[ChainCosts, list[StageProfile]]:
    """Profile every stage of ``chain`` on inputs shaped like ``sample``.

    ``x`` comes from the shapes, ``xbar`` from the bytes XLA keeps across an optimisation
    barrier between each stage's forward and backward, ``fwd_tmp`` / ``bwd_tmp`` from the
    compiled temp memory of the stage's forward and of its backward, times from wall-clock
    medians (``"measure"``: the forward alone, and the forward-plus-backward minus it) or from
    the compiled flops and bytes against device rates (``"xla"``, deterministic given
    ``rates``; measured once by :func:`measure_rates` when not given).

    Returns the costs and the per-stage measurements (flops and bytes accessed included).
    """
    if method not in ("measure", "xla"):
        raise ValueError(f"method must be 'measure' or 'xla', got {method!r}")
    if method == "xla" and rates is None:
        rates = measure_rates()
    shapes = chain.shapes(variables, sample)
    per_stage = chain.split(variables)
    stages = [
        profile_stage(st, v, shapes[i], method=method, rates=rates, repeats=repeats)
        for i, (st, v) in enumerate(zip(chain.stages, per_stage))
    ]
    costs = ChainCosts(
        x=[tree_bytes(s) for s in shapes],
        xbar=[p.xbar for p in stages],
        fwd=[p.fwd_time for p in stages],
        bwd=[p.bwd_time for p in stages],
        fwd_tmp=[p.fwd_tmp for p in stages],
        bwd_tmp=[p.bwd_tmp for p in stages],
        names=[p.name for p in stages],
    )
    return costs, stages


def profile(
    chain: Chain,
    variables: Any,
    sample: Any,
    *,
    method: str = "measure",
    rates: Rates | None = None,
    repeats: int = 5,
) -> ChainCosts:
    """The :class:`~jaxremat.ChainCosts` of ``chain`` (see :func:`profile_stages`)."""
    return profile_stages(chain, variables, sample, method=method, rates=rates, repeats=repeats)[0]
