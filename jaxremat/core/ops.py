"""The ops of a schedule (``docs/cost_model.md``): one definition that every layer reads.

An op is an :class:`Op`, a tuple ``(kind, stage)`` or, for a stage stored under option ``k > 0``,
``(kind, stage, k)``; so ``("Fall", 3)`` written by hand is an op too, ``("Fall", 3, 0)`` is the
same op as ``("Fall", 3)``, and op lists stay plain JSON. Its kind is an :class:`OpKind`, a
``str`` enum: ``OpKind.FALL == "Fall"``.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Iterable, Sequence


class OpKind(StrEnum):
    """What an op does (``docs/cost_model.md``, *Operations*)."""

    FCK = "Fck"  # forward, keeping the input (a checkpoint)
    FN = "Fn"  # forward, freeing a standalone input
    FALL = "Fall"  # forward keeping the residuals of a store option (the bundle abar_i)
    LOSS = "Loss"  # the loss: makes delta_L
    B = "B"  # the backward of one stage, from its bundle
    FB = "FB"  # the forward of one stage fused with its backward (a recomputation XLA fuses)
    OFFLOAD = "Offload"  # queue a kept buffer's copy to host memory (device bytes freed when it ends)
    PREFETCH = "Prefetch"  # allocate a host buffer's device bytes and queue its copy back


FORWARD_KINDS: frozenset[OpKind] = frozenset({OpKind.FCK, OpKind.FN, OpKind.FALL})
#: The ops that move a buffer between device and host; they take no compute time.
TRANSFER_KINDS: frozenset[OpKind] = frozenset({OpKind.OFFLOAD, OpKind.PREFETCH})
#: What a transfer op moves: the standalone activation ``a_i`` or the bundle ``abar_i``.
BUFFERS: tuple[str, str] = ("a", "abar")


class Op(tuple):
    """One op: ``kind`` on stage ``stage`` (``stage == L`` for the loss); ``option`` is the store
    option of a ``Fall`` (0, store-all, unless the stage has options). A transfer op
    (``Offload``, ``Prefetch``) names the buffer it moves instead: ``Op("Offload", 3, "a")``
    moves ``a_3``, ``Op("Prefetch", 2, "abar")`` brings back the bundle ``abar_2``."""

    __slots__ = ()

    def __new__(cls, kind: OpKind | str, stage: int, option: int | str = 0) -> "Op":
        kind, stage = OpKind(kind), int(stage)
        if kind in TRANSFER_KINDS:
            if option not in BUFFERS:
                raise ValueError(
                    f"({kind.value!r}, {stage}, {option!r}): a transfer moves 'a' (a_i) or 'abar' (the bundle abar_i)"
                )
            return tuple.__new__(cls, (kind, stage, option))
        if isinstance(option, str):
            raise ValueError(f"({kind.value!r}, {stage}, {option!r}): only 'Offload' and 'Prefetch' name a buffer")
        option = int(option)
        if option < 0 or (option and kind is not OpKind.FALL):
            raise ValueError(f"({kind.value!r}, {stage}, {option}): only 'Fall' takes a store option, an int >= 0")
        return tuple.__new__(cls, (kind, stage, option) if option else (kind, stage))

    @property
    def kind(self) -> OpKind:
        return self[0]

    @property
    def stage(self) -> int:
        return self[1]

    @property
    def option(self) -> int:
        return self[2] if len(self) > 2 and self[0] is OpKind.FALL else 0

    @property
    def buffer(self) -> str | None:
        """What a transfer op moves (``"a"`` or ``"abar"``); ``None`` for a compute op."""
        return self[2] if self[0] in TRANSFER_KINDS else None

    def __getnewargs__(self) -> tuple:
        return tuple(self)

    def __repr__(self) -> str:
        return repr((self.kind.value, *self[1:]))

    @classmethod
    def of(cls, op: Iterable, position: int = 0) -> "Op":
        """An :class:`Op` from any ``(kind, stage)`` or ``(kind, stage, option)``; ``ValueError``
        naming ``position`` when ``op`` is not one."""
        if isinstance(op, Op):
            return op
        try:
            kind, stage, *rest = op
            stage = int(stage)
            option = rest[0] if rest and isinstance(rest[0], str) else int(rest[0]) if rest else 0
            if len(rest) > 1:
                raise ValueError
        except (TypeError, ValueError):
            raise ValueError(
                f"op #{position} {op!r} is not a (kind, stage) pair or a (kind, stage, option) triple"
            ) from None
        try:
            kind = OpKind(str(kind))
        except ValueError:
            known = ", ".join(k.value for k in OpKind)
            raise ValueError(f"op #{position} ({kind!r}, {stage}): unknown op kind; expected one of {known}") from None
        try:
            return cls(kind, stage, option)
        except ValueError as e:
            raise ValueError(f"op #{position} {e}") from None


def ops_of(ops: Iterable) -> tuple[Op, ...]:
    """Every entry of ``ops`` as an :class:`Op` (``ValueError`` naming the first bad one)."""
    return tuple(Op.of(op, n) for n, op in enumerate(ops))


def store_all_ops(L: int, options: Sequence[int] | None = None) -> list[Op]:
    """Every stage of ``L`` stored (under store option ``options[i]``; plain autodiff when
    ``None``: all of them whole), then the backward."""
    ks = options or [0] * L
    return (
        [Op(OpKind.FALL, i, ks[i]) for i in range(L)]
        + [Op(OpKind.LOSS, L)]
        + [Op(OpKind.B, i) for i in reversed(range(L))]
    )


__all__ = ["BUFFERS", "FORWARD_KINDS", "TRANSFER_KINDS", "Op", "OpKind", "ops_of", "store_all_ops"]
