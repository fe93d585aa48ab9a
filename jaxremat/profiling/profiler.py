"""From a :class:`~jaxremat.chain.Chain` to the :class:`~jaxremat.ChainCosts` XLA will really use."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jax_core

from jaxremat import cache as disk_cache
from jaxremat.chain import Chain, Stage, tree_bytes
from jaxremat.costs import ChainCosts
from jaxremat.xla_memory import REMAT_OPTIONS, bytes_kept_across_barrier, transient_bytes


# Bump when what a measurement means changes, so that cached profiles from before are not reused.
PROFILE_VERSION = 4


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


def _abstract(leaf: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype)


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
    params, rest = _split_params(jax.tree.map(_abstract, variables))  # shapes only: works under a trace
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
        ft = _median_time(fwd_c, params, a, rest, rng, repeats=repeats)
        both = jax.jit(lambda p, x, r, k, c: pullback(p, x, r, k)(c))
        bt = max(_median_time(both, params, a, rest, rng, cot, repeats=repeats) - ft, 0.0)
    shape_txt = str(jax.tree.map(lambda s: tuple(s.shape), out_shape))
    return StageProfile(
        name=st.name, kind=st.kind, out_shape=shape_txt, x_out=tree_bytes(out_shape), xbar=int(xbar),
        fwd_tmp=int(fwd_c.memory_analysis().temp_size_in_bytes),
        bwd_tmp=int(bwd_tmp),
        fwd_flops=ff, bwd_flops=bf, fwd_bytes=fb, bwd_bytes=bb, fwd_time=ft, bwd_time=bt,
    )


def _signature(tree: Any) -> list:
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return [(jax.tree_util.keystr(p), tuple(np.shape(x)), str(np.dtype(getattr(x, "dtype", np.float32)))) for p, x in leaves]


@contextlib.contextmanager
def _progress(total: int, quiet: bool):
    """A rich progress bar on a terminal; nothing when quiet or when stderr is not a terminal."""
    if quiet or not sys.stderr.isatty():
        yield lambda: None
        return
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task("profiling stages", total=total)
        yield lambda: bar.advance(task)


# Vendor peaks for common GPUs, matched against ``device_kind``: dense TF32 tensor-core flop/s
# (JAX's default precision for float32 matmuls there) and memory bandwidth in bytes/s.
GPU_RATES = {
    "H200": Rates(flops=494.7e12, bandwidth=4.8e12),
    "H100": Rates(flops=494.7e12, bandwidth=3.35e12),
    "A100": Rates(flops=156e12, bandwidth=2.0e12),
    "L40S": Rates(flops=183e12, bandwidth=0.864e12),
    "L4": Rates(flops=60e12, bandwidth=0.3e12),
    "A10": Rates(flops=62.5e12, bandwidth=0.6e12),
    "V100": Rates(flops=15.7e12, bandwidth=0.9e12),
    "T4": Rates(flops=8.1e12, bandwidth=0.32e12),
}


def device_rates(use_cache: bool | None = None) -> Rates:
    """Rates for the default device: the table above for a known GPU, else :func:`cached_rates`."""
    kind = jax.devices()[0].device_kind
    for name, rates in GPU_RATES.items():
        if jax.default_backend() == "gpu" and name.lower() in kind.lower():
            return rates
    return cached_rates(use_cache)


def cached_rates(use_cache: bool | None = None) -> Rates:
    """This device's rates, measured once by a micro-benchmark and kept in the cache folder."""
    key = disk_cache.make_key("rates", jax.default_backend(), jax.devices()[0].device_kind)
    if disk_cache.enabled(use_cache):
        entry = disk_cache.load(key)
        if entry is not None:
            try:
                return Rates(**entry)
            except TypeError:
                pass
    rates = measure_rates()
    if disk_cache.enabled(use_cache):
        disk_cache.store(key, dataclasses.asdict(rates))
    return rates


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
    cache: bool | None = None,
    quiet: bool = False,
) -> tuple[ChainCosts, list[StageProfile]]:
    """Profile every stage of ``chain`` on inputs shaped like ``sample``.

    ``x`` comes from the shapes, ``xbar`` from the bytes XLA keeps across an optimisation
    barrier between each stage's forward and backward, ``fwd_tmp`` / ``bwd_tmp`` from the
    compiled temp memory of the stage's forward and of its backward, times from wall-clock
    medians (``"measure"``: the forward alone, and the forward-plus-backward minus it) or from
    the compiled flops and bytes against device rates (``"xla"``, deterministic given
    ``rates``; measured once by :func:`measure_rates` when not given).

    Identical stages (same structure, variable shapes and input shapes) are measured once.
    Results are cached on disk (:mod:`jaxremat.cache`) unless ``cache=False`` or
    ``JAXREMAT_CACHE=0``; a progress bar shows on a terminal unless ``quiet``. Profiling uses its
    own RNG key and never changes ``variables``.

    Returns the costs and the per-stage measurements (flops and bytes accessed included).
    """
    if method not in ("measure", "xla"):
        raise ValueError(f"method must be 'measure' or 'xla', got {method!r}")
    if method == "xla" and rates is None:
        rates = device_rates(use_cache=cache)
    shapes = chain.shapes(variables, sample)
    per_stage = chain.split(variables)
    scanned = [chain.group_of(i) is not None for i in range(len(chain))]
    use_disk = disk_cache.enabled(cache)
    seen: dict[str, StageProfile] = {}  # identical stages are measured once
    stages: list[StageProfile] = []
    with _progress(len(chain), quiet) as advance:
        for i, (st, v) in enumerate(zip(chain.stages, per_stage)):
            key = disk_cache.make_key(
                "stage", PROFILE_VERSION, i == 0, scanned[i], st.key or st.name, _signature(v), _signature(shapes[i]), method,
                None if rates is None else dataclasses.asdict(rates), repeats if method == "measure" else 0,
                jax.default_backend(), jax.__version__,
            )
            prof = seen.get(key)
            if prof is None and use_disk and st.key:
                entry = disk_cache.load(key)
                if entry is not None:
                    try:
                        prof = StageProfile(**entry)
                    except TypeError:
                        prof = None
            if prof is None:
                prof = profile_stage(
                    st, v, shapes[i], method=method, rates=rates, repeats=repeats, input_grad=i > 0, scanned=scanned[i]
                )
                if use_disk and st.key:
                    disk_cache.store(key, dataclasses.asdict(prof))
            seen[key] = prof
            stages.append(dataclasses.replace(prof, name=st.name, kind=st.kind))
            advance()
    costs = ChainCosts(
        x=[tree_bytes(s) for s in shapes],
        xbar=[p.xbar for p in stages],
        fwd=[p.fwd_time for p in stages],
        bwd=[p.bwd_time for p in stages],
        fwd_tmp=[p.fwd_tmp for p in stages],
        bwd_tmp=[p.bwd_tmp for p in stages],
        names=[p.name for p in stages],
        fwd_flops=[p.fwd_flops for p in stages],
        bwd_flops=[p.bwd_flops for p in stages],
        fwd_bytes=[p.fwd_bytes for p in stages],
        bwd_bytes=[p.bwd_bytes for p in stages],
    )
    return costs, stages


def profile(chain: Chain, variables: Any, sample: Any, **options: Any) -> ChainCosts:
    """The :class:`~jaxremat.ChainCosts` of ``chain``; ``options`` as for :func:`profile_stages`
    (``method``, ``rates``, ``repeats``, ``cache``, ``quiet``)."""
    return profile_stages(chain, variables, sample, **options)[0]


def report(stages: list[StageProfile]) -> str:
    """A table of the profile: per stage name, module type, output shape, sizes, temps and times."""
    from jaxremat.units import format_bytes

    head = ("stage", "type", "output", "x", "xbar", "fwd_tmp", "bwd_tmp", "fwd ms", "bwd ms")
    rows = [
        (
            p.name, p.kind, p.out_shape, format_bytes(p.x_out), format_bytes(p.xbar), format_bytes(p.fwd_tmp),
            format_bytes(p.bwd_tmp), f"{1e3 * p.fwd_time:.3f}", f"{1e3 * p.bwd_time:.3f}",
        )
        for p in stages
    ]
    widths = [max(len(str(r[k])) for r in [head, *rows]) for k in range(len(head))]
    fmt = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(head), fmt(tuple("-" * w for w in widths))] + [fmt(r) for r in rows])
