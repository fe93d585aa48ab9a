"""Compiling a rematerialised step so that XLA keeps the remat: the CPU option and ``jaxremat.jit``.

XLA:CPU removes optimisation barriers early (pass ``cse_barrier_expander``) and CSE then merges a
recomputation back into the forward pass, so on the CPU ``jax.checkpoint`` and jaxremat's
regions change neither flops nor memory unless that pass is disabled. Other backends keep remat
without it and must not be given the option: XLA:GPU expands the barriers with that pass itself,
and with it disabled fails to compile them ("Unsupported instruction opcode: opt-barrier", an
H200 with jax 0.11.2). So no buffer dump of a GPU program shows a barrier
(:func:`barriers_survive`).
"""

from __future__ import annotations

import contextvars
import functools
import os
import re
import sys
import warnings
from typing import Any, Callable

import jax

PASS = "cse_barrier_expander"
#: The XLA option that keeps remat real on the CPU (for ``Lowered.compile`` or ``jax.jit``).
REMAT_OPTIONS = {"xla_disable_hlo_passes": PASS}

# Set while jaxremat.jit (or as_planned) traces a function: the step will be compiled with the option.
_UNDER_PLANNED_TRACE: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxremat_planned", default=False)
# Set while jaxremat.jit traces a step called with arrays laid out over several devices: their
# (shape, dtype, sharding), which jit's traced values do not carry under a mesh with Auto axes
# (the legacy ``with mesh:``, ``jax.sharding.use_mesh``). See :func:`argument_sharding`.
_ARGUMENT_SHARDINGS: contextvars.ContextVar[tuple] = contextvars.ContextVar("jaxremat_shardings", default=())


def compiler_options() -> dict[str, str]:
    """XLA options that keep remat real on this backend: ``cse_barrier_expander`` off on the CPU,
    none elsewhere. Pass them to ``jax.jit(..., compiler_options=...)`` or ``Lowered.compile``."""
    return dict(REMAT_OPTIONS) if jax.default_backend() == "cpu" else {}


#: On the CPU, for a program compiled only to read XLA's memory and cost analyses: LLVM at its
#: lowest optimisation. The buffer assignment, temp bytes, flops and bytes accessed are made by
#: the HLO passes before it and come out the same, in a third of the time (a linen CNN's training
#: step: 2.31 s -> 0.69 s, temp, flops and bytes identical; every stage profile of the test
#: models identical; CPU, jax 0.10.2, 2026-12-06). Not used elsewhere: a GPU's programs were not
#: measured so, and their autotuning (which sizes convolution workspaces) is not LLVM's.
MEASURING_OPTIONS = {"xla_backend_optimization_level": 0}


def held_bytes(memory: Any) -> int:
    """What a compiled step's arguments and outputs hold beyond what donation writes over
    (parameters, optimizer state, inputs, the loss), by XLA's ``compiled.memory_analysis()``:
    argument + output - alias bytes."""
    return int(memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes)


def total_bytes(memory: Any) -> int:
    """All a compiled step uses on the device by XLA's ``memory_analysis()``: its temporaries and
    what its arguments and outputs hold (:func:`held_bytes`)."""
    return int(memory.temp_size_in_bytes) + held_bytes(memory)


#: On the CPU, for a program measured, not run, that holds no gather or scatter: XLA's fusion
#: emitters off, which halves the compile again (a ResNet's profile: 9.7 s -> 4.8 s). The HLO
#: passes they change are the gathers' and scatters' own (XLA:CPU simplifies them for the
#: emitters, and fuses no scatter into a loop): everything else is assigned and counted the same
#: (every stage profile of the test models without them identical, bytes and flops, as is each
#: verification's measured step; CPU, jax 0.10.2, 2026-12-06). With them, the profiles differ:
#: a GPT's embedding backward measured 2.36 MiB where the step holds 2.88.
PLAIN_EMITTER_OPTIONS = {"xla_cpu_use_fusion_emitters": False}
_GATHER_OR_SCATTER = re.compile(r"\b(?:stablehlo|mhlo)\.(?:dynamic_)?(?:gather|scatter)\b")


def measuring_options(run: bool = False, lowered: Any = None) -> dict[str, Any]:
    """:func:`compiler_options` for a program compiled to be measured, not run (``run=False``):
    with :data:`MEASURING_OPTIONS` on the CPU, where they leave every analysis as it is and take a
    third of the compile time, and :data:`PLAIN_EMITTER_OPTIONS` too where ``lowered`` (the
    program, a ``jax.stages.Lowered``) is given and holds no gather or scatter. The profile's
    programs and verification's steps are compiled so; ``run=True`` (a program that is also
    timed) gives :func:`compiler_options` alone."""
    if run or jax.default_backend() != "cpu":
        return compiler_options()
    plain = lowered is not None and not _GATHER_OR_SCATTER.search(lowered.as_text())
    return {**compiler_options(), **MEASURING_OPTIONS, **(PLAIN_EMITTER_OPTIONS if plain else {})}


def barriers_survive() -> bool:
    """Whether programs compiled with :func:`compiler_options` on this backend keep their
    optimisation barriers into the buffer assignment (the CPU only), where the profiler reads what
    is live across them."""
    return jax.default_backend() == "cpu"


def as_planned(fn: Callable) -> Callable:
    """``fn``, traced as a step that will be compiled with :func:`compiler_options` (so it does
    not warn). For code that compiles with the options itself
    (``jax.jit(as_planned(step)).lower(...).compile(compiler_options())``)."""

    @functools.wraps(fn)
    def traced(*args: Any, **kw: Any) -> Any:
        token = _UNDER_PLANNED_TRACE.set(True)
        try:
            return fn(*args, **kw)
        finally:
            _UNDER_PLANNED_TRACE.reset(token)

    return traced


def _laid_out(args: Any) -> tuple:
    """``(shape, dtype, sharding)`` of every concrete leaf of ``args`` on several devices."""
    found = []
    for leaf in jax.tree.leaves(args):
        try:  # a traced argument (jr.jit called inside another trace) may refuse to say
            s = getattr(leaf, "sharding", None) if isinstance(leaf, jax.Array) else None
        except Exception:  # noqa: BLE001
            s = None
        if s is not None and getattr(s, "num_devices", 1) > 1 and hasattr(s, "shard_shape"):
            found.append((tuple(leaf.shape), str(leaf.dtype), s))
    return tuple(found)


def argument_sharding(shape: tuple, dtype: Any) -> Any:
    """The sharding of the step argument shaped ``shape`` and ``dtype`` while
    :func:`jaxremat.jit` traces the step, or ``None``: no such argument, or several laid out
    differently. Under ``Auto`` mesh axes jit's traced values carry no sharding; a value with
    the shape and dtype of exactly one laid-out argument is taken to be laid out as it (the
    parameters and the batch a step passes on as they came, which is what a plan needs)."""
    key = (tuple(int(d) for d in shape), str(dtype))
    found = {id(s): s for sh, dt, s in _ARGUMENT_SHARDINGS.get() if (sh, dt) == key}
    if len(found) != 1:
        return None
    return next(iter(found.values()))


class _Jitted:
    """``jax.jit(fn)`` that, while it traces, knows its concrete arguments' shardings
    (:func:`argument_sharding`); everything else is the jitted function's."""

    def __init__(self, jitted: Any):
        self._jitted = jitted
        functools.update_wrapper(self, jitted)

    def _with_shardings(self, method: Callable, args: tuple, kwargs: dict) -> Any:
        token = _ARGUMENT_SHARDINGS.set(_laid_out((args, kwargs)))
        try:
            return method(*args, **kwargs)
        finally:
            _ARGUMENT_SHARDINGS.reset(token)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._with_shardings(self._jitted, args, kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        return self._with_shardings(self._jitted.lower, args, kwargs)

    def trace(self, *args: Any, **kwargs: Any) -> Any:
        return self._with_shardings(self._jitted.trace, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._jitted, name)


def jit(fn: Callable, **kwargs: Any) -> Callable:
    """``jax.jit`` with :func:`compiler_options` (so a rematerialised step is compiled as
    planned); other keyword arguments, ``compiler_options`` included, go to ``jax.jit``.

    Called with arrays laid out on a mesh, the plans made while it traces are per device, also
    under ``Auto`` mesh axes (``with mesh:``), where ``jax.jit``'s traced values do not say their
    shardings (:func:`argument_sharding`)."""
    options = {**compiler_options(), **(kwargs.pop("compiler_options", None) or {})}
    return _Jitted(jax.jit(as_planned(fn), compiler_options=options or None, **kwargs))


def _disables_pass(value: Any) -> bool:
    return PASS in str(value).split(",")


def _in_xla_flags() -> bool:
    """``XLA_FLAGS`` disables the pass for every compilation of the process."""
    for flag in os.environ.get("XLA_FLAGS", "").split():
        name, _, value = flag.partition("=")
        if name.lstrip("-") == "xla_disable_hlo_passes" and _disables_pass(value):
            return True
    return False


def _in_enclosing_jit() -> bool:
    """An enclosing ``jax.jit(..., compiler_options=...)`` being traced disables the pass.

    ``jax.jit`` does not expose its options to the function it traces; while it traces, its
    parameters (an object with ``compiler_options_kvs``) sit in a frame of JAX's own tracing
    code, so look for them up the stack. Best effort: when JAX changes this, the only effect is
    a warning that was not needed.
    """
    frame = sys._getframe(1)
    while frame is not None:
        for value in frame.f_locals.values():
            kvs = getattr(value, "compiler_options_kvs", None)
            if isinstance(kvs, tuple) and any(
                isinstance(kv, tuple) and len(kv) == 2 and kv[0] == "xla_disable_hlo_passes" and _disables_pass(kv[1])
                for kv in kvs
            ):
                return True
        frame = frame.f_back
    return False


def remat_is_kept() -> bool:
    """Whether the step being traced now will be compiled so that XLA keeps its remat."""
    return jax.default_backend() != "cpu" or _UNDER_PLANNED_TRACE.get() or _in_xla_flags() or _in_enclosing_jit()


def warn_unless_planned(stacklevel: int = 3) -> None:
    """Warn when a rematerialised step is traced on the CPU without the option in effect.

    The warning names three ways that work; Python's warning filter shows it once per place.
    """
    if remat_is_kept():
        return
    warnings.warn(
        "jaxremat: on the CPU, XLA undoes rematerialisation unless the step is compiled with "
        f"{PASS} disabled; compile the step with jaxremat.jit(step), or "
        "jax.jit(step, compiler_options=jaxremat.compiler_options()), or set "
        f"XLA_FLAGS=--xla_disable_hlo_passes={PASS} before JAX starts, to get the planned memory",
        stacklevel=stacklevel,
    )


__all__ = [
    "REMAT_OPTIONS",
    "argument_sharding",
    "as_planned",
    "barriers_survive",
    "compiler_options",
    "held_bytes",
    "jit",
    "remat_is_kept",
    "total_bytes",
    "warn_unless_planned",
]
