"""The two links between device and host memory that offloading uses (``docs/cost_model.md``,
*Offloading*): their bandwidths, one per direction."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union

BandwidthLike = Union["Bandwidth", float, int, tuple[float, float], list]


@dataclass(frozen=True)
class Bandwidth:
    """Bytes per time unit of the device-to-host link (``to_host``) and of the host-to-device
    link (``to_device``). Each link carries one copy at a time, beside compute.

    Times are in the chain's time unit: with profiled costs (seconds), ``Bandwidth(25e9, 25e9)``
    is 25 GB/s each way.
    """

    to_host: float
    to_device: float

    def __post_init__(self):
        for name in ("to_host", "to_device"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"bandwidth {name} must be a finite number of bytes per time unit > 0, got {v!r}")

    @classmethod
    def of(cls, bandwidth: BandwidthLike, *, what: str = "bandwidth") -> "Bandwidth":
        """A :class:`Bandwidth` from one number (both directions) or a pair
        ``(to_host, to_device)``; ``ValueError`` saying what would work otherwise."""
        if isinstance(bandwidth, Bandwidth):
            return bandwidth
        if isinstance(bandwidth, (tuple, list)):
            if len(bandwidth) != 2:
                raise ValueError(
                    f"{what} as a pair is (to_host, to_device), got {len(bandwidth)} values: {bandwidth!r}"
                )
            pair = tuple(bandwidth)
        elif isinstance(bandwidth, (int, float)) and not isinstance(bandwidth, bool):
            pair = (bandwidth, bandwidth)
        else:
            raise ValueError(
                f"{what} must be bytes per time unit (a number > 0) or a pair (to_host, to_device), got {bandwidth!r}"
            )
        try:
            return cls(float(pair[0]), float(pair[1]))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{what} {bandwidth!r}: {e}") from None

    def seconds(self, nbytes: int, direction: str) -> float:
        """The time one copy of ``nbytes`` takes, ``direction`` ``"to_host"`` or ``"to_device"``."""
        return float(nbytes) / getattr(self, direction)


__all__ = ["Bandwidth", "BandwidthLike"]
