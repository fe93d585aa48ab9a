"""Running a schedule inside the user's ``jax.jit``: ``execute`` (checkpoint regions tied to the
backward pass, loops over ``Repeat`` layers), and the selective loop."""

from jaxremat.run.executor import execute
from jaxremat.run.selective import selective_scan

__all__ = ["execute", "selective_scan"]
