"""Budgets: what a user may write for a memory budget, and what it means in bytes.

A budget is an int of bytes, a string with a unit (``"512MiB"``, ``"2GB"``), or a share of the
*store-all peak* (``"40%"``): the peak activation memory of plain autodiff, the chain's input
``a_0`` included, parameters and optimizer state not. ``None`` means the store-all peak itself.
"""

from __future__ import annotations

import math
import re
from typing import Union

from jaxremat.core.costs import ChainCosts
from jaxremat.core.device import Device
from jaxremat.core.ops import store_all_ops
from jaxremat.core.simulator import simulate
from jaxremat.core.units import BUDGET_FORMS, format_bytes, parse_bytes

#: What a budget may be: bytes, a string with a unit or a share (``"40%"``), or ``None``.
Budget = Union[int, float, str, Device, None]

_PERCENT = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*%\s*$")


def store_all_peak(costs: ChainCosts) -> int:
    """Peak bytes of plain autodiff (every stage stored whole), ``a_0`` included."""
    return simulate(costs, store_all_ops(costs.length))[0]


def is_share(budget: Budget) -> bool:
    """Whether ``budget`` is a share of the store-all peak (``"40%"``)."""
    return isinstance(budget, str) and _PERCENT.match(budget) is not None


def check_budget(budget: Budget) -> Budget:
    """``budget`` as given, once it is known to be readable: ``None``, a share above 0%, or a
    positive number of bytes (an int, or a string with a unit). Raises :class:`ValueError`
    naming the forms that work, so that a decorator refuses a bad budget when it is applied,
    not at the first call after tracing and profiling."""
    if budget is None:
        return budget
    if isinstance(budget, Device):
        raise ValueError(
            f"{budget!r}: a device budget is for jaxremat.remat, which compiles the whole training step; "
            "here give the activations' bytes ('512MiB') or a share of the store-all peak ('40%')"
        )
    if is_share(budget):
        if float(_PERCENT.match(budget).group(1)) <= 0:
            raise ValueError(f"budget {budget!r}: a share of the store-all peak must be above 0% ('40%')")
        return budget
    if (isinstance(budget, (int, float)) and not isinstance(budget, bool) and budget <= 0) or parse_bytes(budget) <= 0:
        raise ValueError(f"budget {budget!r}: give a positive number of bytes ('512MiB', 2**30) or a share ('40%')")
    return budget


def describe_budget(budget: Budget, reference: int | ChainCosts, of: str = "the store-all peak") -> str:
    """What ``budget`` was asked as, for a report: ``"50% of the store-all peak, 16.08 MiB"`` for a
    share (``of`` names the reference: a ``Repeat``'s is the loop's store-all peak), ``"the
    store-all peak"`` for ``None``, ``""`` for bytes (the bytes say it)."""
    if budget is not None and not is_share(budget):
        return ""
    peak = store_all_peak(reference) if isinstance(reference, ChainCosts) else int(reference)
    if budget is None:
        return f"{of}, {format_bytes(peak)}"
    return f"{budget.strip()} of {of}, {format_bytes(peak)}"


def parse_budget(budget: Budget, reference: int | ChainCosts | None = None) -> int:
    """A budget in bytes.

    Args:
      budget: an int of bytes, a string with a unit (``"512MiB"``, ``"2GB"``) or a share of the
        store-all peak (``"40%"``); ``None`` is the store-all peak.
      reference: what a share or ``None`` is taken of: the store-all peak in bytes, or the
        chain's :class:`~jaxremat.ChainCosts` (whose store-all peak is computed).

    Raises:
      ValueError: the budget cannot be read, or it is a share (or ``None``) and no reference
        was given.
    """
    if budget is None or is_share(budget):
        if reference is None:
            raise ValueError(
                f"budget {budget!r} is a share of the store-all peak, which is not known here: pass the chain's "
                "costs or that peak in bytes as the reference (parse_budget(budget, costs)), or give bytes "
                "('512MiB', 2**30)"
            )
        peak = store_all_peak(reference) if isinstance(reference, ChainCosts) else int(reference)
        if budget is None:
            return peak
        share = float(_PERCENT.match(budget).group(1)) / 100.0
        return int(math.floor(share * peak))
    return parse_bytes(budget)


__all__ = ["BUDGET_FORMS", "Budget", "check_budget", "describe_budget", "is_share", "parse_budget", "store_all_peak"]
