"""jaxremat: train models that do not fit in accelerator memory.

Give a memory budget; jaxremat profiles the model's stages with XLA, solves for the fastest
schedule of which activations to keep and which to recompute (the persistent dynamic program
of Rotor, with its store-all check corrected), and runs it inside an ordinary ``jax.jit`` step
with gradients identical to plain autodiff.

The package follows the data flow, each folder importing only from the ones before it:
``core`` (costs, ops, schedules, budgets, loop rules, compile options) → ``model`` (chains of
stages) → ``profiling`` (what XLA keeps) → ``solvers`` → ``run`` (the executor) → ``api``
(plans, ``remat_chain``, ``remat_nnx``) → ``tools`` (comparison, CLI, demo, example models).

The names here are the public API: the decorators, plans, the solver and its cost record,
budgets, errors and compile options. The rest lives in the submodules (``jaxremat.core.ops.Op``,
``jaxremat.core.transfers.Bandwidth``, ``jaxremat.solvers.OFFLOAD_ALGORITHMS`` ...).
"""

from jaxremat.api import (
    Plan,
    RematChain,
    RematFunction,
    load_plan,
    plan,
    remat,
    remat_chain,
    remat_nnx,
)
from jaxremat.core.budgets import Budget, parse_budget, store_all_peak
from jaxremat.core.compile import compiler_options, jit
from jaxremat.core.costs import ChainCosts, Shared, StageOption
from jaxremat.core.device import Device
from jaxremat.core.schedule import InfeasibleBudget, Schedule
from jaxremat.core.simulator import simulate
from jaxremat.core.units import format_bytes
from jaxremat.model import Chain, Repeat
from jaxremat.profiling.profiler import profile
from jaxremat.run import execute
from jaxremat.solvers import ALGORITHMS, min_budget, pareto, solve
from jaxremat.tools.fit import fit

__version__ = "0.1.0"

__all__ = [
    "ALGORITHMS",
    "Budget",
    "Chain",
    "ChainCosts",
    "Device",
    "InfeasibleBudget",
    "Plan",
    "RematChain",
    "RematFunction",
    "Repeat",
    "Schedule",
    "Shared",
    "StageOption",
    "compiler_options",
    "execute",
    "fit",
    "format_bytes",
    "jit",
    "load_plan",
    "min_budget",
    "pareto",
    "parse_budget",
    "plan",
    "profile",
    "remat",
    "remat_chain",
    "remat_nnx",
    "simulate",
    "solve",
    "store_all_peak",
]
