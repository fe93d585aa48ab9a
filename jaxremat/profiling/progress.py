"""A progress bar for the first call's slow parts, shown only where it helps: on a terminal,
unless ``quiet``, and once the work has taken longer than :data:`AFTER` seconds (a profile
read from the cache, or one of a few small stages, shows nothing)."""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any, Callable, Iterator

#: Seconds of work before the bar shows.
AFTER = 2.0


@contextlib.contextmanager
def progress(total: int | None, label: str, quiet: bool, after: float = AFTER) -> Iterator[Callable[[str], None]]:
    """``advance(detail)``: one of ``total`` steps of ``label`` done (``None``: as many as it
    takes), ``detail`` (``"6 distinct: 3 measured, 3 from the cache"``) shown beside it. A rich
    bar on stderr when it is a terminal, from the first step after ``after`` seconds; nothing
    when ``quiet``."""
    if quiet or not sys.stderr.isatty():
        yield lambda detail="": None
        return
    from rich.console import Console
    from rich.progress import Progress

    start, done = time.perf_counter(), 0
    state: dict[str, Any] = {}
    stack = contextlib.ExitStack()

    def advance(detail: str = "") -> None:
        nonlocal done
        done += 1
        if "bar" not in state and time.perf_counter() - start < after:
            return
        if "bar" not in state:
            bar = stack.enter_context(Progress(console=Console(stderr=True), transient=True))
            state["bar"], state["task"] = bar, bar.add_task(label, total=total, completed=done - 1)
        text = f"{label} ({detail})" if detail else label
        state["bar"].update(state["task"], completed=done, description=text)

    with stack:
        yield advance


__all__ = ["AFTER", "progress"]
