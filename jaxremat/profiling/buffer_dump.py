"""XLA's dump of one compiled program, parsed once (:class:`BufferDump`): the scheduled
instruction sequence, each value's live range over it, each buffer's allocation kind and slot,
each value's operands and uses; and HLO's names and sizes of dtypes (:data:`HLO_TYPES`).
:mod:`~jaxremat.profiling.xla_buffers` reads what a program keeps from it."""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass
from typing import NamedTuple

_VALUE = re.compile(r"^\s*value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\): (.*)$")
_ALLOC = re.compile(r"^allocation (\d+): size \d+(.*)$")
_RANGE = re.compile(r"^\s*(\S+):(\d+)-(\d+)$")
_SEQ = re.compile(r"^\s*(\d+):(\S+)$")


def _read(folder: str, suffix: str) -> str:
    paths = sorted(glob.glob(os.path.join(folder, f"*cpu_after_optimizations-{suffix}.txt")))
    if not paths:
        paths = sorted(glob.glob(os.path.join(folder, f"*after_optimizations-{suffix}.txt")))
    if not paths:
        raise RuntimeError(f"XLA wrote no {suffix} dump in {folder}; the backend may not support dumps")
    with open(paths[-1]) as f:
        return f.read()


class _Slot(NamedTuple):
    """Where the buffer assignment put a value: its allocation and byte range in it."""

    allocation: int
    offset: int
    size: int


def _parse_slots(text: str) -> dict[str, tuple[str, _Slot]]:
    """Every non-tuple buffer value's allocation kind and slot, by live-range name."""
    slots: dict[str, tuple[str, _Slot]] = {}
    kind, number = "temp", -1
    for line in text.splitlines():
        alloc = _ALLOC.match(line)
        if alloc:
            number, flags = int(alloc.group(1)), alloc.group(2)
            kind = (
                "parameter" if "parameter" in flags else "constant" if "constant" in flags
                else "output" if "live-out" in flags or "output" in flags else "temp"
            )
            continue
        if line.startswith("BufferAssignment stats") or line.startswith("Total bytes"):
            break
        value = _VALUE.match(line)
        if value:
            name, size, offset, shape = value.group(1), int(value.group(2)), int(value.group(3)), value.group(4)
            if shape.startswith("("):
                continue  # a tuple's index table, not data
            slots[name if "{" in name else name + "{}"] = (kind, _Slot(number, offset, size))
    return slots


def _parse_live_ranges(text: str) -> tuple[list[str], dict[str, tuple[int, int]]]:
    """The scheduled instruction sequence and every value's live range over it."""
    seq: list[str] = []
    ranges: dict[str, tuple[int, int]] = {}
    section = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("InstructionSequence"):
            section = "seq"
            continue
        if stripped.startswith("BufferLiveRange"):
            section = "range"
            continue
        if stripped.startswith("Live ranges at"):
            break
        if section == "seq" and (m := _SEQ.match(line)):
            seq.append(m.group(2))
        elif section == "range" and (m := _RANGE.match(line)):
            ranges[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    return seq, ranges


_OPERANDS = re.compile(r"\s[a-z][\w\-]*\((%[^)]*)\)")
_SHAPE = re.compile(r"=\s*(\S+)\s")


#: numpy's dtype names as HLO writes them, with their bytes: the one table of both
HLO_TYPES = {"bool": ("pred", 1), "int8": ("s8", 1), "uint8": ("u8", 1), "float16": ("f16", 2), "bfloat16": ("bf16", 2),
             "int16": ("s16", 2), "uint16": ("u16", 2), "float32": ("f32", 4), "int32": ("s32", 4),
             "uint32": ("u32", 4), "float64": ("f64", 8), "int64": ("s64", 8), "uint64": ("u64", 8),
             "complex64": ("c64", 8), "complex128": ("c128", 16)}
_DTYPE_BYTES = dict(HLO_TYPES.values())


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO array shape such as ``f32[64,128]{1,0}`` (0 when it is not one)."""
    m = re.match(r"(\w+)\[([\d,]*)\]", shape)
    if not m or m.group(1) not in _DTYPE_BYTES:
        return 0
    n = 1
    for d in filter(None, m.group(2).split(",")):
        n *= int(d)
    return n * _DTYPE_BYTES[m.group(1)]


class _Value(NamedTuple):
    operands: list[str]  # instruction names
    uses: list[str]  # instructions that use it
    leaf: bool  # an entry parameter or a constant
    parameter: int | None  # the entry parameter's number
    shape: str  # e.g. ``f32[2048,512]{1,0}``
    elementwise: bool  # a loop fusion: may write its output over an operand that dies there


def _parse_values(text: str) -> dict[str, _Value]:
    """Every value of the buffer assignment, by instruction name."""
    out: dict[str, _Value] = {}
    name, uses, mode = None, [], None
    for line in text.splitlines():
        if line.startswith("<"):
            name, uses, mode = line.split()[1], [], None
        elif line.strip() == "uses:":
            mode = "uses"
        elif line.strip() == "positions:":
            mode = "positions"
        elif line.startswith(" from instruction:") and name is not None:
            text = line.split("=", 1)[1] if "=" in line else ""
            m = _OPERANDS.search(text)
            operands = re.findall(r"%([\w.\-]+)", m.group(1)) if m else []
            leaf = " parameter(" in text or " constant(" in text
            number = re.search(r" parameter\((\d+)\)", text)
            shape = _SHAPE.search(line)
            out[name] = _Value(
                operands, uses, leaf, int(number.group(1)) if number else None, shape.group(1) if shape else "",
                "kind=kLoop" in text,
            )
            mode = None
        elif mode == "uses" and line.strip() and line.strip() != "(none)":
            uses.append(line.strip().split(",")[0])
    return out


@dataclass(frozen=True)
class BufferDump:
    """XLA's dump of one compiled program, parsed once: the scheduled instruction sequence,
    each value's live range over it, each buffer's allocation kind and slot, and each value's
    operands and uses. The readers below take it."""

    seq: list[str]
    ranges: dict[str, tuple[int, int]]
    slots: dict[str, tuple[str, _Slot]]
    values: dict[str, _Value]

    @classmethod
    def read(cls, folder: str) -> "BufferDump":
        seq, ranges = _parse_live_ranges(_read(folder, "live-range"))
        slots = _parse_slots(_read(folder, "buffer-assignment"))
        return cls(seq, ranges, slots, _parse_values(_read(folder, "buffer-assignment-values")))

    def slots_of(self, kinds: tuple[str, ...] = ("temp", "output")) -> dict[str, _Slot]:
        """The slot of every non-tuple buffer of the given allocation kinds, by live-range name:
        ``"parameter"``, ``"constant"``, ``"output"`` (may live out) and ``"temp"`` (the rest)."""
        return {name: slot for name, (kind, slot) in self.slots.items() if kind in kinds}

    def sizes_of(self, kinds: tuple[str, ...] = ("temp", "output")) -> dict[str, int]:
        """Size of every non-tuple buffer of the given allocation kinds, by live-range name."""
        return {name: slot.size for name, slot in self.slots_of(kinds).items()}


__all__ = ["HLO_TYPES", "BufferDump", "shape_bytes"]
