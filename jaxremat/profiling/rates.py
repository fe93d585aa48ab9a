"""Device rates for the estimated time models (``method="flops"`` and the ``"xla"`` roofline):
vendor peaks of known GPUs, or a measured micro-benchmark."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxremat.profiling import cache as disk_cache


@dataclass(frozen=True)
class Rates:
    """Device rates for the ``"xla"`` roofline estimate: flop/s and bytes/s."""

    flops: float
    bandwidth: float


#: The profile methods that estimate times from XLA's cost analysis instead of timing programs.
#: ``"flops"``: a program's compiled flops at the device's flop rate. It ranks schedules as
#: verification does (:mod:`jaxremat.api.verify`: by the flops of the compiled step), so the plan
#: is the schedule verification would pick among those that fit. Under the ``"xla"`` roofline
#: (flops or bytes accessed, whichever takes longer) a 12-block GPT's 50% plan was priced 0.89x
#: the time of every block under ``dots_saveable`` in 1.12x its flops and ran 1.05x its time;
#: verification then compiled two hand strategies to replace it, 3 compiles of the step instead
#: of 1 (CPU, 2026-12-06). With the leanest plan (:mod:`~jaxremat.solvers.lean`), the steps planned
#: at 30-75% of the store-all peak of the built-in ResNet and GPT, the loop MLP, the NNX list, the
#: CNN and a scanned decoder ran 0.88-1.05x those of the roofline's fastest plans, in 17
#: compiles of the step instead of 26 (``benchmarks/results/time_models.md``).
ESTIMATED = ("flops", "xla")


def estimated_time(method: str, rates: Rates, flops: float, nbytes: float) -> float:
    """A program's time under an estimated time model (:data:`ESTIMATED`): ``"flops"`` its
    flops at ``rates.flops``, ``"xla"`` the roofline (bytes accessed at ``rates.bandwidth`` where
    that takes longer)."""
    if method == "flops":
        return flops / rates.flops
    return max(flops / rates.flops, nbytes / rates.bandwidth)


def median_time(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


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
    t = median_time(mm, a, repeats=repeats)
    big = jnp.ones((16 * 2**20,), jnp.float32)
    cp = jax.jit(lambda b: b * 1.0001)
    tc = median_time(cp, big, repeats=repeats)
    return Rates(flops=2 * size**3 / t, bandwidth=2 * big.nbytes / tc)


__all__ = [
    "ESTIMATED",
    "GPU_RATES",
    "Rates",
    "cached_rates",
    "device_rates",
    "estimated_time",
    "measure_rates",
    "median_time",
]
