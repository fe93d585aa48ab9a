"""A chain cut out of any JAX function's jaxpr: what :func:`jaxremat.remat` plans.

``fun`` is traced once per input signature to a jaxpr; its equations are cut into stages
(:func:`find_cuts`: by Flax module scope, by ``checkpoint_name`` markers, or before the
contractions where the fewest bytes cross), and each stage becomes a function that evaluates its
equations (:class:`JaxprChain`), so the profiler, the solvers and the executor apply unchanged.

What a stage reads:

* ``params``: the inputs of ``fun`` it reads that can carry a gradient (inexact dtypes). A
  parameter read by several stages (tied weights) is given to each; autodiff adds the pieces.
* constants: values computed from literals alone (a dropout's ``zeros_like``, an ``iota``, a
  causal mask from one) are not a stage's: :meth:`JaxprChain.of` takes their equations out
  before the cuts, and every stage that reads one computes it again, as XLA fuses a broadcast
  into each reader. Held as a value (a constant of the jaxpr, or the context below), each is a
  buffer from the step's start to its end: a linen CNN's four dropout ``zeros_like`` kept
  1.5 MiB more than the user's own step (CPU, 2026-12-05).
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
``scan``, ``while``) is never cut: a ``scan`` over layers (``nn.scan``) is one stage, and a
user's ``jax.checkpoint`` / ``nn.remat`` block is a stage of its own, kept as written.
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
from jaxremat.model.cuts import (  # noqa: F401 - find_cuts, crossing_bytes: part of this module's API
    MAX_STAGES,
    REMAT_PRIMITIVES,
    Cuts,
    _inexact,
    _is_var,
    _nbytes,
    crossing_bytes,
    find_cuts,
)
from jaxremat.model.identity import function_key
from jaxremat.model.stage import Stage

# -- the chain -----------------------------------------------------------------------------------


def _evaluate(eqns: Sequence[Any], env: dict, inline: bool = False) -> None:
    """Evaluate ``eqns`` in order, reading and writing ``env`` (Var -> value). ``inline``: the
    function's own ``jax.checkpoint`` blocks run as their bodies (see :class:`JaxprChain`)."""
    read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]  # noqa: E731
    for e in eqns:
        body = e.params.get("jaxpr") if inline and e.primitive.name in REMAT_PRIMITIVES else None
        if body is not None and not body.constvars:
            inner = dict(zip(body.invars, [read(v) for v in e.invars]))
            _evaluate(body.eqns, inner, inline)
            for v, w in zip(e.outvars, body.outvars):
                if _is_var(v):
                    env[v] = w.val if isinstance(w, jcore.Literal) else inner[w]
            continue
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
    groups = (
        ("p", [invars[j] for j in p.params]),
        ("in", [invars[j] for j in p.inputs]),
        ("c", p.context),
        ("a", p.acts_in),
    )
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

    def __init__(self, closed: Any, cuts: Cuts, constants: Sequence[Any] = ()):
        """``closed`` cut by ``cuts`` (bounds into its equations); ``constants``: equations of
        literals alone taken out of it (:func:`split_constants`), recomputed by each stage that
        reads them."""
        self.closed, self.cuts, self.constants = closed, cuts, tuple(constants)
        jaxpr = closed.jaxpr
        eqns = jaxpr.eqns
        free = {v for e in self.constants for v in e.outvars if _is_var(v)}
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
        nograd = {v for v in self.invars if not _inexact(v)} | set(jaxpr.constvars) | free
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
            sl = _needed(self.constants, reads) + sl
            params = tuple(sorted(pos[v] for v in reads if v in pos and _inexact(v)))
            inputs = tuple(sorted(pos[v] for v in reads if v in pos and not _inexact(v)))
            context = tuple(v for v in made if v in reads and stage_of[v] < k and v in nograd)
            acts = tuple(v for v in made if stage_of[v] < k and v not in nograd and max(used_by.get(v, {-1})) >= k)
            plans.append(StagePlan(sl, params, inputs, context, acts, ()))
            self.context_vars += [v for v in context if v not in self.context_vars]
        for k in range(L):
            nxt = plans[k + 1].acts_in if k + 1 < L else tuple(jaxpr.outvars)
            plans[k] = StagePlan(
                plans[k].eqns, plans[k].params, plans[k].inputs, plans[k].context, plans[k].acts_in, nxt
            )
        self.plans = plans
        # the prologue: the equations the context values need, in order
        need = set(self.context_vars)
        prologue = []
        for e in reversed((*self.constants, *eqns)):  # the constants depend on nothing after them
            if any(_is_var(v) and v in need for v in e.outvars):
                prologue.append(e)
                need.update(v for v in e.invars if _is_var(v))
        self.prologue = tuple(reversed(prologue))
        self.chain = Chain(tuple(self._stage(k) for k in range(L)))

    @classmethod
    def of(cls, closed: Any, stages: Any = "auto", max_stages: int = MAX_STAGES) -> "JaxprChain":
        """``closed`` cut into stages by :func:`find_cuts` (``stages``, ``max_stages``), its
        constants taken out first (:func:`split_constants`)."""
        kept, constants = split_constants(closed)
        return cls(kept, find_cuts(kept.jaxpr, stages, max_stages), constants)

    def _stage(self, k: int) -> Stage:
        p = self.plans[k]
        consts = self.consts

        def run(variables: dict, a: tuple, inline: bool) -> tuple[Any, dict]:
            env = dict(consts)
            env.update(zip((self.invars[j] for j in p.params), variables["params"]))
            env.update(zip((self.invars[j] for j in p.inputs), variables["inputs"]))
            env.update(zip(p.context, variables["context"]))
            env.update(zip(p.acts_in, a))
            _evaluate(p.eqns, env, inline)
            read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]  # noqa: E731
            return tuple(read(v) for v in p.outs), {}

        def apply(variables: dict, a: tuple, rngs: Any) -> tuple[Any, dict]:
            return run(variables, a, False)

        def unwrapped(variables: dict, a: tuple, rngs: Any) -> tuple[Any, dict]:
            return run(variables, a, True)

        name = self.cuts.names[k]
        return Stage(
            f"{k}:{name}",
            name.split("/")[-1] or "stage",
            apply,
            key=function_key(apply) + ":" + stage_digest(p, self.invars),
            unwrapped=unwrapped if any(e.primitive.name in REMAT_PRIMITIVES for e in p.eqns) else None,
        )

    def variables(self, flat: Sequence[Any]) -> list[dict]:
        """Each stage's variables from ``fun``'s flat inputs (the prologue runs here)."""
        env = dict(self.consts)
        env.update(zip(self.invars, flat))
        _evaluate(self.prologue, env)
        return [
            {
                "params": tuple(flat[j] for j in p.params),
                "inputs": tuple(flat[j] for j in p.inputs),
                "context": tuple(env[v] for v in p.context),
            }
            for p in self.plans
        ]

    def variable_shapes(self, flat: Sequence[Any]) -> list[dict]:
        """:meth:`variables` as shapes, from ``fun``'s flat inputs as ShapeDtypeStructs (their
        shardings kept for the parameters and inputs)."""
        context = jax.eval_shape(lambda flat: [v["context"] for v in self.variables(flat)], list(flat))
        return [
            {
                "params": tuple(flat[j] for j in p.params),
                "inputs": tuple(flat[j] for j in p.inputs),
                "context": tuple(c),
            }
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


def split_constants(closed: Any) -> tuple[Any, tuple]:
    """``closed`` without the equations that compute from literals alone (transitively; none with
    effects), and those equations in order. The jaxpr returned reads their outputs without making
    them: it is for cutting and for :class:`JaxprChain`, which recomputes them where read."""
    free: set = set()
    constants, kept = [], []
    for e in closed.jaxpr.eqns:
        if not e.effects and all(not _is_var(v) or v in free for v in e.invars):
            constants.append(e)
            free.update(v for v in e.outvars if _is_var(v))
        else:
            kept.append(e)
    if not constants:
        return closed, ()
    return closed.replace(jaxpr=closed.jaxpr.replace(eqns=kept)), tuple(constants)


def _needed(constants: Sequence[Any], reads: set) -> tuple:
    """The equations of ``constants`` that the values ``reads`` need, in order."""
    need, found = set(reads), []
    for e in reversed(constants):
        if any(_is_var(v) and v in need for v in e.outvars):
            found.append(e)
            need.update(v for v in e.invars if _is_var(v))
    return tuple(reversed(found))


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


__all__ = ["Cuts", "JaxprChain", "StagePlan", "crossing_bytes", "find_cuts", "split_constants", "trace"]
