"""What XLA really keeps: bytes live across an optimisation barrier in the compiled buffer assignment.

XLA can dump, per compilation, its buffer assignment and the live range of every buffer over
the scheduled instruction sequence. For a function ``forward -> optimization_barrier ->
backward``, the buffers whose live range spans the barrier are exactly what the compiled
program keeps from the forward for the backward (``docs/cost_model.md``'s ``xbar``), after fusion
decided what to store and what to recompute.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from typing import Any, Callable, Collection, NamedTuple

import jax

from jaxremat.core.compile import measuring_options
from jaxremat.profiling.buffer_dump import BufferDump, _Slot, shape_bytes


def compile_with_dump(fn: Callable, *args: Any, options: dict | None = None, run: bool = False) -> tuple[Any, str]:
    """Compile ``jax.jit(fn)(*args)`` with XLA's buffer dumps; return (compiled, dump folder).
    Compiled to be measured (:func:`~jaxremat.core.compile.measuring_options`) unless ``run``."""
    folder = tempfile.mkdtemp(prefix="jaxremat-xla-")
    lowered = jax.jit(fn, keep_unused=True).lower(*args)  # parameter numbers = leaf order
    opts = {**measuring_options(run, lowered), **(options or {}), "xla_dump_to": folder, "xla_dump_hlo_pass_re": ""}
    compiled = lowered.compile(opts)
    return compiled, folder


def _peak(
    seq: list[str], ranges: dict[str, tuple[int, int]], slots: dict[str, _Slot], live: list[int] | None = None
) -> list[int]:
    """Bytes live at each instruction of ``seq``: ``live`` (if given) plus every buffer
    (:func:`buffer_slots`) over its live range.

    A live range includes both its ends, so an element-wise fusion that writes its output over
    an operand dying there has both in its count. The buffer assignment puts the two in one slot
    (and the whole training step does the same): the bytes they share count once. Counted twice,
    an MLP-Mixer block's backward under ``dots_with_no_batch_dims_saveable`` measured 13.39 MiB
    (11.39 once) and a 12-block GPT's block ``FB`` 10.09 MiB (9.09 once).
    """
    live = live if live is not None else [0] * (len(seq) + 1)
    starting: dict[tuple[int, int], list[_Slot]] = {}  # (allocation, first instruction) -> slots
    ending: list[tuple[_Slot, int]] = []  # (slot, last instruction)
    for name, slot in slots.items():
        if name in ranges:
            lo, hi = ranges[name]
            for t in range(lo, min(hi, len(seq)) + 1):
                live[t] += slot.size
            starting.setdefault((slot.allocation, lo), []).append(slot)
            if hi <= len(seq):
                ending.append((slot, hi))
    for slot, hi in ending:
        for other in starting.get((slot.allocation, hi), []):
            if other is not slot:  # written over this one as it dies
                both = min(slot.offset + slot.size, other.offset + other.size) - max(slot.offset, other.offset)
                live[hi] -= max(0, both)
    return live


def transient_beyond_inputs(dump: BufferDump, outputs: bool = False, reuse: bool | Collection[int] = True) -> int:
    """Peak bytes of a program's temporaries beyond its inputs, crediting inputs freed early.

    Inputs count until their last use (in a training step their buffers are reusable after
    that), and an input whose last use is an element-wise loop fusion with an output of its
    shape counts until just before it: in a training step XLA writes that output over the dying
    buffer, which it may not do to an entry parameter compiled alone. Outputs do not count. The
    result is that peak minus the total size of the inputs, floored at zero: the ``bwd_tmp`` of
    ``docs/cost_model.md`` for a backward compiled alone.

    ``reuse=False`` leaves out the credit for an output written over a dying input; a collection
    of entry parameter numbers gives it to those inputs only.
    With ``outputs``, the output buffers count too, over their live ranges (XLA may hold
    intermediates in an output's buffer before the output is written); the caller subtracts the
    outputs the cost model counts by itself.
    """
    seq, ranges = dump.seq, dump.ranges
    position = {name: i for i, name in enumerate(seq)}
    values = dump.values
    params = dump.sizes_of(("parameter",))
    live = [0] * (len(seq) + 1)
    taken: set[str] = set()  # fusions whose output already reuses a dying input
    for name, size in sorted(params.items(), key=lambda kv: -kv[1]):
        value = values.get(name.split("{")[0])
        uses = value.uses if value else []
        last = max((position.get(u, 0) for u in uses), default=-1)
        user = values.get(seq[last]) if 0 <= last < len(seq) else None
        credited = reuse is True or (not isinstance(reuse, bool) and value is not None and value.parameter in reuse)
        if credited and value and user and user.elementwise and user.shape == value.shape and seq[last] not in taken:
            taken.add(seq[last])
            last -= 1
        for t in range(0, last + 1):
            live[t] += size
    live = _peak(seq, ranges, dump.slots_of(("temp", "output") if outputs else ("temp",)), live)
    return max(0, max(live) - sum(params.values()))


def live_across_barrier(
    dump: BufferDump, activations: Collection[int] = (), parameters: Collection[int] = (), step_input: bool = False,
) -> int:
    """Bytes of the buffers (not parameters) whose live range spans every optimisation barrier.

    A buffer computed from entry parameters and constants alone and used only after the barrier
    (say a transposed copy of a kernel, or of the stage input for its weight gradient) is left
    out: nothing ties it to the forward, and in a whole training step XLA schedules it inside the
    backward, or, for a copy of the input, computes it with the input's producer and keeps it
    *instead of* the input. Except when the backward also reads the input itself (of the entry
    parameter numbers ``activations``): then both stay, and the copy counts (measured on a
    ResNet-style block, whose backward reads its input for the skip connection).

    A buffer made from one of the entry parameters ``parameters`` (the stage's kernels: an
    attention kernel reshaped for its matmul) counts too. In the step users run, the parameters
    are donated, and XLA makes such a copy of a kernel at the step's start and keeps it until the
    stage's backward (a 12-block GPT: four 64 KiB copies per block, 3 MiB of the 4.75 its
    store-all plan missed), unless the executor orders the stage's kernel reads after its
    cotangent (:mod:`jaxremat.run._grad_tie`); the caller leaves ``parameters`` empty then.

    With ``step_input`` (the chain's first stage, whose input ``a_0`` is the training step's
    argument, live for the whole step whatever the schedule), a copy of the input counts: the
    step cannot keep it *instead of* the input. Measured: the Mixer's patch embedding keeps its
    input's patches (192 KiB) for the weight gradient, the GPT's embedding its clamped token
    indices (2 KiB); left out, storing the stage whole was predicted that much under what XLA
    keeps, and the policy that recomputes it no better.
    """
    seq, ranges = dump.seq, dump.ranges
    barriers = [i for i, name in enumerate(seq) if name.startswith(("optimization_barrier", "opt-barrier"))]
    if not barriers:
        raise RuntimeError("no optimization barrier survived compilation; was cse_barrier_expander disabled?")
    first, last = min(barriers), max(barriers)
    position = {name: i for i, name in enumerate(seq)}
    values = dump.values
    leaves = {n for n, v in values.items() if v.leaf}
    consts = {n for n in leaves if values[n].parameter is None}
    acts = set(activations)
    inputs = {n for n in leaves if values[n].parameter in acts}
    params = set(parameters)
    kernels = {n for n in leaves if values[n].parameter in params}

    def derived(name: str) -> bool:
        """Computed from leaves alone, no larger than they are, and used only after the barrier.

        A broadcast of a parameter to an activation's shape (a LayerNorm scale under tensor
        parallelism) is not such a copy: the whole step makes it once for the forward and keeps it
        for the backward (measured: 4 MiB per transformer block, 30.15 MiB kept against 26.19
        without it)."""
        v = values.get(name)
        return (
            v is not None
            and not v.leaf
            and bool(v.operands)
            and all(o in leaves for o in v.operands)
            and all(position.get(u, -1) > last for u in v.uses)
            # made from constants alone (zeros a gradient is scattered into): the whole step makes
            # them at its start whatever the schedule, counted in ChainCosts.held instead
            and (shape_bytes(v.shape) <= sum(shape_bytes(values[o].shape) for o in v.operands)
                 or all(o in consts for o in v.operands))
        )

    # an input the backward reads itself, not only through derived copies, stays live anyway
    read_after = {n for n in inputs if any(position.get(u, -1) > last and not derived(u) for u in values[n].uses)}

    def movable(key: str) -> bool:
        name = key.split("{")[0]
        return (derived(name) and not any(o in read_after for o in values[name].operands)
                and not any(o in kernels for o in values[name].operands)
                and not (step_input and any(o in inputs for o in values[name].operands)))

    sizes = dump.sizes_of()
    return sum(
        size
        for name, size in sizes.items()
        if name in ranges and ranges[name][0] < first and ranges[name][1] > last and not movable(name)
    )


def bytes_kept_across_barrier(
    fn: Callable, *args: Any, options: dict | None = None, activations: Collection[int] = (),
    parameters: Collection[int] = (), step_input: bool = False,
) -> tuple[Any, int]:
    """Compile ``fn`` (which must hold an optimisation barrier) and return (compiled, bytes kept
    across the barrier; ``activations`` as for :func:`live_across_barrier`, numbered over the
    leaves of ``args``); the dump folder is removed afterwards."""
    compiled, folder = compile_with_dump(fn, *args, options=options)
    try:
        return compiled, live_across_barrier(BufferDump.read(folder), activations, parameters, step_input)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def constant_made_bytes(dump: BufferDump, outputs: Collection[str] = ()) -> int:
    """Bytes of the buffers computed from constants alone (a zero-filled buffer that a
    transposed resize, pooling or pad scatters its gradient into, an embedding's gradient):
    temporaries, and outputs of an array shape in ``outputs`` (the input and parameter
    gradients' leaves, temporaries of a training step).

    A whole training step computes them at its start, before any stage runs (nothing they read
    ties them to the backward), and keeps them until the backward that fills them: measured on a
    U-Net, 216 KiB of 1.38 MiB live from the step's first instructions."""
    values = dump.values
    consts = {n for n, v in values.items() if v.leaf and v.parameter is None}
    wanted = {re.sub(r"\{.*", "", o) for o in outputs}
    total = 0
    for kind in ("temp", "output"):
        for name, size in dump.sizes_of((kind,)).items():
            v = values.get(name.split("{")[0])
            if v is None or v.leaf or not v.operands or not all(o in consts for o in v.operands):
                continue
            if kind == "temp" or re.sub(r"\{.*", "", v.shape) in wanted:
                total += size
    return total


def _compiled_and(
    fn: Callable, args: tuple, read: Callable[[str], Any], options: dict | None = None, run: bool = False
) -> tuple[Any, Any]:
    """Compile ``fn`` with XLA's buffer dumps and return (compiled, ``read`` of its
    :class:`BufferDump`); ``run``: the compiled program will also be run (timed)."""
    compiled, folder = compile_with_dump(fn, *args, options=options, run=run)
    try:
        return compiled, read(BufferDump.read(folder))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def transient_bytes(
    fn: Callable, *args: Any, options: dict | None = None, outputs: bool = False, reuse: bool | Collection[int] = True,
) -> tuple[Any, int]:
    """Compile ``fn`` and return (compiled, :func:`transient_beyond_inputs` of it)."""
    return _compiled_and(fn, args, lambda dump: transient_beyond_inputs(dump, outputs, reuse), options)


class FusedBytes(NamedTuple):
    """A fused forward-backward's bytes (:func:`fused_bytes`)."""

    compiled: Any
    transient: int  # transient_beyond_inputs, crediting only the inputs named by ``reuse``
    reuse_saving: int  # what that credit saves: the bytes without it, less ``transient``
    held: int  # bytes made from constants alone (constant_made_bytes)


def fused_bytes(
    fn: Callable, *args: Any, reuse: Collection[int], constants: Collection[str], run: bool = False
) -> FusedBytes:
    """Compile ``fn`` once and measure its transient bytes with and without the credit for an
    output written over the dying inputs ``reuse`` (entry parameter numbers), and what it makes
    from constants alone (``constants``: output shapes, as for :func:`constant_made_bytes`).
    ``run``: the compiled program will also be timed (compiled as the step is)."""

    def read(dump: BufferDump) -> tuple[int, int, int]:
        got = transient_beyond_inputs(dump, False, reuse)
        plain = transient_beyond_inputs(dump, False, False)
        return got, max(0, plain - got), constant_made_bytes(dump, constants)

    compiled, (got, saving, held) = _compiled_and(fn, args, read, run=run)
    return FusedBytes(compiled, got, saving, held)


