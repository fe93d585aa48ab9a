"""Run a schedule: the forward pass of a chain whose gradient follows the schedule's op list.

A persistent schedule is a tree (``COST_MODEL.md``). For a segment of stages ``s .. t`` (stage
``L`` is the loss) its ops are one of

* ``Fall s, <ops of s+1 .. t>, B s`` — stage ``s`` runs plainly; autodiff keeps its residuals;
* ``Fck s, Fn s+1 .. Fn j-1, <ops of j .. t>, <ops of s .. j-1>`` — stages ``s .. j-1`` run
  inside one ``jax.checkpoint`` region that keeps only its input ``a_s``; the backward
  recomputes the region following ``<ops of s .. j-1>``, itself a tree;
* ``Fall s, B s`` / ``Loss`` for a single stage.

:func:`parse` reads an op list into that tree, :func:`execute` builds the forward function from
it. ``jax.checkpoint`` ties each recomputation to the incoming cotangent with optimisation
barriers; on the CPU compile with :func:`compiler_options` so that XLA keeps them.
"""

from __future__ import annotations

import contextvars
import functools
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax

from jaxremat.chain import Chain, stage_rngs
from jaxremat.schedule import Schedule
from jaxremat.simulate import Op
from jaxremat.xla_memory import REMAT_OPTIONS


@dataclass(frozen=True)
class Store:
    """Stage ``stage`` runs plainly, then ``rest`` (stages ``stage+1 .. t``)."""

    stage: int
    rest: "Node"


@dataclass(frozen=True)
class Region:
    """Stages ``start .. stop-1`` in a checkpoint region recomputed as ``inner``; then ``rest``."""

    start: int
    stop: int
    inner: "Node"
    rest: "Node"


@dataclass(frozen=True)
class Leaf:
    """A single stage (``Fall s, B s``) or the loss (``stage == L``)."""

    stage: int


Node = Store | Region | Leaf


def parse(ops: Sequence[Op], L: int) -> Node:
    """The tree of a persistent schedule; ``ValueError`` if ``ops`` is not one."""
    ops = [(str(k), int(i)) for k, i in ops]
    pos = 0

    def expect(kind: str, i: int) -> None:
        nonlocal pos
        if pos >= len(ops) or ops[pos] != (kind, i):
            got = ops[pos] if pos < len(ops) else "the end"
            raise ValueError(
                f"not a persistent schedule: expected ({kind!r}, {i}) at op #{pos}, got {got}; "
                "execute() runs the tree-shaped schedules that jaxremat's solvers produce"
            )
        pos += 1

    def segment(s: int, t: int) -> Node:
        nonlocal pos
        if s == t:
            if s == L:
                expect("Loss", L)
            else:
                expect("Fall", s)
                expect("B", s)
            return Leaf(s)
        if pos < len(ops) and ops[pos] == ("Fall", s):
            pos += 1
            rest = segment(s + 1, t)
            expect("B", s)
            return Store(s, rest)
        expect("Fck", s)
        j = s + 1
        while pos < len(ops) and ops[pos] == ("Fn", j) and j < t:
            pos += 1
            j += 1
        rest = segment(j, t)
        inner = segment(s, j - 1)
        return Region(s, j, inner, rest)

    tree = segment(0, L)
    if pos != len(ops):
        raise ValueError(f"not a persistent schedule: {len(ops) - pos} op(s) left after the backward, from op #{pos}")
    return tree


def _run(node: Node, L: int, stop: int, apply_stage: Callable, a: Any, updates: dict) -> Any:
    """Apply the stages of ``node`` below ``stop`` (the loss is not a stage)."""
    while True:
        if isinstance(node, Leaf):
            return apply_stage(node.stage, a, updates) if node.stage < min(L, stop) else a
        if isinstance(node, Store):
            a = apply_stage(node.stage, a, updates)
            node = node.rest
            continue
        region, inner = node, node.inner

        def body(a: Any, inner=inner, stop_r=region.stop) -> tuple[Any, dict]:
            local: dict = {}
            out = _run(inner, L, stop_r, apply_stage, a, local)
            return out, local

        _check_compile_options()
        a, local = jax.checkpoint(body)(a)
        updates.update(local)
        node = region.rest


def execute(chain: Chain, schedule: Schedule) -> Callable[..., tuple[Any, Any]]:
    """``f(variables, x, rngs=None) -> (output, updated_collections)`` whose gradient follows
    ``schedule``: stored stages keep their residuals, checkpoint regions keep only their input
    and are recomputed in the schedule's order. ``updated_collections`` (e.g. ``batch_stats``)
    are per stage, in the variables' layout, each updated once per step.
    """
    L = len(chain)
    if schedule.costs.length != L:
        raise ValueError(f"the schedule is for a chain of {schedule.costs.length} stages; this chain has {L}")
    tree = parse(schedule.ops, L)

    def forward(variables: Any, x: Any, rngs: dict[str, jax.Array] | None = None) -> tuple[Any, Any]:
        per_stage = chain.split(variables)

        def apply_stage(i: int, a: Any, updates: dict) -> Any:
            out, new = chain.stages[i].apply(per_stage[i], a, stage_rngs(rngs, i))
            if new:
                updates[i] = new
            return out

        updates: dict[int, Any] = {}
        out = _run(tree, L, L, apply_stage, x, updates)
        return out, updates

    return forward


def compiler_options() -> dict[str, str]:
    """XLA options that keep remat real on the CPU (``cse_barrier_expander`` off); none elsewhere."""
    return dict(REMAT_OPTIONS) if jax.default_backend() == "cpu" else {}



# Set while jaxremat.jit traces a function: regions built then will be compiled with the options.
_UNDER_REMAT_JIT: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxremat_jit", default=False)
_warned = contextvars.ContextVar("jaxremat_warned", default=False)


def jit(fn: Callable, **kwargs: Any) -> Callable:
    """``jax.jit`` with :func:`compiler_options` (so a rematerialised step is compiled as planned)."""
    options = {**compiler_options(), **kwargs.pop("compiler_options", {})}

    @functools.wraps(fn)
    def traced(*args: Any, **kw: Any) -> Any:
        token = _UNDER_REMAT_JIT.set(True)
        try:
            return fn(*args, **kw)
        finally:
            _UNDER_REMAT_JIT.reset(token)

    return jax.jit(traced, compiler_options=options or None, **kwargs)


def _check_compile_options() -> None:
    """Warn once when a checkpoint region is built on the CPU outside :func:`jit`."""
    if jax.default_backend() == "cpu" and not _UNDER_REMAT_JIT.get() and not _warned.get():
        _warned.set(True)
        warnings.warn(
            "jaxremat: on the CPU, XLA undoes rematerialisation unless the step is compiled with "
            "jaxremat.compiler_options() (cse_barrier_expander disabled); use jaxremat.jit(...) or "
            "jax.jit(..., compiler_options=jaxremat.compiler_options()) to get the planned memory",
            stacklevel=4,
        )
