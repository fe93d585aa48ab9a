"""A :class:`~jaxremat.Device` budget for :func:`jaxremat.remat`: what the whole step may use.

The training step holds its arguments and outputs (parameters, optimizer state, the inputs; the
new parameters and state are written over the donated old ones) beside its temporaries. A device
budget gives the temporaries what the device has left: its usable memory (less the allocator's
headroom) less what the step holds. That is known from shapes before anything is compiled
(:func:`held_bytes`), and read again from XLA's memory analysis of every step verification
compiles (:attr:`~jaxremat.api.verify.Measured.held`): where XLA holds more (an output it does not
write over its donated input), the plan is made again for what XLA said.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax

from jaxremat.api.calibrate import measured_optimizer
from jaxremat.api.verify_step import differentiated
from jaxremat.core.device import Device
from jaxremat.core.schedule import InfeasibleBudget
from jaxremat.core.units import format_bytes
from jaxremat.model.trees import tree_bytes


def held_bytes(flat: Sequence[Any], first: int, optimizer: Any = None) -> int:
    """What the step's arguments and outputs hold beyond what donation writes over, from shapes:
    every input of the function (``flat``, its array leaves), the optimizer state of the leaves
    it differentiates (:func:`~jaxremat.api.verify_step.differentiated`), and the loss."""
    opt = optimizer or measured_optimizer()
    state = jax.eval_shape(opt.init, [flat[n] for n in differentiated(flat, first)])
    return tree_bytes(list(flat)) + tree_bytes(state) + 4


def temp_budget(device: Device, held: int) -> int:
    """Bytes left to the step's temporaries (at least 1: a budget the solver then refuses, naming
    the least it needs)."""
    return max(1, device.usable() - held)


def describe(device: Device, held: int) -> str:
    """What the budget was asked as, for the plan's report."""
    return (
        f"{device.describe()}, less {format_bytes(held)} the step holds in parameters, optimizer state and inputs"
    )


def refusal(e: InfeasibleBudget, device: Device, held: int) -> InfeasibleBudget:
    """``e`` (in the temporaries' bytes) said in the device's: the least memory the step needs,
    and the device that would give it with this headroom."""
    least = held + e.min_budget
    need = int(math.ceil(least / (1.0 - device.headroom)))
    note = (
        f"the step needs at least {format_bytes(least)} ({format_bytes(held)} of parameters, optimizer state and "
        f"inputs, {format_bytes(e.min_budget)} of activations and other temporaries), a device of at least "
        f"{format_bytes(need)} with {device.headroom:.0%} headroom; this is a {device.describe()}"
        + (f"; {e.note}" if e.note else "")
    )
    return InfeasibleBudget(e.algorithm, device.usable(), least, note=note)


__all__ = ["describe", "held_bytes", "refusal", "temp_budget"]
