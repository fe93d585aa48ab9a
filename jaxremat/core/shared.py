"""Values shared by several activations (``docs/cost_model.md``, *Shared values*)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Shared:
    """One value that is part of several activations: ``a_first .. a_last`` (``docs/cost_model.md``,
    *Shared values*), such as a U-Net's skip tensor, made by stage ``first - 1`` and read by stage
    ``last - 1``, passed unchanged by the stages between. ``x[k]`` counts it for each of those
    ``k``, but it is one buffer: the simulator and the solvers count it once however many of
    those activations are live.

    Attributes:
      first, last: the first and last activation that holds it (``1 <= first < last <= L``).
      nbytes: its size in bytes.
      name: optional, for reports.
    """

    first: int
    last: int
    nbytes: int
    name: str = ""

    @classmethod
    def of(cls, value: Any, where: str) -> "Shared":
        """A :class:`Shared` from itself, a dict or a ``(first, last, nbytes)`` tuple, checked
        for types; ``ValueError`` naming ``where`` when it is not one."""
        try:
            if isinstance(value, Shared):
                first, last, nbytes, name = value.first, value.last, value.nbytes, value.name
            elif isinstance(value, dict):
                first, last, nbytes, name = value["first"], value["last"], value["nbytes"], value.get("name", "")
            else:
                first, last, nbytes, *rest = value
                name = rest[0] if rest else ""
            first, last, nbytes = (int(v) if float(v) == int(v) else None for v in (first, last, nbytes))
        except (TypeError, ValueError, KeyError):
            raise ValueError(f"{where} must be a jaxremat.Shared(first, last, nbytes), got {value!r}") from None
        if first is None or last is None or nbytes is None or nbytes < 0:
            raise ValueError(f"{where} = {value!r}: first, last and nbytes must be whole numbers, nbytes >= 0")
        return cls(first, last, nbytes, str(name))


def check_shared(value: Any, x: np.ndarray) -> tuple[Shared, ...]:
    """``ChainCosts.shared`` checked against the activations' sizes ``x``."""
    try:
        items = list(value or ())
    except TypeError:
        raise ValueError(
            f"ChainCosts.shared must be a sequence of Shared(first, last, nbytes), got {value!r}"
        ) from None
    L = len(x) - 1
    out = tuple(Shared.of(v, f"ChainCosts.shared[{n}]") for n, v in enumerate(items))
    per_activation = np.zeros(L + 1, np.int64)
    for n, v in enumerate(out):
        if not 1 <= v.first < v.last <= L:
            raise ValueError(
                f"ChainCosts.shared[{n}] spans a_{v.first} .. a_{v.last}; a shared value spans at least two "
                f"activations among a_1 .. a_{L} (1 <= first < last <= L)"
            )
        per_activation[v.first : v.last + 1] += v.nbytes
    over = np.flatnonzero(per_activation > x)
    if len(over):
        k = int(over[0])
        raise ValueError(
            f"ChainCosts.shared: the values shared by a_{k} add up to {per_activation[k]} bytes, more than x[{k}] = "
            f"{x[k]} "
            "(x counts every value of the activation, shared ones included)"
        )
    return out


__all__ = ["Shared", "check_shared"]
