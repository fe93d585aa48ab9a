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
import jax.numpy as jnp
import numpy as np
from jax import lax

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


Unit = tuple  # ("store", i) or ("region", start, stop, inner)


def _units(node: Node) -> tuple[list[Unit], Leaf]:
    """A segment's tree as its sequence of top-level units and its final leaf."""
    units: list[Unit] = []
    while not isinstance(node, Leaf):
        if isinstance(node, Store):
            units.append(("store", node.stage))
        else:
            units.append(("region", node.start, node.stop, node.inner))
        node = node.rest
    return units, node


def _shape(node: Node, base: int) -> tuple:
    """The structure of a tree with stage indices relative to ``base``."""
    if isinstance(node, Leaf):
        return ("leaf", node.stage - base)
    if isinstance(node, Store):
        return ("store", node.stage - base, _shape(node.rest, base))
    return ("region", node.start - base, node.stop - base, _shape(node.inner, base), _shape(node.rest, base))


def _span(unit: Unit) -> tuple[int, int]:
    return (unit[1], unit[1] + 1) if unit[0] == "store" else (unit[1], unit[2])


def _tied_checkpoint(body: Callable[[dict, dict, Any], tuple[Any, dict]]) -> Callable[..., tuple[Any, dict]]:
    """``body(variables, keys, a) -> (out, updates)`` keeping only its inputs for the backward
    pass, where it is recomputed once the output's cotangent has arrived.

    ``jax.checkpoint``'s recomputation depends only on the saved input, so XLA may schedule it
    as early as it likes (before later stages' backward has freed their memory); here the saved
    inputs and the incoming cotangent pass one optimisation barrier together, so the
    recomputation cannot start before the backward pass reaches this region.

    The output passes an optimisation barrier too, so that it is materialised: otherwise XLA
    fuses the region's element-wise tail (say a residual block's ``relu(x + h)``) into every
    consumer and keeps the region's internals alive instead of its output, which the plan
    recomputes (measured on a ResNet-style chain: 1.08x the planned memory).
    """

    @jax.custom_vjp
    def region(owned: dict, keys: dict, a: Any) -> tuple[Any, dict]:
        out, updates = body(owned, keys, a)
        return lax.optimization_barrier(out), updates

    def fwd(owned: dict, keys: dict, a: Any) -> tuple[tuple[Any, dict], tuple]:
        return region(owned, keys, a), (owned, keys, a)

    def bwd(res: tuple, g: tuple[Any, Any]) -> tuple:
        owned, keys, a, g_out = lax.optimization_barrier((*res, g[0]))
        _, pull = jax.vjp(lambda owned, a: body(owned, keys, a)[0], owned, a)
        d_owned, d_a = pull(g_out)
        return d_owned, None, d_a

    region.defvjp(fwd, bwd)
    return region


class _Runner:
    """Runs a schedule tree on one call's variables; runs of alike units go through ``lax.scan``."""

    def __init__(self, chain: Chain, per_stage: list, rngs: dict | None, scan: bool):
        self.chain, self.per_stage, self.rngs, self.L, self.use_scan = chain, per_stage, rngs, len(chain), scan

    def stage(self, i: int, a: Any, updates: dict, env: tuple) -> Any:
        variables, offset, keys = env
        v = variables.get(i, self.per_stage[i]) if variables else self.per_stage[i]
        rngs = keys[i] if i in keys else stage_rngs(self.rngs, i + offset)
        out, new = self.chain.stages[i].apply(v, a, rngs)
        if new:
            updates[i] = new
        return out

    def unit(self, unit: Unit, a: Any, updates: dict, env: tuple) -> Any:
        if unit[0] == "store":
            return self.stage(unit[1], a, updates, env)
        _, start, stop, inner = unit
        variables, offset, keys = env
        # everything the region reads is an explicit input (no closure over traced values), so
        # that its recomputation can run in the backward pass, after the cotangent arrives
        owned = {i: variables.get(i, self.per_stage[i]) if variables else self.per_stage[i] for i in range(start, stop)}
        owned_keys = {i: keys[i] if i in keys else stage_rngs(self.rngs, i + offset) for i in range(start, stop)}

        def body(owned: dict, owned_keys: dict, a: Any) -> tuple[Any, dict]:
            local: dict = {}
            return self.run(inner, stop, a, local, (owned, 0, owned_keys)), local

        _check_compile_options()
        a, local = _tied_checkpoint(body)(owned, owned_keys, a)
        updates.update(local)
        return a

    def alike(self, u: Unit, w: Unit) -> bool:
        """Same structure over identical stages (structure key and variable shapes)."""
        (b0, e0), (b1, e1) = _span(u), _span(w)
        if e0 - b0 != e1 - b1 or u[0] != w[0]:
            return False
        if u[0] == "region" and _shape(u[3], b0) != _shape(w[3], b1):
            return False
        for p in range(e0 - b0):
            s0, s1 = self.chain.stages[b0 + p], self.chain.stages[b1 + p]
            if not s0.key or s0.key != s1.key:
                return False
            shapes = lambda v: jax.tree.map(lambda x: (np.shape(x), x.dtype), v)  # noqa: E731
            if jax.tree.structure(self.per_stage[b0 + p]) != jax.tree.structure(self.per_stage[b1 + p]):
                return False
            if shapes(self.per_stage[b0 + p]) != shapes(self.per_stage[b1 + p]):
                return False
        return True

    def run(self, node: Node, stop: int, a: Any, updates: dict, env: tuple = ({}, 0, {})) -> Any:
        """Apply the stages of ``node`` below ``stop`` (the loss is not a stage)."""
        units, leaf = _units(node)
        i = 0
        while i < len(units):
            j = i + 1
            while j < len(units) and self.alike(units[i], units[j]):
                j += 1
            if self.use_scan and j - i >= 2 and not env[0] and self.keeps_shape(units[i], a):
                a = self.scan(units[i:j], a, updates)
            else:
                for unit in units[i:j]:
                    a = self.unit(unit, a, updates, env)
            i = j
        if leaf.stage < min(self.L, stop):
            a = self.stage(leaf.stage, a, updates, env)
        return a

    def keeps_shape(self, unit: Unit, a: Any) -> bool:
        out = jax.eval_shape(lambda a: self.unit(unit, a, {}, ({}, 0, {})), a)
        same = lambda x, y: np.shape(x) == np.shape(y) and x.dtype == y.dtype  # noqa: E731
        return jax.tree.structure(out) == jax.tree.structure(a) and all(
            same(x, y) for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(a))
        )

    def scan(self, run: list[Unit], a: Any, updates: dict) -> Any:
        """``len(run)`` alike units as one ``lax.scan`` over their stacked variables."""
        first = run[0]
        b0, e0 = _span(first)
        k, n = e0 - b0, len(run)
        stacked = {
            b0 + p: jax.tree.map(lambda *xs: jnp.stack(xs), *[self.per_stage[_span(u)[0] + p] for u in run])
            for p in range(k)
        }

        def body(a: Any, xs: tuple) -> tuple[Any, dict]:
            variables, u = xs
            local: dict = {}
            return self.unit(first, a, local, (variables, u * k, {})), local

        a, ys = lax.scan(body, a, (stacked, jnp.arange(n)))
        for i, tree in ys.items():
            for u in range(n):
                updates[i + u * k] = jax.tree.map(lambda t: t[u], tree)
        return a


def execute(chain: Chain, schedule: Schedule, *, scan: bool = False) -> Callable[..., tuple[Any, Any]]:
    """``f(variables, x, rngs=None) -> (output, updated_collections)`` whose gradient follows
    ``schedule``: stored stages keep their residuals, checkpoint regions keep only their input
    and are recomputed in the schedule's order. ``updated_collections`` (e.g. ``batch_stats``)
    are per stage index, each updated once per step.

    With ``scan=True``, runs of alike units over identical stages (same structure key and
    variable shapes, shape-preserving) run as one ``lax.scan``, so tracing stays flat with
    depth; the price is that the run's parameters are stacked inside the step (a copy, and a
    stacked gradient), memory the plan does not count. Off by default.
    """
    L = len(chain)
    if schedule.costs.length != L:
        raise ValueError(f"the schedule is for a chain of {schedule.costs.length} stages; this chain has {L}")
    tree = parse(schedule.ops, L)

    def forward(variables: Any, x: Any, rngs: dict[str, jax.Array] | None = None) -> tuple[Any, Any]:
        updates: dict[int, Any] = {}
        out = _Runner(chain, chain.split(variables), rngs, scan).run(tree, L, x, updates)
        return out, updates

    return forward


def compiler_options() -> dict[str, str]:
    """XLA options that keep remat real on the CPU (``cse_barrier_expander`` off); none elsewhere."""
    return dict(REMAT_OPTIONS) if jax.default_backend() == "cpu" else {}



# Set while jaxremat.jit traces a function: regions built then will be compiled with the options.
_UNDER_REMAT_JIT: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxremat_jit", default=False)
_warned = contextvars.ContextVar("jaxremat_warned", default=False)


def as_planned(fn: Callable) -> Callable:
    """``fn``, traced as a step that will be compiled with :func:`compiler_options` (no warning).

    For code that compiles with the options itself (``jax.jit(...).lower(...).compile(options)``).
    """

    @functools.wraps(fn)
    def traced(*args: Any, **kw: Any) -> Any:
        token = _UNDER_REMAT_JIT.set(True)
        try:
            return fn(*args, **kw)
        finally:
            _UNDER_REMAT_JIT.reset(token)

    return traced


def jit(fn: Callable, **kwargs: Any) -> Callable:
    """``jax.jit`` with :func:`compiler_options` (so a rematerialised step is compiled as planned)."""
    options = {**compiler_options(), **kwargs.pop("compiler_options", {})}
    return jax.jit(as_planned(fn), compiler_options=options or None, **kwargs)


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
