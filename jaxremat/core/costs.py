"""The chain cost model of ``docs/cost_model.md``: sizes, times and temporaries per stage."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxremat.core.units import format_bytes

_SIZE_FIELDS = ("x", "xbar", "fwd_tmp", "bwd_tmp")
_TIME_FIELDS = ("fwd", "bwd")
FIELDS = ("x", "xbar", "fwd", "bwd", "fwd_tmp", "bwd_tmp")
OPTIONAL_FIELDS = ("fwd_flops", "bwd_flops", "fwd_bytes", "bwd_bytes")  # from XLA's cost analysis


def _as_array(name: str, values: Any, *, integral: bool) -> np.ndarray:
    try:
        raw = list(values)
    except TypeError:
        raise ValueError(f"ChainCosts.{name} must be a sequence of numbers, got {type(values).__name__}") from None
    out = []
    for i, v in enumerate(raw):
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"ChainCosts.{name}[{i}] is not a number: {v!r}") from None
        if math.isnan(f):
            raise ValueError(f"ChainCosts.{name}[{i}] is NaN; every entry must be a finite number >= 0")
        if math.isinf(f):
            raise ValueError(f"ChainCosts.{name}[{i}] is infinite; every entry must be a finite number >= 0")
        if f < 0:
            raise ValueError(f"ChainCosts.{name}[{i}] is negative ({v!r}); every entry must be >= 0")
        if integral:
            if isinstance(v, (int, np.integer)):
                out.append(int(v))
            elif f != math.floor(f):
                raise ValueError(f"ChainCosts.{name}[{i}] = {v!r} is not a whole number of bytes")
            else:
                out.append(int(f))
        else:
            out.append(f)
    arr = np.array(out, dtype=np.int64 if integral else np.float64)
    arr.setflags(write=False)
    return arr


@dataclass(frozen=True, eq=False)
class ChainCosts:
    """Per-stage costs of a chain of ``L`` stages (see ``docs/cost_model.md``).

    Args:
      x: ``L+1`` sizes in bytes of the activations ``a_0 .. a_L`` (and of their gradients).
      xbar: ``L`` bytes kept when stage ``i`` runs in store-all mode: its residuals plus its
        output ``a_{i+1}``, not its input.
      fwd, bwd: ``L`` forward and backward times (seconds, or any one unit).
      fwd_tmp, bwd_tmp: ``L`` transient bytes while the stage's forward / backward runs.
      names: optional ``L`` stage names for reports.
      fwd_flops, bwd_flops, fwd_bytes, bwd_bytes: optional ``L`` flops and bytes accessed of each
        stage's forward and backward (the profiler fills them from XLA's cost analysis).

    Arrays are stored as read-only numpy arrays (sizes as ``int64``, times as ``float64``).
    """

    x: np.ndarray
    xbar: np.ndarray
    fwd: np.ndarray
    bwd: np.ndarray
    fwd_tmp: np.ndarray
    bwd_tmp: np.ndarray
    names: tuple[str, ...] | None = None
    fwd_flops: np.ndarray | None = None
    bwd_flops: np.ndarray | None = None
    fwd_bytes: np.ndarray | None = None
    bwd_bytes: np.ndarray | None = None

    def __post_init__(self) -> None:
        for name in FIELDS:
            arr = _as_array(name, getattr(self, name), integral=name in _SIZE_FIELDS)
            object.__setattr__(self, name, arr)
        n = len(self.xbar)
        if n == 0:
            raise ValueError("ChainCosts describes an empty chain: xbar has no entries; a chain needs >= 1 stage")
        if len(self.x) != n + 1:
            raise ValueError(
                f"ChainCosts.x has {len(self.x)} entries but xbar has {n}: x needs L+1 = {n + 1} "
                "(one per activation a_0..a_L)"
            )
        for name in ("fwd", "bwd", "fwd_tmp", "bwd_tmp"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"ChainCosts.{name} has {len(getattr(self, name))} entries; expected L = {n} (one per stage)"
                )
        for name in OPTIONAL_FIELDS:
            value = getattr(self, name)
            if value is not None:
                arr = _as_array(name, value, integral=False)
                if len(arr) != n:
                    raise ValueError(f"ChainCosts.{name} has {len(arr)} entries; expected L = {n} (one per stage)")
                object.__setattr__(self, name, arr)
        if self.names is not None:
            names = tuple(str(s) for s in self.names)
            if len(names) != n:
                raise ValueError(f"ChainCosts.names has {len(names)} entries; expected L = {n}")
            object.__setattr__(self, "names", names)

    @property
    def length(self) -> int:
        """Number of stages ``L``."""
        return len(self.xbar)

    def __len__(self) -> int:
        return self.length

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ChainCosts):
            return NotImplemented
        return self.names == other.names and all(
            np.array_equal(getattr(self, f), getattr(other, f)) for f in FIELDS
        )

    def __hash__(self) -> int:
        return hash(tuple(getattr(self, f).tobytes() for f in FIELDS))

    def __repr__(self) -> str:
        return (
            f"ChainCosts(L={self.length}, x0={format_bytes(self.x[0])}, "
            f"sum(xbar)={format_bytes(self.xbar.sum())}, "
            f"fwd={self.fwd.sum():.4g}, bwd={self.bwd.sum():.4g})"
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain lists (JSON-ready)."""
        d: dict[str, Any] = {f: getattr(self, f).tolist() for f in FIELDS}
        if self.names is not None:
            d["names"] = list(self.names)
        d.update({f: getattr(self, f).tolist() for f in OPTIONAL_FIELDS if getattr(self, f) is not None})
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ChainCosts":
        missing = [f for f in FIELDS if f not in d]
        if missing:
            raise ValueError(f"ChainCosts.from_dict: missing field(s) {missing}")
        return cls(**{f: d[f] for f in FIELDS}, names=d.get("names"), **{f: d.get(f) for f in OPTIONAL_FIELDS})

    @classmethod
    def uniform(
        cls,
        length: int,
        *,
        x: int,
        xbar: int,
        fwd: float = 1.0,
        bwd: float = 2.0,
        fwd_tmp: int = 0,
        bwd_tmp: int = 0,
    ) -> "ChainCosts":
        """A chain of ``length`` identical stages."""
        return cls(
            x=[x] * (length + 1),
            xbar=[xbar] * length,
            fwd=[fwd] * length,
            bwd=[bwd] * length,
            fwd_tmp=[fwd_tmp] * length,
            bwd_tmp=[bwd_tmp] * length,
        )

    def table(self, time_unit: str = "ms") -> str:
        """Per stage: name, output size, store-all size, temporaries, times (seconds shown in
        ``time_unit``: "s", "ms" or "us") and, when known, forward and backward GFLOP."""
        scale = {"s": 1.0, "ms": 1e3, "us": 1e6}[time_unit]
        head = ["stage", "x (out)", "xbar", "fwd_tmp", "bwd_tmp", f"fwd {time_unit}", f"bwd {time_unit}"]
        flops = self.fwd_flops is not None and self.bwd_flops is not None
        if flops:
            head += ["fwd GFLOP", "bwd GFLOP"]
        rows = [head]
        for i in range(self.length):
            row = [
                self.stage_name(i), format_bytes(self.x[i + 1]), format_bytes(self.xbar[i]),
                format_bytes(self.fwd_tmp[i]), format_bytes(self.bwd_tmp[i]),
                f"{scale * self.fwd[i]:.4g}", f"{scale * self.bwd[i]:.4g}",
            ]
            if flops:
                row += [f"{self.fwd_flops[i] / 1e9:.4g}", f"{self.bwd_flops[i] / 1e9:.4g}"]
            rows.append(row)
        widths = [max(len(r[k]) for r in rows) for k in range(len(head))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.insert(0, f"input a_0: {format_bytes(self.x[0])}")
        return "\n".join(lines)

    def stage_name(self, i: int) -> str:
        return self.names[i] if self.names is not None else f"stage {i}"

