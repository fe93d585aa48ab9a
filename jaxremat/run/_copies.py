"""One copy of a loop over a Repeat's copies, as the loops run it: traced once and replayed
(:func:`replay`), linearised with the residuals its pullback needs split from its inputs
(:class:`Linearised`), packed into rows (:class:`Layout`, PRNG keys as their data:
:class:`KeyData`). The core shared by the selective loop (:mod:`~jaxremat.run.selective`) and the
offload loop (:mod:`~jaxremat.run.offload_loop`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jax_core

Step = Callable[[Any, Any, Any, jax.Array], tuple[Any, Any]]


def inexact(leaf: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)


def pullback_of(step: Step, p: Any, keys: Any, a: Any, u: jax.Array) -> tuple[Any, Any, list, Any, tuple]:
    """``step``'s output, updates, the residuals to store, the pullback's tree and, per leaf of
    the pullback, ``("in", j)`` (leaf ``j`` of ``(p, a)``) or ``("buf", None)``."""
    leaves, tdef = jax.tree.flatten((p, a))
    diff = [inexact(leaf) for leaf in leaves]

    def f(*dl: Any) -> tuple[Any, Any]:
        it = iter(dl)
        pp, aa = tdef.unflatten([next(it) if d else leaf for leaf, d in zip(leaves, diff)])
        return step(pp, keys, aa, u)

    out, pull, updates = jax.vjp(f, *[leaf for leaf, d in zip(leaves, diff) if d], has_aux=True)
    res, pull_tree = jax.tree.flatten(pull)
    ids = {id(leaf): j for j, leaf in enumerate(leaves)}
    kinds = tuple(("in", ids[id(r)]) if id(r) in ids else ("buf", None) for r in res)
    stored = [r for r, kind in zip(res, kinds) if kind[0] == "buf"]
    return out, updates, stored, pull_tree, kinds


def replay(fn: Callable, *example: Any) -> tuple[Callable, Any]:
    """``fn`` traced once to a jaxpr (at ``example``'s shapes) and a function that replays it,
    with the output shapes. Tracing a Flax block is the slow part of building each loop body;
    replaying its jaxpr is cheap."""
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*example)
    tree = jax.tree.structure(shapes)

    def replayed(*args: Any) -> Any:
        return tree.unflatten(jax_core.jaxpr_as_fun(closed)(*jax.tree.leaves(args)))

    return replayed, shapes


@dataclass(frozen=True)
class Linearised:
    """One copy's forward pass with its residuals, traced once (replayed in the forward loop and
    in the backward loop's recomputation), and how to rebuild its pullback."""

    run: Callable  # (p, keys, a, u) -> (out, updates, stored residuals)
    pull_tree: Any
    kinds: tuple
    shapes: tuple  # of the stored residuals

    @functools.cached_property
    def keys(self) -> "KeyData":
        return KeyData(self.shapes)

    @functools.cached_property
    def layout(self) -> "Layout":
        """How the residuals (PRNG keys as their data) pack into one flat row per dtype."""
        return Layout(self.keys.shapes)

    def pack(self, stored: Sequence[jax.Array]) -> list[jax.Array]:
        return self.layout.pack(self.keys.encode(stored))

    def unpack(self, flats: Sequence[jax.Array]) -> list[jax.Array]:
        return self.keys.decode(self.layout.unpack(flats))

    @classmethod
    def trace(cls, step: Step, p: Any, keys: Any, a: Any) -> "Linearised":
        found: dict[str, Any] = {}

        def run(p: Any, keys: Any, a: Any, u: jax.Array) -> tuple:
            out, updates, stored, found["tree"], found["kinds"] = pullback_of(step, p, keys, a, u)
            return out, updates, stored

        replayed, shapes = replay(run, p, keys, a, jnp.int32(0))
        return cls(replayed, found["tree"], found["kinds"], tuple(shapes[2]))

    def pullback(self, stored: Sequence[jax.Array], p: Any, a: Any) -> Callable:
        ins, got = jax.tree.leaves((p, a)), iter(stored)
        return jax.tree.unflatten(self.pull_tree, [ins[j] if kind == "in" else next(got) for kind, j in self.kinds])


class Layout:
    """The residuals to store, packed into one flat array per dtype.

    One buffer per dtype rather than per residual: XLA compiles a loop body that reads ~30
    separate residual buffers in about 1.5x the time of one that slices them out of one array
    (measured on a transformer block, CPU).
    """

    def __init__(self, shapes: Sequence[Any]):
        self.shapes = [(tuple(s.shape), jnp.dtype(s.dtype)) for s in shapes]
        self.dtypes = list(dict.fromkeys(d for _, d in self.shapes))
        self.buffers = [(d, sum(int(np.prod(s)) for s, dd in self.shapes if dd == d)) for d in self.dtypes]

    def pack(self, leaves: Sequence[jax.Array]) -> list[jax.Array]:
        """One row per dtype holding ``leaves`` (a copy)."""
        return [
            jnp.concatenate([leaf.ravel() for leaf, (_, dd) in zip(leaves, self.shapes) if dd == d])
            for d in self.dtypes
        ]

    def write(
        self, bufs: Sequence[jax.Array], leaves: Sequence[jax.Array], slot: jax.Array, keep: jax.Array | None = None
    ) -> list[jax.Array]:
        """``bufs`` with row ``slot`` set to ``leaves``, written one by one (no packed copy); where
        ``keep`` is false, the row is written back unchanged instead (a masked write)."""
        by_dtype = dict(zip(self.dtypes, bufs))
        offsets = dict.fromkeys(self.dtypes, 0)
        for leaf, (shape, d) in zip(leaves, self.shapes):
            o, size = offsets[d], int(np.prod(shape))
            new = leaf.reshape(1, -1).astype(d)
            if keep is not None:
                new = jnp.where(keep, new, lax.dynamic_slice(by_dtype[d], (slot, o), (1, size)))
            by_dtype[d] = lax.dynamic_update_slice(by_dtype[d], new, (slot, o))
            offsets[d] = o + size
        return [by_dtype[d] for d in self.dtypes]

    def unpack(self, flats: Sequence[jax.Array]) -> list[jax.Array]:
        offsets = dict.fromkeys(self.dtypes, 0)
        by_dtype = dict(zip(self.dtypes, flats))
        out = []
        for shape, d in self.shapes:
            size, o = int(np.prod(shape)), offsets[d]
            out.append(lax.slice_in_dim(by_dtype[d], o, o + size).reshape(shape))
            offsets[d] = o + size
        return out


class KeyData:
    """PRNG keys among a copy's residuals (a stage that draws random bits in its backward keeps
    its key) as their key data, so that they are stored, stacked and moved as plain ``uint32``
    arrays; rewrapped when read back. ``shapes``: the residuals' shapes so encoded."""

    def __init__(self, shapes: Sequence[Any]):
        self.keyed = [jax.dtypes.issubdtype(s.dtype, jax.dtypes.extended) for s in shapes]
        self.shapes = [jax.eval_shape(jax.random.key_data, s) if k else s for s, k in zip(shapes, self.keyed)]
        self.impls: dict[int, Any] = {}  # filled when the forward pass is traced, read by the backward

    def encode(self, leaves: Sequence[jax.Array]) -> list[jax.Array]:
        out = []
        for j, (leaf, keyed) in enumerate(zip(leaves, self.keyed)):
            if keyed:
                self.impls[j] = jax.random.key_impl(leaf)
                leaf = jax.random.key_data(leaf)
            out.append(leaf)
        return out

    def decode(self, leaves: Sequence[jax.Array]) -> list[jax.Array]:
        return [
            jax.random.wrap_key_data(leaf, impl=self.impls[j]) if keyed else leaf
            for j, (leaf, keyed) in enumerate(zip(leaves, self.keyed))
        ]


def fill(values: Sequence[Any], diff: Sequence[bool], like: Sequence[Any]) -> list:
    """``values`` at the positions where ``diff`` holds, zero (``float0``) cotangents elsewhere."""
    it = iter(values)
    return [next(it) if d else np.zeros(np.shape(leaf), jax.dtypes.float0) for leaf, d in zip(like, diff)]


__all__ = ["KeyData", "Layout", "Linearised", "Step", "fill", "inexact", "pullback_of", "replay"]
