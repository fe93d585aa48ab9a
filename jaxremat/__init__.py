"""jaxremat: train models that do not fit in accelerator memory.

Give a memory budget; jaxremat profiles the model's stages with XLA, solves for the fastest
schedule of which activations to keep and which to recompute (the persistent dynamic program
of Rotor, with its store-all check corrected), and runs it inside an ordinary ``jax.jit`` step
with gradients identical to plain autodiff.

The package follows the data flow, each folder importing only from the ones before it:
``core`` (costs, ops, schedules, budgets, loop rules, compile options) → ``model`` (chains of
stages) → ``profiling`` (what XLA keeps) → ``solvers`` → ``run`` (the executor) → ``api``
(plans, ``remat_chain``, ``remat_nnx``) → ``tools`` (comparison, CLI, demo, example models).
"""

from jaxremat.api import (
    Plan,
    RematChain,
    RematFunction,
    RematSequential,
    load_plan,
    plan,
    remat,
    remat_chain,
    remat_nnx,
)
from jaxremat.core.budgets import Budget, parse_budget, store_all_peak
from jaxremat.core.compile import compiler_options, jit
from jaxremat.core.costs import ChainCosts, Shared, StageOption
from jaxremat.core.ops import Op, OpKind
from jaxremat.core.schedule import InfeasibleBudget, Schedule, StageDecision
from jaxremat.core.simulator import Replay, simulate
from jaxremat.core.transfers import Bandwidth
from jaxremat.core.units import format_bytes, parse_bytes
from jaxremat.model import Chain, Repeat
from jaxremat.profiling.profiler import profile
from jaxremat.run import execute
from jaxremat.solvers import ALGORITHMS, OFFLOAD_ALGORITHMS, min_budget, pareto, solve

__version__ = "0.1.0"

__all__ = [
    "ALGORITHMS",
    "Bandwidth",
    "Budget",
    "Chain",
    "ChainCosts",
    "InfeasibleBudget",
    "Op",
    "OFFLOAD_ALGORITHMS",
    "OpKind",
    "Plan",
    "RematChain",
    "RematFunction",
    "RematSequential",
    "Replay",
    "Repeat",
    "Schedule",
    "Shared",
    "StageDecision",
    "StageOption",
    "compiler_options",
    "execute",
    "format_bytes",
    "jit",
    "load_plan",
    "min_budget",
    "pareto",
    "parse_budget",
    "parse_bytes",
    "plan",
    "profile",
    "remat",
    "remat_chain",
    "remat_nnx",
    "simulate",
    "solve",
    "store_all_peak",
]
