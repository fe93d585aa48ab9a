"""The ops of a schedule (``docs/cost_model.md``): one definition that every layer reads.

An op is ``Op(kind, stage)``, a named tuple, so ``("Fall", 3)`` written by hand is an op too and
op lists stay plain JSON. Its kind is an :class:`OpKind`, a ``str`` enum: ``OpKind.FALL == "Fall"``.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Iterable, NamedTuple


class OpKind(StrEnum):
    """What an op does (``docs/cost_model.md``, *Operations*)."""

    FCK = "Fck"  # forward, keeping the input (a checkpoint)
    FN = "Fn"  # forward, freeing a standalone input
    FALL = "Fall"  # forward keeping every residual (the bundle abar_i)
    LOSS = "Loss"  # the loss: makes delta_L
    B = "B"  # the backward of one stage


FORWARD_KINDS: frozenset[OpKind] = frozenset({OpKind.FCK, OpKind.FN, OpKind.FALL})


class Op(NamedTuple):
    """One op: ``kind`` on stage ``stage`` (``stage == L`` for the loss)."""

    kind: OpKind
    stage: int

    @classmethod
    def of(cls, op: Iterable, position: int = 0) -> "Op":
        """An :class:`Op` from any ``(kind, stage)`` pair; ``ValueError`` naming ``position``
        when ``op`` is not one."""
        try:
            kind, stage = op
            stage = int(stage)
        except (TypeError, ValueError):
            raise ValueError(f"op #{position} {op!r} is not a (kind, stage) pair") from None
        try:
            return cls(OpKind(str(kind)), stage)
        except ValueError:
            known = ", ".join(k.value for k in OpKind)
            raise ValueError(f"op #{position} ({kind!r}, {stage}): unknown op kind; expected one of {known}") from None

    def __repr__(self) -> str:
        return repr((self.kind.value, self.stage))


def ops_of(ops: Iterable) -> tuple[Op, ...]:
    """Every entry of ``ops`` as an :class:`Op` (``ValueError`` naming the first bad one)."""
    return tuple(Op.of(op, n) for n, op in enumerate(ops))


def store_all_ops(L: int) -> list[Op]:
    """Plain autodiff over ``L`` stages: every stage stored whole, then the backward."""
    return (
        [Op(OpKind.FALL, i) for i in range(L)] + [Op(OpKind.LOSS, L)] + [Op(OpKind.B, i) for i in reversed(range(L))]
    )


__all__ = ["FORWARD_KINDS", "Op", "OpKind", "ops_of", "store_all_ops"]
