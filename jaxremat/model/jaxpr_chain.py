"""A chain cut out of any JAX function's jaxpr: what :func:`jaxremat.remat` plans.

``fun`` is traced once per input signature to a jaxpr; its equations are cut into stages
(:func:`find_cuts`: by Flax module scope, by ``checkpoint_name`` markers, or before the
contractions where the fewest bytes cross), and each stage becomes a function that evaluates its
equations (:class:`JaxprChain`), so the profiler, the solvers and the executor apply unchanged.

What a stage reads:

* ``params``: the inputs of ``fun`` it reads that can carry a gradient (inexact dtypes). A
  parameter read by several stages (tied weights) is given to each; autodiff adds the pieces.
* ``context``: values that carry no gradient (integer inputs, ``fun``'s constants, and values
  computed from those alone, such as a causal mask or positions). A context value made in one
  stage and read by a later one is computed once, before the chain, and held for the whole step
  (counted once, in the plan's ``x[0]``), not passed from stage to stage as an activation.
* its activation ``a_k``: every value that can carry a gradient, made by an earlier stage and
  read by this stage or a later one (a tuple, in the order the values were made). A value read
  by a stage past the next one (a U-Net's skip tensor) is part of each ``a_k`` it crosses, passed
  through unchanged: one buffer, which the plan counts once however many of those activations
  are live (:meth:`JaxprChain.shared_values`, ``ChainCosts.shared``).

An equation with sub-jaxprs (``pjit``, ``custom_jvp_call``, ``custom_vjp_call``, ``cond``,
``scan``, ``while``) is never cut: a ``scan`` over layers (``nn.scan``) is one stage.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from jaxremat.model.chain import Chain
from jaxremat.model.identity import function_key
from jaxremat.model.stage import Stage
from jaxremat.model.trees import itemsize

CONTRACTIONS = ("dot_general", "conv_general_dilated")
MAX_STAGES = 48
REMAT_PRIMITIVES = ("checkpoint", "remat2", "remat")  # jax.checkpoint's primitive, by jax version


@dataclass(frozen=True)
class Cuts:
    """Stage ``k`` is equations ``bounds[k] .. bounds[k+1]-1``; ``how`` says how they were chosen."""

    bounds: tuple[int, ...]
    how: str
    names: tuple[str, ...]

    @property
    def count(self) -> int:
        return len(self.bounds) - 1


def _nbytes(v: Any) -> int:
    aval = v.aval
    return int(np.prod(aval.shape)) * itemsize(aval.dtype) if hasattr(aval, "shape") else 0


def _is_var(v: Any) -> bool:
    return isinstance(v, jcore.Var) and not isinstance(v, jcore.DropVar)


def _inexact(v: Any) -> bool:
    return hasattr(v.aval, "dtype") and jnp.issubdtype(v.aval.dtype, jnp.inexact)


def _stack(eqn: Any) -> str:
    return str(eqn.source_info.name_stack)


# -- where to cut ------------------------------------------------------------------------------


def _groups(keys: Sequence[Any]) -> list[tuple[int, Any]]:
    """Runs of equal keys as (first equation, key). Equations without a key (``None``: glue
    between modules, such as a residual add in the parent's ``__call__``) join the run after
    them; trailing ones the last run."""
    runs: list[tuple[int, Any]] = []
    last_keyed = -1
    for n, key in enumerate(keys):
        if key is None:
            continue
        if not runs or runs[-1][1] != key:
            runs.append((0 if not runs else last_keyed + 1, key))
        last_keyed = n
    return runs


def _from_keys(keys: Sequence[Any], n_eqns: int, how: str) -> Cuts | None:
    runs = _groups(keys)
    if len(runs) < 2:
        return None
    bounds = tuple(n for n, _ in runs) + (n_eqns,)
    return Cuts(bounds, how, tuple("/".join(k) if isinstance(k, tuple) else str(k) for _, k in runs))


def _sub_jaxprs(eqn: Any) -> list[Any]:
    """The jaxprs inside ``eqn`` (a ``checkpoint``'s, a ``pjit``'s, a ``scan``'s body ...)."""
    found = []
    for v in eqn.params.values():
        for x in v if isinstance(v, (list, tuple)) else (v,):
            j = getattr(x, "jaxpr", x)
            if hasattr(j, "eqns"):
                found.append(j)
    return found


def _inner_path(eqn: Any) -> list[str]:
    """The module path the equations inside ``eqn`` share (a user's ``nn.remat`` block is one
    ``checkpoint`` equation at its parent's scope; inside, its own path): ``[]`` if none."""
    paths = [[p for p in _stack(e).split("/") if p] for j in _sub_jaxprs(eqn) for e in j.eqns]
    paths = [p for p in paths if p]
    if not paths:
        return []
    common = paths[0]
    for p in paths[1:]:
        n = 0
        while n < min(len(common), len(p)) and common[n] == p[n]:
            n += 1
        common = common[:n]
    return common


def _heavy(eqn: Any) -> bool:
    """A contraction, or an equation holding one (a user's ``jax.checkpoint``, a ``jit``)."""
    if eqn.primitive.name in CONTRACTIONS:
        return True
    return any(_heavy(e) for j in _sub_jaxprs(eqn) for e in j.eqns)


def scope_cuts(eqns: Sequence[Any], depth: int) -> Cuts | None:
    """Cut where the Flax module path (the equations' name stack) changes at ``depth`` levels.

    An equation above that depth joins the stage after it, unless it holds a contraction: a
    user's ``nn.remat`` block (one ``checkpoint`` equation at its parent's scope) or a matmul
    written in the parent's ``__call__`` is a stage of its own, named by the path inside it."""
    keys: list[Any] = []
    for n, e in enumerate(eqns):
        parts = [p for p in _stack(e).split("/") if p]
        if len(parts) >= depth:
            keys.append(tuple(parts[:depth]))
        elif _heavy(e):
            inner = _inner_path(e)
            keys.append((*parts, *(inner or [f"{e.primitive.name}@{n}"]))[: max(depth, len(parts) + 1)])
        else:
            keys.append(None)
    return _from_keys(keys, len(eqns), f"Flax module scope, depth {depth}")


def pattern_cuts(eqns: Sequence[Any], pattern: str) -> Cuts | None:
    """Cut where the part of the module path that ``pattern`` (a regex) matches changes."""
    rx = re.compile(pattern)
    keys = []
    for e in eqns:
        m = rx.search(_stack(e))
        keys.append(m.group(0) if m else None)
    if all(k is None for k in keys):
        return None
    return _from_keys(keys, len(eqns), f"module paths matching {pattern!r}")


def name_cuts(eqns: Sequence[Any]) -> Cuts | None:
    """Cut after every ``jax.ad_checkpoint.checkpoint_name`` marker."""
    after = [n + 1 for n, e in enumerate(eqns) if e.primitive.name == "name" and n + 1 < len(eqns)]
    if not after:
        return None
    bounds = tuple(sorted({0, *after})) + (len(eqns),)
    names = ["start"] + [str(eqns[b - 1].params.get("name", "")) for b in bounds[1:-1]]
    return Cuts(bounds, "checkpoint_name markers", tuple(names))


def crossing_bytes(jaxpr: Any) -> np.ndarray:
    """Bytes of gradient-carrying values live across each boundary ``t`` (between equations
    ``t-1`` and ``t``), ``t = 0 .. len(eqns)``."""
    eqns = jaxpr.eqns
    made: dict[Any, int] = {}
    last: dict[Any, int] = {}
    for n, e in enumerate(eqns):
        for v in e.invars:
            if _is_var(v):
                last[v] = n
        for v in e.outvars:
            if _is_var(v):
                made[v] = n
    for v in jaxpr.outvars:
        if _is_var(v):
            last[v] = len(eqns)
    diff = np.zeros(len(eqns) + 2)
    for v, d in made.items():
        if v in last and _inexact(v) and last[v] > d:
            diff[d + 1] += _nbytes(v)
            diff[last[v] + 1] -= _nbytes(v)
    return np.cumsum(diff)[: len(eqns) + 1]


def bytes_cuts(jaxpr: Any, max_stages: int) -> Cuts | None:
    """Cut before contractions (matmuls, convolutions) where the fewest bytes cross, at most
    ``max_stages`` stages."""
    eqns = jaxpr.eqns
    cb = crossing_bytes(jaxpr)
    cands = [n for n, e in enumerate(eqns) if e.primitive.name in CONTRACTIONS and n > 0]
    if not cands:
        return None
    if len(cands) >= max_stages:
        cands = sorted(sorted(cands, key=lambda n: (cb[n], n))[: max_stages - 1])
    bounds = tuple(sorted({0, *cands})) + (len(eqns),)
    if len(bounds) < 3:
        return None
    return Cuts(bounds, "before contractions, where the fewest bytes cross", tuple(f"eqn {b}" for b in bounds[:-1]))


def find_cuts(jaxpr: Any, stages: Any = "auto", max_stages: int = MAX_STAGES) -> Cuts:
    """The stages of ``jaxpr``'s equations.

    ``stages``: ``"auto"`` (the Flax module-scope depth with the most stages up to
    ``max_stages``; else ``checkpoint_name`` markers; else cuts before contractions), an int
    (a module-scope depth), ``"names"`` (``checkpoint_name`` markers), ``"bytes"``, or a regular
    expression over module paths (``r"blocks_\\d+"``). ``ValueError`` saying what was found when
    fewer than two stages come out."""
    eqns = jaxpr.eqns
    depth_max = max((len([p for p in _stack(e).split("/") if p]) for e in eqns), default=0)
    if isinstance(stages, bool) or not isinstance(stages, (int, str)):
        raise ValueError(f"stages must be 'auto', 'names', 'bytes', a module-scope depth (int) or a regex; got {stages!r}")
    if isinstance(stages, int):
        found = scope_cuts(eqns, stages)
        what = f"module scope depth {stages} (the deepest module path here has {depth_max} levels)"
    elif stages == "names":
        found, what = name_cuts(eqns), "checkpoint_name markers"
    elif stages == "bytes":
        found, what = bytes_cuts(jaxpr, max_stages), "matmuls or convolutions to cut before"
    elif stages == "auto":
        found = None
        for d in range(1, depth_max + 1):
            c = scope_cuts(eqns, d)
            if c is not None and c.count <= max_stages and (found is None or c.count > found.count):
                found = c
        found = found or name_cuts(eqns) or bytes_cuts(jaxpr, max_stages)
        what = "Flax module scopes, checkpoint_name markers or matmuls/convolutions"
    else:
        found = pattern_cuts(eqns, stages)
        if found is None:
            paths = sorted({_stack(e) for e in eqns if _stack(e)})[:6]
            raise ValueError(
                f"stages={stages!r} matches no module path of this function; its paths look like "
                f"{paths or ['(none: the function has no Flax module scopes)']}"
            )
        what = f"module paths matching {stages!r}"
    if found is None or found.count < 2:
        raise ValueError(
            f"jaxremat.remat found fewer than two stages in this function ({len(eqns)} equations) by {what}; "
            "cut it with stages=<a module-scope depth, or a regex over module paths>, mark cut points with "
            "jax.ad_checkpoint.checkpoint_name(x, name) and stages='names', or remat a function with more layers"
        )
    return found


# -- the chain -----------------------------------------------------------------------------------


def _evaluate(eqns: Sequence[Any], env: dict) -> None:
    """Evaluate ``eqns`` in order, reading and writing ``env`` (Var -> value)."""
    read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]  # noqa: E731
    for e in eqns:
        bound = e.primitive.get_bind_params(e.params)  # jax >= 0.7: the params; before: (subfuns, params)
        subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
        ctx = getattr(getattr(e, "ctx", None), "manager", None)
        if ctx is None:
            out = e.primitive.bind(*subfuns, *[read(v) for v in e.invars], **params)
        else:
            with ctx:
                out = e.primitive.bind(*subfuns, *[read(v) for v in e.invars], **params)
        outs = out if e.primitive.multiple_results else [out]
        for v, x in zip(e.outvars, outs):
            if _is_var(v):
                env[v] = x


@dataclass(frozen=True)
class StagePlan:
    """What stage ``k`` reads and makes (indices into ``fun``'s flat inputs, and jaxpr vars)."""

    eqns: tuple
    params: tuple[int, ...]  # flat inputs carrying a gradient
    inputs: tuple[int, ...]  # flat inputs carrying none
    context: tuple  # vars made by the prologue (no gradient), held for the step
    acts_in: tuple  # the activation a_k
    outs: tuple  # a_{k+1}, or the function's outputs for the last stage


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def stage_digest(p: StagePlan, invars: Sequence[Any]) -> str:
    """What a stage computes, the same in every process: its equations (primitives, parameters
    without memory addresses, operand shapes), wired by position (a value is named by where it
    comes from: the stage's parameters, inputs, context, activation, or an equation's output),
    and which of those values it returns. Two stages with equal digests compute the same
    function of equally shaped variables; a value passed through (a U-Net skip) is part of it.
    (Python's ``hash`` of a string changes with each process, so a disk cache keyed by it never
    hit in a new one.)"""
    names: dict[Any, str] = {}
    groups = (("p", [invars[j] for j in p.params]), ("in", [invars[j] for j in p.inputs]), ("c", p.context),
              ("a", p.acts_in))
    for group, vs in groups:
        for n, v in enumerate(vs):
            names[v] = f"{group}{n}"
    parts: list[str] = [str([f"{g}:{[str(v.aval) for v in vs]}" for g, vs in groups])]

    def ref(v: Any) -> str:
        if isinstance(v, jcore.Literal):
            return f"lit({v.val!r}:{v.aval})"
        if v not in names:  # a constant of the function
            names[v] = f"k{len(names)}:{v.aval}"
        return names[v]

    for n, e in enumerate(p.eqns):
        params = _ADDRESS.sub("", str(sorted((k, str(v)) for k, v in e.params.items())))
        parts.append(f"{e.primitive.name}({','.join(ref(v) for v in e.invars)}){params}")
        for m, v in enumerate(e.outvars):
            if _is_var(v):
                names[v] = f"e{n}.{m}:{v.aval}"
    parts.append(str([ref(v) if _is_var(v) or isinstance(v, jcore.Literal) else "?" for v in p.outs]))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


class JaxprChain:
    """A traced function cut into a :class:`~jaxremat.Chain` of stages."""

    def __init__(self, closed: Any, cuts: Cuts):
        self.closed, self.cuts = closed, cuts
        jaxpr = closed.jaxpr
        eqns = jaxpr.eqns
        self.invars = list(jaxpr.invars)
        pos = {v: n for n, v in enumerate(self.invars)}
        consts = dict(zip(jaxpr.constvars, closed.consts))
        self.consts = consts
        stage_of: dict[Any, int] = {}
        for k in range(cuts.count):
            for e in eqns[cuts.bounds[k] : cuts.bounds[k + 1]]:
                for v in e.outvars:
                    if _is_var(v):
                        stage_of[v] = k
        # no gradient: non-inexact inputs, constants, and what is computed from those alone
        nograd = {v for v in self.invars if not _inexact(v)} | set(jaxpr.constvars)
        for e in eqns:
            if all(not _is_var(v) or v in nograd for v in e.invars):
                nograd.update(v for v in e.outvars if _is_var(v))
        self.nograd = nograd
        used_by: dict[Any, set[int]] = {}
        for k in range(cuts.count):
            for e in eqns[cuts.bounds[k] : cuts.bounds[k + 1]]:
                for v in e.invars:
                    if _is_var(v):
                        used_by.setdefault(v, set()).add(k)
        L = cuts.count
        outs = [v for v in jaxpr.outvars if _is_var(v)]
        for v in outs:
            used_by.setdefault(v, set()).add(L - 1)
        made = [v for e in eqns for v in e.outvars if _is_var(v)]
        plans = []
        self.context_vars: list = []
        for k in range(L):
            sl = tuple(eqns[cuts.bounds[k] : cuts.bounds[k + 1]])
            reads = {v for e in sl for v in e.invars if _is_var(v)} | (set(outs) if k == L - 1 else set())
            params = tuple(sorted(pos[v] for v in reads if v in pos and _inexact(v)))
            inputs = tuple(sorted(pos[v] for v in reads if v in pos and not _inexact(v)))
            context = tuple(v for v in made if v in reads and stage_of[v] < k and v in nograd)
            acts = tuple(
                v for v in made if stage_of[v] < k and v not in nograd and max(used_by.get(v, {-1})) >= k
            )
            plans.append(StagePlan(sl, params, inputs, context, acts, ()))
            self.context_vars += [v for v in context if v not in self.context_vars]
        for k in range(L):
            nxt = plans[k + 1].acts_in if k + 1 < L else tuple(jaxpr.outvars)
            plans[k] = StagePlan(plans[k].eqns, plans[k].params, plans[k].inputs, plans[k].context, plans[k].acts_in, nxt)
        self.plans = plans
        # the prologue: the equations the context values need, in order
        need = set(self.context_vars)
        prologue = []
        for e in reversed(eqns):
            if any(_is_var(v) and v in need for v in e.outvars):
                prologue.append(e)
                need.update(v for v in e.invars if _is_var(v))
        self.prologue = tuple(reversed(prologue))
        self.chain = Chain(tuple(self._stage(k) for k in range(L)))

    def _stage(self, k: int) -> Stage:
        p = self.plans[k]
        consts = self.consts

        def apply(variables: dict, a: tuple, rngs: Any) -> tuple[Any, dict]:
            env = dict(consts)
            env.update(zip((self.invars[j] for j in p.params), variables["params"]))
            env.update(zip((self.invars[j] for j in p.inputs), variables["inputs"]))
            env.update(zip(p.context, variables["context"]))
            env.update(zip(p.acts_in, a))
            _evaluate(p.eqns, env)
            read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]  # noqa: E731
            return tuple(read(v) for v in p.outs), {}

        name = self.cuts.names[k]
        return Stage(f"{k}:{name}", name.split("/")[-1] or "stage", apply, key=function_key(apply) + ":" + stage_digest(p, self.invars))

    def variables(self, flat: Sequence[Any]) -> list[dict]:
        """Each stage's variables from ``fun``'s flat inputs (the prologue runs here)."""
        env = dict(self.consts)
        env.update(zip(self.invars, flat))
        _evaluate(self.prologue, env)
        return [
            {"params": tuple(flat[j] for j in p.params), "inputs": tuple(flat[j] for j in p.inputs),
             "context": tuple(env[v] for v in p.context)}
            for p in self.plans
        ]

    def variable_shapes(self, flat: Sequence[Any]) -> list[dict]:
        """:meth:`variables` as shapes, from ``fun``'s flat inputs as ShapeDtypeStructs (their
        shardings kept for the parameters and inputs)."""
        context = jax.eval_shape(lambda flat: [v["context"] for v in self.variables(flat)], list(flat))
        return [
            {"params": tuple(flat[j] for j in p.params), "inputs": tuple(flat[j] for j in p.inputs), "context": tuple(c)}
            for p, c in zip(self.plans, context)
        ]

    def activation_bytes(self, k: int) -> int:
        """Bytes of ``a_k`` (global shapes), ``k = 0 .. L``."""
        vs = self.plans[k].acts_in if k < len(self.plans) else self.plans[-1].outs
        return sum(_nbytes(v) for v in vs if _is_var(v))

    def shared_values(self) -> list[tuple[int, int, int, str]]:
        """``(first, last, bytes, name)`` of each value that is part of ``a_first .. a_last``
        (two or more activations), with its global size and the name of the stage that makes it."""
        where: dict[Any, list[int]] = {}
        for k, p in enumerate(self.plans):
            for v in p.acts_in:
                where.setdefault(v, []).append(k)
        L = len(self.plans)
        for v in dict.fromkeys(v for v in self.closed.jaxpr.outvars if _is_var(v)):
            if v in where:
                where[v].append(L)
        return [(ks[0], ks[-1], _nbytes(v), self.cuts.names[ks[0] - 1]) for v, ks in where.items() if len(ks) > 1]

    @property
    def user_remat(self) -> tuple[int, ...]:
        """The stages holding the function's own ``jax.checkpoint`` / ``nn.remat`` (kept as written
        inside them: the plan decides around them)."""
        return tuple(k for k, p in enumerate(self.plans) if any(e.primitive.name in REMAT_PRIMITIVES for e in p.eqns))

    @property
    def context_bytes(self) -> int:
        """Bytes of the context values held for the whole step."""
        return sum(_nbytes(v) for v in self.context_vars)


def trace(fun: Callable, args: tuple) -> tuple[Any, Any, Any]:
    """``fun``'s closed jaxpr at ``args``' shapes, with the input and output tree structures."""
    flat, in_tree = jax.tree.flatten(args)
    shapes = [jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)) for x in flat]
    out_tree: list = []

    def flat_fun(*leaves: Any) -> list:
        out = fun(*jax.tree.unflatten(in_tree, leaves))
        leaves_out, tree = jax.tree.flatten(out)
        for path, leaf in jax.tree_util.tree_leaves_with_path(out):
            if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
                raise TypeError(
                    f"jaxremat.remat: the function's outputs must be arrays; output{jax.tree_util.keystr(path)} is "
                    f"{type(leaf).__name__} {leaf!r}: return it from outside the remat'd function"
                )
        out_tree.append(tree)
        return leaves_out

    closed = jax.make_jaxpr(flat_fun)(*shapes)
    return closed, in_tree, out_tree[0]


__all__ = ["Cuts", "JaxprChain", "StagePlan", "crossing_bytes", "find_cuts", "trace"]
