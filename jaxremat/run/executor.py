"""Run a schedule: the forward pass of a chain whose gradient follows the schedule's op list.

The schedule is read as a tree (:mod:`jaxremat.tree`): a :class:`~jaxremat.tree.Store` stage
runs plainly and autodiff keeps its residuals; a :class:`~jaxremat.tree.Region` runs its stages
inside one checkpoint region that keeps only its input and is recomputed, following its inner
tree, once the backward pass reaches it. Recomputation is tied to the incoming cotangent with
optimisation barriers; on the CPU compile with :func:`compiler_options` so that XLA keeps them.
"""

from __future__ import annotations

import contextvars
import functools
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxremat.chain import Chain, stage_rngs
from jaxremat.repeat import BODY
from jaxremat.schedule import Schedule
from jaxremat.selective import runs_selective, selective_scan
from jaxremat.tree import Node, Unit, parse, shape as _shape, span as _span, units as _units
from jaxremat.xla_memory import REMAT_OPTIONS


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
    """Runs a schedule tree on one call's variables; runs of alike units go through ``lax.scan``.

    ``scan``: ``None`` scans runs over the stacked variables of a :class:`~jaxremat.Repeat`
    (no copy), ``True`` also stacks other runs' variables, ``False`` unrolls everything.
    """

    def __init__(self, chain: Chain, variables: Any, rngs: dict | None, scan: bool | None, tree: Node):
        self.chain, self.rngs, self.L, self.use_scan = chain, rngs, len(chain), scan
        self.shapes = chain.stage_shapes(variables)
        units, _ = _units(tree)
        # Repeat layers whose top-level units repeat one pattern: first stage -> (units per
        # period m, stages per period p, periods n); they run as one scan over a reshape
        self.periodic: dict[int, tuple[int, int, int]] = {}
        # Repeat layers whose copies are each stored or checkpointed alone, in a mix that repeats
        # no short pattern: first stage -> per copy, stored or not; they run as one selective
        # loop, and are also in periodic as (1, 1, n): their variables are cut as one stage per
        # iteration, and their n units form one segment
        self.selective: dict[int, tuple[bool, ...]] = {}
        # other runs of alike units over a Repeat's stacked variables: first stage -> (n, k)
        self.stacked_runs: dict[int, tuple[int, int]] = {}
        if scan is not False:
            for g in chain.stacked:
                flags = selective_flags(units, g.start, g.start + g.length)
                if flags is not None:
                    self.selective[g.start] = flags
                    self.periodic[g.start] = (1, 1, g.length)
                    continue
                found = self.find_period(units, g.start, g.start + g.length)
                if found is not None:
                    self.periodic[g.start] = found
                else:
                    _warn_copies(g.layer)
            for segment in self.segments(units):
                for i, j in self.alike_runs(segment):
                    b, e = _span(segment[i])[0], _span(segment[j - 1])[1]
                    found = chain.group_of(b)
                    if j - i >= 2 and found is not None and e <= found[0].start + found[0].length:
                        self.stacked_runs[b] = (j - i, _span(segment[i])[1] - b)
        self.per_stage, self.pieces = self.cut(chain.layer_variables(variables))

    def find_period(self, units: list[Unit], start: int, stop: int) -> tuple[int, int, int] | None:
        """``(m, p, n)`` when the units covering stages ``start .. stop-1`` are ``n`` repeats of
        ``m`` alike units over ``p`` stages; ``None`` when they are not (or straddle the ends)."""
        inside = [u for u in units if start <= _span(u)[0] < stop]
        if not inside or _span(inside[0])[0] != start or _span(inside[-1])[1] != stop:
            return None
        for m in range(1, len(inside) + 1):
            if len(inside) % m:
                continue
            p = _span(inside[m - 1])[1] - start
            if all(self.alike(inside[q], inside[q + r]) for r in range(m, len(inside), m) for q in range(m)):
                return m, p, len(inside) // m
        return None

    def cut(self, per_layer: list) -> tuple[dict[int, Any], dict[int, Any]]:
        """Per-stage variables, and each stacked run's variables as for :meth:`scan`: a Repeat's
        stacked arrays are cut once (``lax.split``, whose gradient is one concatenate)."""
        per_stage: dict[int, Any] = {}
        pieces: dict[int, Any] = {}
        for (first, g), v in zip(self.chain.layers, per_layer):
            if g is None:
                per_stage[first] = v
                continue
            if g.start in self.periodic:  # a reshape: no copy
                _, p, n = self.periodic[g.start]
                shape = (n,) if p == 1 else (n, p)
                pieces[g.start] = {col: jax.tree.map(lambda t: t.reshape(*shape, *t.shape[1:]), tree[BODY]) for col, tree in v.items()}
                continue
            spans, i = [], g.start
            while i < g.start + g.length:
                n, k = self.stacked_runs.get(i, (1, 1))
                spans.append((i, n, k))
                i += n * k
            sizes = [n * k for _, n, k in spans]

            def parts(t: jax.Array, sizes: list = sizes) -> list:
                return [t] if len(sizes) == 1 else list(lax.split(t, sizes, axis=0))

            cut = {col: jax.tree.map(parts, tree[BODY]) for col, tree in v.items()}
            for p, (i, n, k) in enumerate(spans):
                piece = {col: jax.tree.map(lambda ps: ps[p], tree, is_leaf=lambda x: isinstance(x, list)) for col, tree in cut.items()}
                if i in self.stacked_runs:
                    pieces[i] = _positions(piece, n, k)
                else:
                    per_stage[i] = jax.tree.map(lambda t: t.reshape(t.shape[1:]), piece)
        return per_stage, pieces

    def stage(self, i: int, a: Any, updates: dict, env: tuple) -> Any:
        variables, offset, keys = env
        v = variables.get(i, self.per_stage.get(i)) if variables else self.per_stage[i]
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
        owned = {i: variables.get(i, self.per_stage.get(i)) if variables else self.per_stage[i] for i in range(start, stop)}
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
            if jax.tree.structure(self.shapes[b0 + p]) != jax.tree.structure(self.shapes[b1 + p]):
                return False
            if jax.tree.leaves(self.shapes[b0 + p]) != jax.tree.leaves(self.shapes[b1 + p]):
                return False
        return True

    def alike_runs(self, units: list[Unit]) -> list[tuple[int, int]]:
        """``units`` cut into maximal runs ``[i, j)`` of alike units."""
        runs, i = [], 0
        while i < len(units):
            j = i + 1
            while j < len(units) and self.alike(units[i], units[j]):
                j += 1
            runs.append((i, j))
            i = j
        return runs

    def run(self, node: Node, stop: int, a: Any, updates: dict, env: tuple = ({}, 0, {})) -> Any:
        """Apply the stages of ``node`` below ``stop`` (the loss is not a stage); scans only at
        the top level (inside a region, its owned variables are explicit inputs)."""
        units, leaf = _units(node)
        if not env[0]:
            a = self.run_top(units, a, updates)
        else:
            for unit in units:
                a = self.unit(unit, a, updates, env)
        if leaf.stage < min(self.L, stop):
            a = self.stage(leaf.stage, a, updates, env)
        return a

    def segments(self, units: list[Unit]) -> list[list[Unit]]:
        """The top-level units cut into periodic Repeat layers (a list ``[first unit]``, marked
        by :attr:`periodic`) and the stretches between them."""
        out: list[list[Unit]] = [[]]
        i = 0
        while i < len(units):
            first = _span(units[i])[0]
            if first in self.periodic:
                m, _, n = self.periodic[first]
                out += [[units[i]], []]
                i += m * n
            else:
                out[-1].append(units[i])
                i += 1
        return [seg for seg in out if seg]

    def run_top(self, units: list[Unit], a: Any, updates: dict) -> Any:
        """The top-level units: periodic Repeat layers as one scan each, the rest by runs."""
        for segment in self.segments(units):
            first = _span(segment[0])[0]
            if len(segment) == 1 and first in self.periodic:
                m, p, n = self.periodic[first]
                if first in self.selective:
                    a = self.scan_selective(first, a, updates, self.pieces[first])
                    continue
                i = units.index(segment[0])
                a = self.scan_periodic(units[i : i + m], p, n, a, updates, self.pieces[first])
            else:
                a = self.run_units(segment, a, updates)
        return a

    def run_units(self, units: list[Unit], a: Any, updates: dict) -> Any:
        env = ({}, 0, {})
        for i, j in self.alike_runs(units):
            first = _span(units[i])[0]
            if first in self.stacked_runs:
                a = self.scan(units[i:j], a, updates, self.pieces[first])
            elif self.use_scan and j - i >= 2 and self.keeps_shape(units[i], a):
                a = self.scan(units[i:j], a, updates, self.stack(units[i:j]))
            else:
                for unit in units[i:j]:
                    a = self.unit(unit, a, updates, env)
        return a

    def scan_periodic(self, pattern: list[Unit], p: int, n: int, a: Any, updates: dict, stacked: Any) -> Any:
        """``n`` repeats of ``pattern`` (units over ``p`` stages) as one ``lax.scan`` over the
        Repeat's variables reshaped to ``(n, p, ...)`` (``(n, ...)`` when ``p == 1``).

        Each iteration's slice ``P`` of the scanned inputs is cut into its ``p`` stages' variables
        inside a checkpoint that recomputes the cut in the backward loop rather than saving it:
        JAX hands ``P`` itself to the backward loop without copying, where a saved cut would be a
        per-iteration copy of the parameters; the cut's gradient is one concatenate.
        """
        b0 = _span(pattern[0])[0]

        def iteration(P: Any, a: Any, u: Any) -> tuple[Any, dict]:
            views = [P] if p == 1 else _unstack(P, p)
            env = (dict(zip(range(b0, b0 + p), views)), u * p, {})
            local: dict = {}
            for unit in pattern:
                a = self.unit(unit, a, local, env)
            return a, local

        step = iteration if p == 1 else jax.checkpoint(iteration, policy=_save_all_but_cuts)

        def body(a: Any, xs: tuple) -> tuple[Any, dict]:
            P, u = xs
            return step(P, a, u)

        a, ys = lax.scan(body, a, (stacked, jnp.arange(n)))
        for i, tree in ys.items():
            for u in range(n):
                updates[i + u * p] = jax.tree.map(lambda t: t[u], tree)
        return a

    def scan_selective(self, b0: int, a: Any, updates: dict, stacked: Any) -> Any:
        """A Repeat whose copies are stored or checkpointed one by one, as :func:`selective_scan`."""
        flags = self.selective[b0]
        stage = self.chain.stages[b0]
        _check_compile_options()

        def step(p: Any, keys: Any, a: Any, u: jax.Array) -> tuple[Any, Any]:
            return stage.apply(p, a, stage_rngs(keys, b0 + u))

        a, ys = selective_scan(step, flags, stacked, a, self.rngs)
        if jax.tree.leaves(ys):
            for u in range(len(flags)):
                updates[b0 + u] = jax.tree.map(lambda t: t[u], ys)
        return a

    def keeps_shape(self, unit: Unit, a: Any) -> bool:
        out = jax.eval_shape(lambda a: self.unit(unit, a, {}, ({}, 0, {})), a)
        same = lambda x, y: np.shape(x) == np.shape(y) and x.dtype == y.dtype  # noqa: E731
        return jax.tree.structure(out) == jax.tree.structure(a) and all(
            same(x, y) for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(a))
        )

    def stack(self, run: list[Unit]) -> list[Any]:
        """The variables of ``run``'s units, per position in the unit stacked over the units (a copy)."""
        b0, e0 = _span(run[0])
        return [
            jax.tree.map(lambda *xs: jnp.stack(xs), *[self.per_stage[_span(u)[0] + p] for u in run])
            for p in range(e0 - b0)
        ]

    def scan(self, run: list[Unit], a: Any, updates: dict, stacked: Any) -> Any:
        """``len(run)`` alike units as one ``lax.scan`` over their variables ``stacked``: a list
        over the unit's positions of trees with a leading axis ``n``.

        Each iteration's variables are then exactly a slice of the scanned inputs, which JAX
        passes to the backward loop as they are; a value computed from them inside the loop
        (say a reshape) would be saved per iteration instead, a copy of the run's parameters.
        """
        first = run[0]
        b0, e0 = _span(first)
        k, n = e0 - b0, len(run)

        def body(a: Any, xs: tuple) -> tuple[Any, dict]:
            per_position, u = xs
            variables = dict(zip(range(b0, e0), per_position))
            local: dict = {}
            return self.unit(first, a, local, (variables, u * k, {})), local

        a, ys = lax.scan(body, a, (stacked, jnp.arange(n)))
        for i, tree in ys.items():
            for u in range(n):
                updates[i + u * k] = jax.tree.map(lambda t: t[u], tree)
        return a


def selective_flags(units: list[Unit], start: int, stop: int) -> tuple[bool, ...] | None:
    """Per stage of ``start .. stop-1``, stored or not, when the units covering them are each one
    stage, stored or checkpointed alone, in a mix that runs as a selective loop
    (:func:`~jaxremat.selective.runs_selective`); otherwise ``None``."""
    inside = [u for u in units if start <= _span(u)[0] < stop]
    if len(inside) != stop - start or any(_span(u) != (start + q, start + q + 1) for q, u in enumerate(inside)):
        return None
    flags = tuple(u[0] == "store" for u in inside)
    return flags if runs_selective(flags) else None


_CUTS = frozenset({lax.slice_p, lax.squeeze_p, lax.reshape_p, lax.split_p, lax.dynamic_slice_p})


def _save_all_but_cuts(prim: Any, *args: Any, **params: Any) -> bool:
    """Checkpoint policy: save every residual except cuts of the variables (recomputed)."""
    return prim not in _CUTS


def _warn_copies(layer: int) -> None:
    warnings.warn(
        f"jaxremat: the schedule does not repeat one pattern over Repeat layer {layer}, so its stacked "
        "parameters are sliced, and XLA copies the slices and the gradient's pieces: up to about twice "
        "the layer's parameter bytes more than the plan, and compile time grows with depth. Plans made "
        "by jaxremat.plan / remat_chain repeat a pattern when one fits the budget.",
        stacklevel=4,
    )


def _unstack(tree: Any, k: int) -> list[Any]:
    """``k`` trees from one with leading axis ``k`` (one ``lax.split`` per leaf)."""
    leaves, treedef = jax.tree.flatten(tree)
    cut = [lax.split(t, [1] * k, axis=0) for t in leaves]
    return [treedef.unflatten([c[q].reshape(c[q].shape[1:]) for c in cut]) for q in range(k)]


def _positions(tree: Any, n: int, k: int) -> list[Any]:
    """A tree with leading axis ``n * k`` (``n`` units of ``k`` stages) as ``k`` trees, one per
    position in the unit, each with leading axis ``n``."""
    if k == 1:
        return [tree]
    leaves, treedef = jax.tree.flatten(tree)
    cut = [lax.split(t.reshape(n, k, *t.shape[1:]), [1] * k, axis=1) for t in leaves]
    return [treedef.unflatten([c[p].reshape(n, *c[p].shape[2:]) for c in cut]) for p in range(k)]


def execute(chain: Chain, schedule: Schedule, *, scan: bool | None = None) -> Callable[..., tuple[Any, Any]]:
    """``f(variables, x, rngs=None) -> (output, updated_collections)`` whose gradient follows
    ``schedule``: stored stages keep their residuals, checkpoint regions keep only their input
    and are recomputed in the schedule's order. ``updated_collections`` (e.g. ``batch_stats``)
    are per stage index, each updated once per step.

    Runs of alike units (same structure over stages with the same structure key and variable
    shapes) run as one ``lax.scan``, so that tracing and compiling stay flat with depth:

    * ``scan=None`` (default): runs over the copies of a :class:`~jaxremat.Repeat`, whose
      variables are already stacked (cut once, no copy);
    * ``scan=True``: also runs over separately stored identical stages (shape-preserving); the
      price is that their variables are stacked inside the step (a copy, and a stacked
      gradient), memory the plan does not count;
    * ``scan=False``: no scan.
    """
    L = len(chain)
    if schedule.costs.length != L:
        raise ValueError(f"the schedule is for a chain of {schedule.costs.length} stages; this chain has {L}")
    tree = parse(schedule.ops, L)

    def forward(variables: Any, x: Any, rngs: dict[str, jax.Array] | None = None) -> tuple[Any, Any]:
        updates: dict[int, Any] = {}
        out = _Runner(chain, variables, rngs, scan, tree).run(tree, L, x, updates)
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
