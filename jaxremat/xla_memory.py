"""What XLA really keeps: bytes live across an optimisation barrier in the compiled buffer assignment.

XLA can dump, per compilation, its buffer assignment and the live range of every buffer over
the scheduled instruction sequence. For a function ``forward -> optimization_barrier ->
backward``, the buffers whose live range spans the barrier are exactly what the compiled
program keeps from the forward for the backward (``COST_MODEL.md``'s ``xbar``), after fusion
decided what to store and what to recompute.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import tempfile
from typing import Any, Callable

import jax

# On the CPU, XLA removes optimisation barriers early unless this pass is off (DESIGN.md).
REMAT_OPTIONS = {"xla_disable_hlo_passes": "cse_barrier_expander"}

_VALUE = re.compile(r"^\s*value: <\d+ (\S+) @\d+> \(size=(\d+),offset=\d+\): (.*)$")
_ALLOC = re.compile(r"^allocation \d+: size \d+(.*)$")
_RANGE = re.compile(r"^\s*(\S+):(\d+)-(\d+)$")
_SEQ = re.compile(r"^\s*(\d+):(\S+)$")


def compile_with_dump(fn: Callable, *args: Any, options: dict | None = None) -> tuple[Any, str]:
    """Compile ``jax.jit(fn)(*args)`` with XLA's buffer dumps; return (compiled, dump folder)."""
    folder = tempfile.mkdtemp(prefix="jaxremat-xla-")
    opts = {**REMAT_OPTIONS, **(options or {}), "xla_dump_to": folder, "xla_dump_hlo_pass_re": ""}
    compiled = jax.jit(fn).lower(*args).compile(opts)
    return compiled, folder


def _read(folder: str, suffix: str) -> str:
    paths = sorted(glob.glob(os.path.join(folder, f"*cpu_after_optimizations-{suffix}.txt")))
    if not paths:
        paths = sorted(glob.glob(os.path.join(folder, f"*after_optimizations-{suffix}.txt")))
    if not paths:
        raise RuntimeError(f"XLA wrote no {suffix} dump in {folder}; the backend may not support dumps")
    with open(paths[-1]) as f:
        return f.read()


def buffer_sizes(folder: str) -> dict[str, int]:
    """Size of every non-parameter, non-constant, non-tuple buffer value, by live-range name."""
    sizes: dict[str, int] = {}
    skip = False
    for line in _read(folder, "buffer-assignment").splitlines():
        alloc = _ALLOC.match(line)
        if alloc:
            flags = alloc.group(1)
            skip = "parameter" in flags or "constant" in flags
            continue
        if line.startswith("BufferAssignment stats") or line.startswith("Total bytes"):
            break
        value = _VALUE.match(line)
        if value and not skip:
            name, size, shape = value.group(1), int(value.group(2)), value.group(3)
            if shape.startswith("("):
                continue  # a tuple's index table, not data
            sizes[name if "{" in name else name + "{}"] = size
    return sizes


_OPERANDS = re.compile(r"\s[a-z][\w\-]*\((%[^)]*)\)")


def _values(folder: str) -> dict[str, tuple[list[str], list[str], bool]]:
    """Per value (by instruction name): its operands, the instructions that use it, and
    whether it is an entry parameter or a constant."""
    out: dict[str, tuple[list[str], list[str], bool]] = {}
    name, uses, mode = None, [], None
    for line in _read(folder, "buffer-assignment-values").splitlines():
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
            out[name] = (operands, uses, leaf)
            mode = None
        elif mode == "uses" and line.strip() and line.strip() != "(none)":
            uses.append(line.strip().split(",")[0])
    return out


def live_across_barrier(folder: str) -> int:
    """Bytes of the buffers (not parameters) whose live range spans every optimisation barrier.

    A buffer computed from entry parameters alone and used only after the barrier (say a
    transposed copy of the stage input for its weight gradient) is left out: nothing ties it
    to the forward, and in a whole training step XLA schedules it inside the backward.
    """
    text = _read(folder, "live-range")
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
    barriers = [i for i, name in enumerate(seq) if name.startswith("optimization_barrier") or name.startswith("opt-barrier")]
    if not barriers:
        raise RuntimeError("no optimization barrier survived compilation; was cse_barrier_expander disabled?")
    first, last = min(barriers), max(barriers)
    position = {name: i for i, name in enumerate(seq)}
    values = _values(folder)
    leaves = {n for n, (_, _, leaf) in values.items() if leaf}

    def movable(key: str) -> bool:
        operands, uses, leaf = values.get(key.split("{")[0], ([], [], False))
        return (
            not leaf
            and bool(operands)
            and all(o in leaves for o in operands)
            and all(position.get(u, -1) > last for u in uses)
        )

    sizes = buffer_sizes(folder)
    return sum(
        size
        for name, size in sizes.items()
        if name in ranges and ranges[name][0] < first and ranges[name][1] > last and not movable(name)
    )


def bytes_kept_across_barrier(fn: Callable, *args: Any, options: dict | None = None) -> tuple[Any, int]:
    """Compile ``fn`` (which must hold an optimisation barrier) and return (compiled, bytes kept
    across the barrier); the dump folder is removed afterwards."""
    compiled, folder = compile_with_dump(fn, *args, options=options)
    try:
        return compiled, live_across_barrier(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
