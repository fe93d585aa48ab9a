"""Short name stacks for the executor's traced bodies.

Every region's backward takes the ``jax.vjp`` of its body, which holds the regions nested in it;
JAX adds ``jvp`` and ``transpose`` to the name stack of everything traced inside, so an
equation of the innermost region of a 16-stage chain carried 31 pairs of them, and lowering,
which joins each nested jaxpr's stack to its caller's and writes every equation's as a string
(quadratic in its depth), spent 16 of a 25 s verification in ``NameStack.__str__`` (a
16-layer MLP, 2026-12-05). Names only label XLA's ops for debugging: nothing in jaxremat reads
them, so the bodies trace from an empty stack (Flax's module scopes inside a stage stay)."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, TypeVar

try:  # jax.extend's since jax 0.4.3x; without it, the stacks stay as they are
    from jax.extend.source_info_util import reset_name_stack as _reset
except ImportError:  # pragma: no cover
    _reset = contextlib.nullcontext

F = TypeVar("F", bound=Callable[..., Any])


def fresh_names(fn: F) -> F:
    """``fn`` traced from an empty name stack."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _reset():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
