"""Pytrees of arrays: their bytes, their shapes as text, and the check that activations are arrays."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def abstract(tree: Any) -> Any:
    """``jax.ShapeDtypeStruct`` leaves for every array leaf of ``tree`` (no array operations)."""
    return jax.tree.map(lambda t: jax.ShapeDtypeStruct(np.shape(t), t.dtype), tree)


def tree_bytes(tree: Any) -> int:
    """Bytes of every array leaf of ``tree`` (arrays or ShapeDtypeStructs)."""
    return int(sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in jax.tree.leaves(tree)))


def describe(tree: Any) -> str:
    """Shapes and dtypes of ``tree`` as text: ``{'a': 'float32[2, 3]'}``."""
    return str(jax.tree.map(lambda s: f"{np.dtype(s.dtype).name}{list(s.shape)}", tree))


def check_leaves(tree: Any, what: str) -> None:
    """``ValueError`` naming ``what`` and the path when a leaf of ``tree`` is not an array."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            raise ValueError(
                f"{what} has a non-array leaf at {jax.tree_util.keystr(path)}: {type(leaf).__name__}; "
                "activations must be arrays or pytrees of arrays"
            )


__all__ = ["abstract", "check_leaves", "describe", "tree_bytes"]
