"""Store options: a stage stored under a checkpoint policy (``docs/cost_model.md``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


def check_options(value: Any, n: int) -> tuple[tuple["StageOption", ...], ...] | None:
    """``ChainCosts.options`` checked: ``None``, or per stage a sequence of options."""
    if value is None:
        return None
    try:
        per_stage = list(value)
    except TypeError:
        raise ValueError(
            f"ChainCosts.options must be None or one sequence of StageOption per stage, got {value!r}"
        ) from None
    if len(per_stage) != n:
        raise ValueError(
            f"ChainCosts.options has {len(per_stage)} entries; expected L = {n} (one tuple of options per stage)"
        )
    out = []
    for i, options in enumerate(per_stage):
        if options is None:
            options = ()
        if isinstance(options, (str, StageOption, dict)):
            raise ValueError(
                f"ChainCosts.options[{i}] must be a sequence of StageOption (one stage's options), got {options!r}"
            )
        got = tuple(
            StageOption.of(o, f"ChainCosts.options[{i}][{k}] (stage {i}, option {k + 1})")
            for k, o in enumerate(options)
        )
        names = [o.name for o in got]
        if len(set(names)) != len(names):
            raise ValueError(f"ChainCosts.options[{i}] names a policy twice: {names}")
        out.append(got)
    return tuple(out) if any(out) else None


@dataclass(frozen=True)
class StageOption:
    """A stage stored under a checkpoint policy (``docs/cost_model.md``, *Stage options*).

    Attributes:
      name: the policy's name, as the executor knows it (``"dots_saveable"``, or a name given in
        ``policies=``).
      xbar: bytes the bundle keeps: the residuals the policy saves, plus the stage output.
      bwd: the backward's time, the recomputation of what the policy does not keep included.
      bwd_tmp: the backward's transient bytes, the recomputed residuals included.
      unread: bytes of the stage output (in ``xbar``) that the backward does not read: XLA frees
        them once the next stage's backward (or the loss) has read them, before this backward runs.
    """

    name: str
    xbar: int
    bwd: float
    bwd_tmp: int
    bwd_flops: float | None = None  # from XLA's cost analysis, when profiled
    unread: int = 0

    @classmethod
    def of(cls, value: Any, where: str) -> "StageOption":
        """A :class:`StageOption` from itself, a dict or a ``(name, xbar, bwd, bwd_tmp)`` tuple,
        checked; ``ValueError`` naming ``where`` when it is not one."""
        try:
            flops, unread = None, 0
            if isinstance(value, StageOption):
                name, xbar, bwd, bwd_tmp, flops = value.name, value.xbar, value.bwd, value.bwd_tmp, value.bwd_flops
                unread = value.unread
            elif isinstance(value, dict):
                name, xbar, bwd, bwd_tmp = (value[k] for k in ("name", "xbar", "bwd", "bwd_tmp"))
                flops, unread = value.get("bwd_flops"), value.get("unread", 0)
            else:
                name, xbar, bwd, bwd_tmp = value
        except (TypeError, ValueError, KeyError):
            raise ValueError(
                f"{where} must be a jaxremat.StageOption(name, xbar, bwd, bwd_tmp), got {value!r}"
            ) from None
        if not isinstance(name, str) or not name or name == STORE_ALL:
            raise ValueError(
                f"{where}.name must be a policy name (a non-empty string other than {STORE_ALL!r}), got {name!r}"
            )
        checked = []
        for field, v in (("xbar", xbar), ("bwd", bwd), ("bwd_tmp", bwd_tmp), ("unread", unread)):
            try:
                f = float(v)
            except (TypeError, ValueError):
                raise ValueError(f"{where}.{field} is not a number: {v!r}") from None
            if not math.isfinite(f) or f < 0 or (field != "bwd" and f != math.floor(f)):
                what = "a finite number >= 0" if field == "bwd" else "a whole number of bytes >= 0"
                raise ValueError(f"{where}.{field} = {v!r}; it must be {what}")
            checked.append(f if field == "bwd" else int(f))
        if checked[3] > checked[0]:
            raise ValueError(
                f"{where}.unread = {checked[3]} is more than its xbar ({checked[0]}): the output bytes "
                "the backward does not read are part of the bundle"
            )
        return cls(name, *checked[:3], None if flops is None else float(flops), checked[3])

    @property
    def bwd_need(self) -> int:
        """What ``B`` adds to the live bytes at its peak when the bundle's output was read by the
        next stage's backward (or the loss) before it: ``bwd_tmp`` less the output bytes it does
        not read (freed by then; may be negative)."""
        return self.bwd_tmp - self.unread


#: The name of option 0 of every stage: every residual kept.
STORE_ALL = "store_all"


__all__ = ["STORE_ALL", "StageOption", "check_options"]
