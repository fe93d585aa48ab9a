"""Programs compiled side by side: XLA compiles without holding Python's GIL, so the distinct
stages of a profile (and the programs one stage needs) compile in threads, about twice as fast
on two cores (a ResNet's 29 stages: 21.4 s one after another, 13.6 side by side; CPU,
2026-12-06).

Only on one device: a mesh set by a context manager (``jax.set_mesh``, ``with mesh:``) and
flax's logical axis rules belong to the thread that set them, so on several devices every
program is compiled in the calling thread."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, TypeVar

import jax

T = TypeVar("T")
R = TypeVar("R")

#: The most programs compiled at once.
COMPILE_THREADS = max(1, min(4, os.cpu_count() or 1))


def threads() -> int:
    """How many threads compile at once here: :data:`COMPILE_THREADS` on one device, else 1."""
    return COMPILE_THREADS if jax.device_count() == 1 else 1


def side_by_side(fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """``[fn(x) for x in items]``, compiled side by side where :func:`threads` allows."""
    items = list(items)
    if threads() == 1 or len(items) < 2:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=min(threads(), len(items))) as pool:
        return list(pool.map(fn, items))


__all__ = ["COMPILE_THREADS", "side_by_side", "threads"]
