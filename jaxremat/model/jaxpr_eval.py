"""A function as a jaxpr (:func:`trace`), and its equations evaluated on values, traced or
concrete (:func:`evaluate`): how a stage cut out of the jaxpr runs."""

from __future__ import annotations

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


def read(env: dict, v: Any) -> Any:
    """``v``'s value: a literal's own, a variable's from ``env``."""
    return v.val if isinstance(v, jcore.Literal) else env[v]


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


__all__ = ["evaluate", "read", "trace"]
