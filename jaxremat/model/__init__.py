"""The model: a chain of stages built from Flax linen or NNX modules or plain functions, and
``Repeat`` for stacked copies of a block. What the profiler measures and the executor runs."""

from jaxremat.model.chain import Chain, Stacked
from jaxremat.model.repeat import Repeat
from jaxremat.model.stage import Stage

__all__ = ["Chain", "Repeat", "Stacked", "Stage"]
