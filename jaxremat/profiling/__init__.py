"""Profiling: per-stage sizes, transients and times read from what XLA compiles (its buffer
assignment across an optimisation barrier), cached on disk."""

from jaxremat.profiling.profiler import profile_stages, report
from jaxremat.profiling.rates import Rates
from jaxremat.profiling.stage import StageProfile

__all__ = ["Rates", "StageProfile", "profile_stages", "report"]
