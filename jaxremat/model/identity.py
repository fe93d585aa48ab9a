"""A stage's identity: what makes two stages compute the same function on the same shapes.

One definition for everything that asks: the profiler measures identical stages once and caches
them on disk by it, a plan is checked against the model by it, the executor runs alike stages
in one loop by it, and the regulariser only swaps stages that share it.
"""

from __future__ import annotations

import hashlib
import json
import types
from typing import Any, Callable

import jax
import numpy as np

from jaxremat.model.stage import Stage


def _digest_code(code: types.CodeType, h: Any) -> None:
    """Feed ``code`` to the hash ``h``: its bytecode, the names it reads (``jnp.sum`` and
    ``jnp.mean`` compile to the same bytecode and differ in ``co_names`` alone) and its constants,
    nested code objects (lambdas, comprehensions) by their own contents: their ``repr`` holds a
    memory address, which differs from process to process and would miss the disk cache."""
    h.update(code.co_code)
    h.update(repr(code.co_names).encode())
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            _digest_code(c, h)
        elif isinstance(c, frozenset):  # `x in {"a", "b"}`: its order follows the string hash seed
            h.update(repr(sorted(map(repr, c))).encode())
        else:
            h.update(repr(c).encode())


def function_key(fn: Callable) -> str:
    """A plain function's structure: its qualified name and a hash of its code (bytecode, names
    and constants), the same in every process."""
    code = getattr(fn, "__code__", None)
    if code is None:
        body = repr(fn)
    else:
        h = hashlib.sha256()
        _digest_code(code, h)
        body = h.hexdigest()[:16]
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__name__)}:{body}"


def closure_key(fn: Callable) -> str:
    """:func:`function_key` plus the values ``fn`` closes over (a policy made by
    ``save_only_these_names("q")`` differs from one made with ``"k"`` by them alone)."""
    cells = getattr(fn, "__closure__", None) or ()
    return f"{function_key(fn)}:{[c.cell_contents for c in cells]!r}"


def leaf_signature(tree: Any) -> list[tuple[str, tuple[int, ...], str]]:
    """Per array leaf of ``tree``: its path, shape and dtype."""
    return [
        (jax.tree_util.keystr(path), tuple(int(d) for d in np.shape(leaf)), str(leaf.dtype))
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    ]


def stage_identity(stage: Stage, variables: Any, inputs: Any = None, costs: bool = False) -> str:
    """The identity of ``stage`` with variables shaped like ``variables`` (and, when given,
    inputs shaped like ``inputs``), as text. Two stages with equal identities compute the same
    function of their variables and input; a stage without a ``key`` is only equal to itself
    (its name is part of its identity). ``costs``: what the profiler measures by, equal also for
    stages that cost the same (:attr:`~jaxremat.model.stage.Stage.cost_key`)."""
    key = (stage.cost_key or stage.key) if costs else stage.key
    parts: list[Any] = [key or f"unkeyed:{stage.kind}:{stage.name}", leaf_signature(variables)]
    if inputs is not None:
        parts.append(leaf_signature(inputs))
    return json.dumps(parts)


__all__ = ["closure_key", "function_key", "leaf_signature", "stage_identity"]
