"""A model as an ordered list of stages: what the profiler measures and the executor runs."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxremat.repeat import BODY, Repeat

Variables = dict[str, Any]
ApplyFn = Callable[[Variables, Any, dict[str, jax.Array] | None], tuple[Any, Variables]]


@dataclass(frozen=True)
class Stage:
    """One stage ``a_{i+1} = apply(variables_i, a_i, rngs)``.

    ``apply`` returns ``(output, updated_collections)`` (an empty dict when nothing is mutable).
    ``init(rng, a)`` makes the stage's variables, or is ``None`` for stages built from plain
    functions with their parameters given.
    """

    name: str
    kind: str
    apply: ApplyFn = field(repr=False)
    init: Callable[[jax.Array, Any], Variables] | None = field(default=None, repr=False)
    mutable: tuple[str, ...] = ()
    rng_streams: tuple[str, ...] = ()
    key: str = ""  # the stage's structure (module config or function code), for caching


def _label(m: Any) -> str:
    """A module's name if it has one, else its type; a function's name."""
    name = getattr(m, "name", None)
    if isinstance(name, str) and name:
        return name
    return getattr(m, "__name__", None) or type(m).__name__


def _function_key(fn: Callable) -> str:
    code = getattr(fn, "__code__", None)
    body = hashlib.sha256(code.co_code + repr(code.co_consts).encode()).hexdigest()[:16] if code else repr(fn)
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__name__)}:{body}"


def _linen_stage(name: str, module: Any, mutable: Sequence[str], rng_streams: Sequence[str]) -> Stage:
    import flax.linen as nn

    if not isinstance(module, nn.Module):  # a plain function inside nn.Sequential (nn.relu, ...)
        fn = module
        return Stage(
            name, getattr(fn, "__name__", type(fn).__name__), lambda v, a, rngs: (fn(a), {}), key=_function_key(fn)
        )

    def apply(variables: Variables, a: Any, rngs: dict[str, jax.Array] | None) -> tuple[Any, Variables]:
        if mutable:
            return module.apply(variables, a, rngs=rngs, mutable=list(mutable))
        return module.apply(variables, a, rngs=rngs), {}

    def init(rng: jax.Array, a: Any) -> Variables:
        rngs = {"params": rng, **{s: jax.random.fold_in(rng, k + 1) for k, s in enumerate(rng_streams)}}
        return dict(module.init(rngs, a))

    return Stage(
        name, type(module).__name__, apply, init, tuple(mutable), tuple(rng_streams), key=f"linen:{module!r}"
    )


def _nnx_stage(name: str, module: Any) -> Stage:
    from flax import nnx

    if not isinstance(module, nnx.Module):  # a plain function inside nnx.Sequential (nnx.relu, ...)
        return _linen_stage(name, module, (), ())
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def apply(variables: Variables, a: Any, rngs: dict[str, jax.Array] | None) -> tuple[Any, Variables]:
        # fresh Variable objects at the current trace level, so the module may update them here
        params_now, rest_now = jax.tree.map(lambda v: v, (variables["params"], variables["rest"]))
        m = nnx.merge(graphdef, params_now, rest_now)
        out = m(a)
        return out, {"rest": nnx.split(m, nnx.Param, ...)[2]}

    def init(rng: jax.Array, a: Any) -> Variables:
        return {"params": params, "rest": rest}

    return Stage(name, type(module).__name__, apply, init, ("rest",), (), key=f"nnx:{graphdef!r}")


@dataclass(frozen=True)
class Stacked:
    """Stages ``start .. start+length-1`` are the copies of a :class:`~jaxremat.Repeat` (model
    layer ``layer``), their variables stacked under ``{collection: {"body": ...}}``."""

    layer: int
    start: int
    length: int
    init: Callable[[jax.Array, Any], Variables] = field(repr=False, compare=False)


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
                    key=_function_key(f),
                )
            )
        return cls(tuple(stages))

    @staticmethod
    def function_variables(pairs: Sequence[tuple[Callable, Any]]) -> list[Variables]:
        """The per-stage variables of a chain made by :meth:`from_functions`."""
        return [{"params": p} for _, p in pairs]

    @classmethod
    def from_linen(
        cls, modules: Any, *, mutable: Sequence[str] = (), rng_streams: Sequence[str] = ()
    ) -> "Chain":
        """Stages from a list of Flax linen modules or an ``nn.Sequential``.

        Args:
          modules: the modules (plain functions such as ``nn.relu`` are allowed in a Sequential).
          mutable: collections the stages update (e.g. ``("batch_stats",)``).
          rng_streams: RNG streams the stages draw from (e.g. ``("dropout",)``).
        """
        import flax.linen as nn

        sequential = isinstance(modules, nn.Sequential)
        layers = list(modules.layers) if sequential else list(modules) if isinstance(modules, (list, tuple)) else None
        if layers is None:
            raise ValueError(
                f"Chain.from_linen expects a list of linen modules or an nn.Sequential, got {type(modules).__name__}"
            )
        if not layers:
            raise ValueError("Chain.from_linen: the model has no layers; a chain needs at least one stage")

        stages: list[Stage] = []
        stacked: list[Stacked] = []
        for k, m in enumerate(layers):
            if isinstance(m, Repeat):
                init = _linen_stage(f"{k}:{_label(m)}", m, mutable, rng_streams).init
                stacked.append(Stacked(k, len(stages), m.length, init))
                stages += [
                    _linen_stage(f"{len(stages) + j}:{_label(m)}[{j}]", m.block, mutable, rng_streams)
                    for j in range(m.length)
                ]
            else:
                stages.append(_linen_stage(f"{len(stages)}:{_label(m)}", m, mutable, rng_streams))
        return cls(tuple(stages), sequential=sequential, stacked=tuple(stacked))

    @classmethod
    def from_nnx(cls, modules: Any) -> "Chain":
        """Stages from a list of Flax NNX modules or an ``nnx.Sequential``.

        ``chain.init(...)`` returns the modules' current state per stage, as
        ``{"params": <nnx.Param state>, "rest": <every other state>}``; stages return their
        updated ``rest`` (batch statistics, RNG counters) like mutable linen collections.
        """
        from flax import nnx

        layers = list(modules.layers) if isinstance(modules, nnx.Sequential) else (
            list(modules) if isinstance(modules, (list, tuple)) else None
        )
        if layers is None:
            raise ValueError(f"Chain.from_nnx expects a list of NNX modules or an nnx.Sequential, got {type(modules).__name__}")
        if not layers:
            raise ValueError("Chain.from_nnx: the model has no layers; a chain needs at least one stage")
        return cls(tuple(_nnx_stage(f"{i}:{_label(m)}", m) for i, m in enumerate(layers)))

    # -- variables -----------------------------------------------------------------------------

    def layer_variables(self, variables: Any) -> list[Variables]:
        """The model's variables per layer (a :class:`~jaxremat.Repeat`'s stacked, as one entry)."""
        n = len(self.layers)
        if not self.sequential:
            if len(variables) != n:
                raise ValueError(f"expected {n} per-layer variable dicts, got {len(variables)}")
            return [dict(v) for v in variables]
        return [{col: tree[f"layers_{k}"] for col, tree in variables.items() if f"layers_{k}" in tree} for k in range(n)]

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
                out += [{col: jax.tree.map(lambda t, j=j: t[j], tree[BODY]) for col, tree in v.items()} for j in range(g.length)]
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
                    {col: {BODY: jax.tree.map(lambda *xs: jnp.stack(xs), *[c[col] for c in copies])} for col in copies[0]}
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
                a = jax.eval_shape(lambda v, a, st=st: st.apply(v, a, _any_rngs(st))[0], v, a)
                a = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), a)
        return self.from_layer_variables(per_layer)

    def apply(self, variables: Any, x: Any, rngs: dict[str, jax.Array] | None = None) -> Any:
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
                nxt = jax.eval_shape(lambda v, a, st=st: st.apply(v, a, _any_rngs(st))[0], v, out[-1])
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
        return out


def _any_rngs(st: Stage) -> dict[str, jax.Array] | None:
    """Keys for shape evaluation only (the values do not matter)."""
    return {s: jax.random.key(0) for s in st.rng_streams} or None


def stage_rngs(rngs: dict[str, jax.Array] | None, i: int) -> dict[str, jax.Array] | None:
    """Stage ``i``'s keys: each stream folded with the stage index (the same on a recompute)."""
    if not rngs:
        return None
    return {k: jax.random.fold_in(r, i) for k, r in rngs.items()}


def check_leaves(tree: Any, what: str) -> None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            raise ValueError(
                f"{what} has a non-array leaf at {jax.tree_util.keystr(path)}: {type(leaf).__name__}; "
                "activations must be arrays or pytrees of arrays"
            )


def describe(tree: Any) -> str:
    return str(jax.tree.map(lambda s: f"{np.dtype(s.dtype).name}{list(s.shape)}", tree))


def tree_bytes(tree: Any) -> int:
    """Bytes of every array leaf of ``tree`` (arrays or ShapeDtypeStructs)."""
    return int(sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in jax.tree.leaves(tree)))
