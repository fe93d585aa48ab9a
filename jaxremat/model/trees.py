"""Pytrees of arrays: their bytes, their shapes as text, and the check that activations are arrays."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxremat.core.compile import argument_sharding


def is_traced(leaf: Any) -> bool:
    """Whether ``leaf`` is a value being traced (inside ``jit``, ``grad``, ...), by its type's
    name: ``jax.core`` is not a stable place to import ``Tracer`` from."""
    return type(leaf).__name__.endswith("Tracer")


def _traced_sharding(leaf: Any) -> Any:
    """A traced value's sharding, where its type carries one (a mesh with ``Explicit`` axes only,
    set with ``jax.set_mesh``), else ``None``. Inside jit only the abstract mesh is known: the
    sharding is put on a mesh of the same axes over ``jax.devices()``, which partitions (and so
    sizes) every program the same way, whichever device holds which shard."""
    try:
        s = getattr(jax.typeof(leaf), "sharding", None)
    except Exception:  # noqa: BLE001 - no sharding in the type
        return None
    if not isinstance(s, jax.sharding.NamedSharding) or not isinstance(s.mesh, jax.sharding.AbstractMesh):
        return s if isinstance(s, jax.sharding.NamedSharding) else None
    if s.mesh.empty or s.mesh.size > jax.device_count():
        return None
    if any(t != jax.sharding.AxisType.Explicit for t in s.mesh.axis_types):
        # under Auto axes (the legacy ``with mesh:``) the type's spec says nothing of the
        # layout: a batch-sharded argument's reads P(None, None), which sized the plan for the
        # whole batch on every device (7.1 MB predicted, 4.2 used per device)
        return None
    mesh = jax.make_mesh(s.mesh.axis_sizes, s.mesh.axis_names, axis_types=s.mesh.axis_types)
    return jax.sharding.NamedSharding(mesh, s.spec)


def sharding_of(leaf: Any) -> Any:
    """``leaf``'s sharding when it spreads over more than one device (a ``jax.Array`` or a
    ``ShapeDtypeStruct`` laid out on a mesh, or a traced value whose type says its sharding),
    else ``None`` (one device, or a traced value under ``Auto`` mesh axes)."""
    try:
        s = getattr(leaf, "sharding", None)
    except Exception:  # noqa: BLE001 - a tracer may refuse to say
        s = None
    if s is None and is_traced(leaf):  # its type may say, or jaxremat.jit's arguments
        s = _traced_sharding(leaf)
        if s is None:
            s = argument_sharding(np.shape(leaf), leaf.dtype)
    return s if s is not None and hasattr(s, "shard_shape") and getattr(s, "num_devices", 1) > 1 else None


def sharding_key(s: Any) -> str | None:
    """What of a sharding (or ``None``) a plan depends on, as text: the mesh's axis sizes and
    the partition spec of a ``NamedSharding`` (not which devices), else its text."""
    if s is None:
        return None
    if isinstance(s, jax.sharding.NamedSharding):
        return f"{dict(s.mesh.shape)}:{s.spec}"
    return str(s)


def is_sharded(tree: Any) -> bool:
    """Whether any leaf of ``tree`` is laid out over several devices."""
    return any(sharding_of(leaf) is not None for leaf in jax.tree.leaves(tree))


def mesh_devices(tree: Any) -> int:
    """The most devices any leaf of ``tree`` is laid out over (1 on one device)."""
    return max(
        [sharding_of(leaf).num_devices for leaf in jax.tree.leaves(tree) if sharding_of(leaf) is not None], default=1
    )


def abstract(tree: Any) -> Any:
    """``jax.ShapeDtypeStruct`` leaves for every array leaf of ``tree`` (no array operations),
    keeping a multi-device sharding."""
    return jax.tree.map(lambda t: jax.ShapeDtypeStruct(np.shape(t), t.dtype, sharding=sharding_of(t)), tree)


def with_shardings(tree: Any, shardings: Any) -> Any:
    """``tree``'s ShapeDtypeStructs laid out as ``shardings`` (a matching tree of shardings)."""
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), tree, shardings)


def itemsize(dtype: Any) -> int:
    """Bytes per element of ``dtype``, also of JAX's extended dtypes (a PRNG key's ``key<fry>``
    holds 8 bytes), which NumPy cannot interpret."""
    size = getattr(dtype, "itemsize", None)
    return int(size) if size is not None else np.dtype(dtype).itemsize


def tree_bytes(tree: Any) -> int:
    """Bytes of every array leaf of ``tree`` (arrays or ShapeDtypeStructs), per device for a
    leaf laid out over several devices (one shard's bytes)."""

    def one(s: Any) -> int:
        sh = sharding_of(s)
        shape = sh.shard_shape(tuple(s.shape)) if sh is not None else s.shape
        return int(np.prod(shape)) * itemsize(s.dtype)

    return int(sum(one(s) for s in jax.tree.leaves(tree)))


def all_floating(tree: Any) -> bool:
    """Whether ``tree`` has leaves and all of them are floating (inexact): it has a cotangent."""
    leaves = jax.tree.leaves(tree)
    return bool(leaves) and all(jnp.issubdtype(jnp.result_type(x), jnp.inexact) for x in leaves)


def describe(tree: Any) -> str:
    """Shapes and dtypes of ``tree`` as text: ``{'a': 'float32[2, 3]'}``."""
    return str(jax.tree.map(lambda s: f"{getattr(s.dtype, 'name', s.dtype)}{list(s.shape)}", tree))


def check_leaves(tree: Any, what: str) -> None:
    """``ValueError`` naming ``what`` and the path when a leaf of ``tree`` is not an array."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            raise ValueError(
                f"{what} has a non-array leaf at {jax.tree_util.keystr(path)}: {type(leaf).__name__}; "
                "activations must be arrays or pytrees of arrays"
            )


__all__ = [
    "itemsize",
    "abstract",
    "all_floating",
    "mesh_devices",
    "check_leaves",
    "describe",
    "is_sharded",
    "is_traced",
    "sharding_key",
    "sharding_of",
    "tree_bytes",
    "with_shardings",
]
