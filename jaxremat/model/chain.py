"""A model as an ordered list of stages: what the profiler measures and the executor runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxremat.model.identity import function_key
from jaxremat.model.linen import label, linen_layers, linen_stage, repeat_stages
from jaxremat.model.nnx import nnx_layers, nnx_stage
from jaxremat.model.repeat import BODY, Repeat
from jaxremat.model.stage import Rngs, Stage, Variables, any_rngs, stage_rngs
from jaxremat.model.trees import abstract, check_leaves, describe, is_sharded, with_shardings


@dataclass(frozen=True)
class Stacked:
    """Stages ``start .. start+length-1`` are the copies of a :class:`~jaxremat.Repeat` or the
    layers of a scanned stack (model layer ``layer``), their variables stacked under
    ``{collection: {"body": ...}}``; ``init`` makes them (``None`` for a stack traced from a
    function, whose variables are the function's)."""

    layer: int
    start: int
    length: int
    init: Callable[[jax.Array, Any], Variables] | None = field(repr=False, compare=False)


@dataclass(frozen=True)
class Chain:
    """An ordered list of :class:`Stage`; the output of stage ``i`` is the input of ``i + 1``.

    Build one with :meth:`from_linen` or :meth:`from_functions`. A model's layers map to stages
    one to one, except a :class:`~jaxremat.Repeat`, which is ``length`` stages sharing stacked
    variables (``stacked``).
    """

    stages: tuple[Stage, ...]
    sequential: bool = False  # variables in nn.Sequential's layout ({"params": {"layers_i": ...}})
    stacked: tuple[Stacked, ...] = ()

    def __post_init__(self) -> None:
        if len(self.stages) == 0:
            raise ValueError("a Chain needs at least one stage; got an empty list")

    @property
    def layers(self) -> list[tuple[int, Stacked | None]]:
        """Per model layer: its first stage and its :class:`Stacked` group (``None`` for one stage)."""
        groups = {g.start: g for g in self.stacked}
        out, i = [], 0
        while i < len(self.stages):
            g = groups.get(i)
            out.append((i, g))
            i += g.length if g else 1
        return out

    def group_of(self, i: int) -> tuple[Stacked, int] | None:
        """The stacked group holding stage ``i`` and its index in it, or ``None``."""
        for g in self.stacked:
            if g.start <= i < g.start + g.length:
                return g, i - g.start
        return None

    def __len__(self) -> int:
        return len(self.stages)

    @property
    def period(self) -> int:
        """How many stages the model's repeated block is cut into: the least ``k`` (up to 8) for
        which at least half the stages compute what the stage ``k`` after them computes (their
        ``key``); 1 when no block repeats. A transformer block written as a Python loop and cut
        before each contraction repeats every few stages; a model's layers mapped one to one
        (``nn.Sequential``, a list of NNX modules) are blocks of one stage."""
        keys = [s.key for s in self.stages]
        L = len(keys)
        for k in range(1, min(8, L // 2) + 1):
            same = sum(1 for i in range(L - k) if keys[i] is not None and keys[i] == keys[i + k])
            if same >= max(k, (L - k) / 2):
                return k
        return 1

    @classmethod
    def from_functions(cls, pairs: Sequence[tuple[Callable, Any]]) -> "Chain":
        """Stages from ``(f, params)`` pairs with ``f(params, a) -> a_next``.

        Their variables (for :meth:`apply` and the profiler) are ``[{"params": p} for each pair]``.
        """
        if len(pairs) == 0:
            raise ValueError("Chain.from_functions needs at least one (function, params) pair")
        stages = []
        for i, pair in enumerate(pairs):
            if not (isinstance(pair, tuple) and len(pair) == 2 and callable(pair[0])):
                raise ValueError(f"Chain.from_functions: item {i} must be a (function, params) pair, got {pair!r}")
            f = pair[0]
            stages.append(
                Stage(
                    f"{i}:{getattr(f, '__name__', 'stage')}",
                    getattr(f, "__name__", "function"),
                    lambda v, a, rngs, f=f: (f(v["params"], a), {}),
                    key=function_key(f),
                )
            )
        return cls(tuple(stages))

    @staticmethod
    def function_variables(pairs: Sequence[tuple[Callable, Any]]) -> list[Variables]:
        """The per-stage variables of a chain made by :meth:`from_functions`."""
        return [{"params": p} for _, p in pairs]

    @classmethod
    def from_linen(cls, modules: Any, *, mutable: Sequence[str] = (), rng_streams: Sequence[str] = ()) -> "Chain":
        """Stages from a list of Flax linen modules or an ``nn.Sequential``.

        Args:
          modules: the modules (plain functions such as ``nn.relu`` are allowed in a Sequential).
          mutable: collections the stages update (e.g. ``("batch_stats",)``).
          rng_streams: RNG streams the stages draw from (e.g. ``("dropout",)``).
        """
        layers, sequential = linen_layers(modules)
        stages: list[Stage] = []
        stacked: list[Stacked] = []
        for k, m in enumerate(layers):
            if isinstance(m, Repeat):
                whole, copies = repeat_stages(k, len(stages), m, mutable, rng_streams)
                stacked.append(Stacked(k, len(stages), m.length, whole.init))
                stages += copies
            else:
                stages.append(linen_stage(f"{len(stages)}:{label(m)}", m, mutable, rng_streams))
        return cls(tuple(stages), sequential=sequential, stacked=tuple(stacked))

    @classmethod
    def from_nnx(cls, modules: Any) -> "Chain":
        """Stages from a list of Flax NNX modules or an ``nnx.Sequential``.

        ``chain.init(...)`` returns the modules' current state per stage, as
        ``{"params": <nnx.Param state>, "rest": <every other state>}``; stages return their
        updated ``rest`` (batch statistics, RNG counters) like mutable linen collections.
        """
        return cls(tuple(nnx_stage(f"{i}:{label(m)}", m) for i, m in enumerate(nnx_layers(modules))))

    # -- variables -----------------------------------------------------------------------------

    def layer_variables(self, variables: Any) -> list[Variables]:
        """The model's variables per layer (a :class:`~jaxremat.Repeat`'s stacked, as one entry)."""
        n = len(self.layers)
        if not self.sequential:
            if len(variables) != n:
                raise ValueError(f"expected {n} per-layer variable dicts, got {len(variables)}")
            return [dict(v) for v in variables]
        return [
            {col: tree[f"layers_{k}"] for col, tree in variables.items() if f"layers_{k}" in tree} for k in range(n)
        ]

    def from_layer_variables(self, per_layer: Sequence[Variables]) -> Any:
        """The inverse of :meth:`layer_variables`."""
        if not self.sequential:
            return list(per_layer)
        out: dict[str, dict[str, Any]] = {}
        for k, v in enumerate(per_layer):
            for col, tree in v.items():
                out.setdefault(col, {})[f"layers_{k}"] = tree
        return out

    def split(self, variables: Any) -> list[Variables]:
        """Per-stage variables from the model's variables (Sequential layout or a list); the
        copies of a :class:`~jaxremat.Repeat` get slices of its stacked variables."""
        out: list[Variables] = []
        for (_, g), v in zip(self.layers, self.layer_variables(variables)):
            if g is None:
                out.append(v)
            else:
                out += [
                    {col: jax.tree.map(lambda t, j=j: _layer_of(t, j), tree[BODY]) for col, tree in v.items()}
                    for j in range(g.length)
                ]
        return out

    def merge(self, per_stage: Sequence[Variables]) -> Any:
        """The inverse of :meth:`split` (a Repeat's copies are stacked again)."""
        per_layer = []
        for i, g in self.layers:
            if g is None:
                per_layer.append(per_stage[i])
            else:
                copies = per_stage[i : i + g.length]
                per_layer.append(
                    {
                        col: {BODY: jax.tree.map(lambda *xs: jnp.stack(xs), *[c[col] for c in copies])}
                        for col in copies[0]
                    }
                )
        return self.from_layer_variables(per_layer)

    def stage_shapes(self, variables: Any) -> list[Any]:
        """``jax.ShapeDtypeStruct`` trees of each stage's variables (no array operations)."""
        out: list[Any] = []
        sds = lambda t, drop: jax.ShapeDtypeStruct(np.shape(t)[drop:], t.dtype)  # noqa: E731
        for (_, g), v in zip(self.layers, self.layer_variables(variables)):
            if g is None:
                out.append(jax.tree.map(lambda t: sds(t, 0), v))
            else:
                one = {col: jax.tree.map(lambda t: sds(t, 1), tree[BODY]) for col, tree in v.items()}
                out += [one] * g.length
        return out

    def init(self, rng: jax.Array, x: Any) -> Any:
        """Variables for every layer, in the plain model's layout."""
        per_layer, a = [], x
        for i, g in self.layers:
            st = self.stages[i]
            init = g.init if g is not None else st.init
            v = init(jax.random.fold_in(rng, i), a) if init is not None else {}
            per_layer.append(v)
            if g is None:  # a Repeat's output has its input's shapes (the scan carry)
                a = jax.eval_shape(lambda v, a, st=st: st.apply(v, a, any_rngs(st))[0], v, a)
                a = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), a)
        return self.from_layer_variables(per_layer)

    def apply(self, variables: Any, x: Any, rngs: Rngs = None) -> Any:
        """The plain forward pass (no remat), for reference and tests."""
        a = x
        for i, (st, v) in enumerate(zip(self.stages, self.split(variables))):
            a = st.apply(v, a, stage_rngs(rngs, i))[0]
        return a

    def shapes(self, variables: Any, sample: Any) -> list[Any]:
        """``jax.ShapeDtypeStruct`` trees of ``a_0 .. a_L``, checked stage by stage."""
        out = [jax.eval_shape(lambda a: a, sample)]
        check_leaves(out[0], "the chain's input")
        for i, (st, v) in enumerate(zip(self.stages, self.split(variables))):
            try:
                nxt = jax.eval_shape(lambda v, a, st=st: st.apply(v, a, any_rngs(st))[0], v, out[-1])
            except Exception as e:  # noqa: BLE001 - re-raised with the stage named
                if "not a valid JAX type" in str(e):
                    raise ValueError(
                        f"the output of stage {i} ({st.name}) has a non-array leaf: "
                        f"{str(e).splitlines()[0].split('returned ')[-1]}; activations must be arrays or pytrees "
                        "of arrays"
                    ) from None
                prev = f"stage {i - 1} ({self.stages[i - 1].name})" if i else "the chain's input"
                raise ValueError(
                    f"stage {i} ({st.name}) cannot take the output of {prev} with shapes "
                    f"{describe(out[-1])}: {type(e).__name__}: {str(e).splitlines()[0]}"
                ) from None
            check_leaves(nxt, f"the output of stage {i} ({st.name})")
            out.append(nxt)
        if is_sharded((variables, sample)):
            return self._laid_out(out, variables, sample)
        return out

    def _laid_out(self, shapes: list[Any], variables: Any, sample: Any) -> list[Any]:
        """``shapes`` with each activation laid out as XLA's partitioner lays it out: stage by
        stage, from the input's and the variables' shardings (each stage's forward compiled)."""
        out = [abstract(sample)]
        for st, v, nxt in zip(self.stages, [abstract(v) for v in self.split(variables)], shapes[1:]):
            compiled = jax.jit(lambda v, a, st=st: st.apply(v, a, any_rngs(st))[0]).lower(v, out[-1]).compile()
            out.append(with_shardings(nxt, compiled.output_shardings))
        return out


def _layer_of(t: Any, j: int) -> Any:
    """Layer ``j`` of a stacked leaf (of its shape, for a ``jax.ShapeDtypeStruct``)."""
    if isinstance(t, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(t.shape[1:], t.dtype)
    return t[j]


__all__ = ["Chain", "Stacked"]
