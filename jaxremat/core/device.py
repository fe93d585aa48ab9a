"""A budget for the whole training step on a device: ``jaxremat.Device("16GiB")``.

A byte or share budget bounds the activations alone (XLA's temp memory of the step). What a user
knows is their accelerator: 80 GB, 24 GB. On a device, the step needs at once what its arguments
and outputs hold (parameters, optimizer state, the batch; with parameters and state donated their
new values are written over the old ones), its temporaries (activations, gradients, the update's
transients), and some room the allocator loses to fragmentation. A :class:`Device` budget is the
first and last of these taken from the device's memory: what is left bounds the temporaries, as a
byte budget does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax

from jaxremat.core.units import format_bytes, parse_bytes

#: The share of the device's memory kept free for the allocator by default. XLA's GPU allocator
#: (BFC) rounds each buffer up and can fragment; 5% is a starting value, not yet measured on a GPU
#: with a device budget (``benchmarks/gpu_check.py`` reads ``peak_bytes_in_use`` against the plan
#: to measure it). On the CPU nothing allocates from a fixed pool: the figure is what XLA's memory
#: analysis of the compiled step says, headroom apart.
DEFAULT_HEADROOM = 0.05


@dataclass(frozen=True)
class Device:
    """The memory of a device, for the whole training step: ``budget=jaxremat.Device("16GiB")``.

    Args:
      memory: bytes, a string with a unit (``"16GiB"``, ``"24GB"``), or ``"device"``: the first
        local device's allocator limit (``memory_stats()["bytes_limit"]``, on a GPU; the CPU has
        none, so there the size must be given).
      headroom: the share of ``memory`` kept free for the allocator (:data:`DEFAULT_HEADROOM`).
      optimizer: the ``optax`` optimizer of the training step, whose state the step holds
        (default: Adam, two moments per parameter, as
        :func:`~jaxremat.api.calibrate.measured_optimizer`).

    The step planned for is ``jax.grad`` of the function's loss with respect to its first
    argument, followed by ``optimizer``'s update, parameters and state donated: what it holds in
    arguments and outputs is read from XLA's memory analysis of that step as compiled by
    verification, and the plan's activations get the rest.
    """

    memory: int | float | str = "device"
    headroom: float = DEFAULT_HEADROOM
    optimizer: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.headroom < 1:
            raise ValueError(f"jaxremat.Device: headroom is a share of the memory in [0, 1), got {self.headroom!r}")
        if self.memory != "device":
            try:
                size = parse_bytes(self.memory)
            except (TypeError, ValueError) as e:
                raise ValueError(
                    f"jaxremat.Device({self.memory!r}): give bytes ('16GiB', 24e9) or 'device' (the GPU's own): {e}"
                ) from None
            if size <= 0:
                raise ValueError(f"jaxremat.Device({self.memory!r}): the memory must be positive")

    def limit(self) -> int:
        """The device's memory in bytes: ``memory``, or the allocator's limit for ``"device"``."""
        if self.memory != "device":
            return parse_bytes(self.memory)
        device = jax.local_devices()[0]
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
        if not stats or "bytes_limit" not in stats:
            raise ValueError(
                f"jaxremat.Device('device'): the {device.platform.upper()} reports no memory limit; "
                "give the size, e.g. jaxremat.Device('16GiB')"
            )
        return int(stats["bytes_limit"])

    def usable(self) -> int:
        """Bytes the step may use: :meth:`limit` less the headroom."""
        return int(math.floor(self.limit() * (1.0 - self.headroom)))

    def describe(self) -> str:
        """``"device 16.00 GiB, 5% headroom"``, for a report."""
        return f"device {format_bytes(self.limit())}, {self.headroom:.0%} headroom"


__all__ = ["DEFAULT_HEADROOM", "Device"]
