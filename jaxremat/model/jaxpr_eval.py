"""A function as a jaxpr (:func:`trace`), and its equations evaluated on values, traced or
concrete (:func:`evaluate`): how a stage cut out of the jaxpr runs."""

from __future__ import annotations

import hashlib
import re
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax.extend import core as jcore

from jaxremat.model.cuts import REMAT_PRIMITIVES, _is_var


def evaluate(eqns: Sequence[Any], env: dict, inline: bool = False) -> None:
    """Evaluate ``eqns`` in order, reading and writing ``env`` (Var -> value). ``inline``: the
    function's own ``jax.checkpoint`` blocks run as their bodies (see :class:`JaxprChain`)."""
    read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]  # noqa: E731
    for e in eqns:
        body = e.params.get("jaxpr") if inline and e.primitive.name in REMAT_PRIMITIVES else None
        if body is not None and not body.constvars:
            inner = dict(zip(body.invars, [read(v) for v in e.invars]))
            evaluate(body.eqns, inner, inline)
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


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def stage_digest(p: Any, invars: Sequence[Any], costs: bool = False) -> str:
    """What a stage (a :class:`~jaxremat.model.jaxpr_chain.StagePlan` ``p``) computes, the same in
    every process: its equations (primitives, parameters without memory addresses, operand
    shapes), wired by position (a value is named by where it
    comes from: the stage's parameters, inputs, context, activation, or an equation's output),
    with ``costs``, what it costs: the same for stages that differ only by where they slice
    their variables (:attr:`~jaxremat.model.stage.Stage.cost_key`),
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
            if _is_var(v):  # a literal (a scan's first carry 0.0: an auxiliary loss) is named by its value
                names[v] = f"{group}{n}"
    parts: list[str] = [str([f"{g}:{[str(v.aval) for v in vs]}" for g, vs in groups])]

    def ref(v: Any) -> str:
        if isinstance(v, jcore.Literal):
            return f"lit({v.val!r}:{v.aval})"
        if v not in names:  # a constant of the function
            names[v] = f"k{len(names)}:{v.aval}"
        return names[v]

    read = {v for g, vs in groups[:3] for v in vs if _is_var(v)}
    for n, e in enumerate(p.eqns):
        items = e.params.items()
        if costs and e.primitive.name == "slice" and e.invars[0] in read:
            # where a slice of a stage's variables starts changes nothing it costs (each block of
            # an equinox list draws its dropout keys from its own row of one split)
            items = [(k, v) for k, v in items if k not in ("start_indices", "limit_indices")]
        params = _ADDRESS.sub("", str(sorted((k, str(v)) for k, v in items)))
        parts.append(f"{e.primitive.name}({','.join(ref(v) for v in e.invars)}){params}")
        for m, v in enumerate(e.outvars):
            if _is_var(v):
                names[v] = f"e{n}.{m}:{v.aval}"
    parts.append(str([ref(v) if _is_var(v) or isinstance(v, jcore.Literal) else "?" for v in p.outs]))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def jaxpr_text(closed: Any) -> str:
    """``closed`` as text, the same in every process: its equations with their parameters (memory
    addresses left out) and the shapes and dtypes of its constants (not their values)."""
    consts = [f"{np.shape(c)}:{jnp.result_type(c)}" for c in closed.consts]
    return _ADDRESS.sub("", str(closed.jaxpr)) + "\n" + str(consts)


def read(env: dict, v: Any) -> Any:
    """``v``'s value: a literal's own (as an array: it may be an activation's leaf), a variable's
    from ``env``."""
    return jnp.asarray(v.val, v.aval.dtype) if isinstance(v, jcore.Literal) else env[v]


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


__all__ = ["evaluate", "jaxpr_text", "read", "stage_digest", "trace"]
