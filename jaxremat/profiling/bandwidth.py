"""The bandwidths of the links between device and host memory, measured once per device kind.

A jitted ``jax.device_put`` of a large array to ``jax.memory.Space.Host`` and one back, timed
(median of a few calls after a warm-up) and cached on disk with the stage profiles. On the CPU
host and device memory are one and nothing moves, so there is nothing to measure: planning
offload there needs ``bandwidth=`` given.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from jaxremat.core.transfers import Bandwidth
from jaxremat.profiling import cache

PROBE_BYTES = 256 * 2**20  # large enough that launch latency is a small share


def _time(f, x, repeats: int) -> float:
    jax.block_until_ready(f(x))  # compile and warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def measure_bandwidth(nbytes: int = PROBE_BYTES, repeats: int = 5) -> Bandwidth:
    """Bytes per second each way between the default device's memory and pinned host memory."""
    device = jax.devices()[0]
    if device.platform == "cpu":
        raise ValueError(
            "on the CPU, host and device memory are one and offloading moves nothing, so there is no "
            "bandwidth to measure: give bandwidth= (bytes per second, one number or (to_host, to_device)) "
            "to plan as for an accelerator, or plan with algorithm='optimal'"
        )
    x = jnp.zeros((nbytes // 4,), jnp.float32)
    to_host = jax.jit(lambda a: jax.device_put(a, jax.memory.Space.Host))
    to_device = jax.jit(lambda a: jax.device_put(a, jax.memory.Space.Device))
    on_host = jax.block_until_ready(to_host(x))
    return Bandwidth(nbytes / _time(to_host, x, repeats), nbytes / _time(to_device, on_host, repeats))


def link_bandwidth(use_cache: bool | None = None) -> Bandwidth:
    """:func:`measure_bandwidth`, cached per device kind (``JAXREMAT_CACHE=0`` measures again)."""
    device = jax.devices()[0]
    key = cache.make_key("link-bandwidth", device.platform, getattr(device, "device_kind", ""), jax.__version__)
    if cache.enabled(use_cache) and device.platform != "cpu":
        hit = cache.load(key)
        if hit is not None:
            return Bandwidth(float(hit["to_host"]), float(hit["to_device"]))
    found = measure_bandwidth()
    if cache.enabled(use_cache):
        cache.store(key, {"to_host": found.to_host, "to_device": found.to_device})
    return found


__all__ = ["PROBE_BYTES", "link_bandwidth", "measure_bandwidth"]
