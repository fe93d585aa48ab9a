"""Byte sizes: parsing what users write, printing what people read (budgets: :mod:`jaxremat.core.budgets`)."""

from __future__ import annotations

import math
import re
from numbers import Integral, Real

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}

BUDGET_FORMS = (
    "an int of bytes (1_000_000), a string with a unit ('512MiB', '2GB', '1.5 GiB', "
    "'4096'; units B, kB, MB, GB, TB, KiB, MiB, GiB, TiB) or a share of the store-all "
    "peak ('40%')"
)

_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str) -> int:
    """Return a byte count from an int, a whole float, or a string such as ``"512MiB"``.

    Fractional byte counts round down (a budget never grows by parsing).
    """
    if isinstance(value, bool):
        raise ValueError(f"cannot read a byte size from {value!r}; expected {BUDGET_FORMS}")
    if isinstance(value, Integral):
        n = int(value)
    elif isinstance(value, Real):
        if not math.isfinite(value):
            raise ValueError(f"a byte size must be finite, got {value!r}")
        n = int(math.floor(value))
    elif isinstance(value, str):
        match = _NUMBER_UNIT.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"cannot read a byte size from {value!r}; expected {BUDGET_FORMS}")
        n = int(math.floor(float(match.group(1)) * _UNITS[unit]))
    else:
        raise ValueError(f"cannot read a byte size from {type(value).__name__} {value!r}; expected {BUDGET_FORMS}")
    if n < 0:
        raise ValueError(f"a byte size must be >= 0, got {value!r}")
    return n


def format_bytes(n: int | float) -> str:
    """Format a byte count in binary units: ``1536 -> '1.50 KiB'``."""
    n = float(n)
    if not math.isfinite(n):
        return str(n)
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
