"""jaxremat: train models that do not fit in accelerator memory.

Give a memory budget; jaxremat solves for the fastest schedule of which activations to keep and
which to recompute (the persistent dynamic program of Rotor, with its store-all check corrected),
and reports the predicted peak and time against the usual hand-written strategies.
"""

from jaxremat.chain import Chain
from jaxremat.costs import ChainCosts
from jaxremat.executor import compiler_options, execute, jit
from jaxremat.plans import Plan, load_plan, plan
from jaxremat.profiler import profile
from jaxremat.remat_chain import RematChain, remat_chain
from jaxremat.remat_nnx import RematSequential, remat_nnx
from jaxremat.repeat import Repeat
from jaxremat.schedule import InfeasibleBudget, Schedule, StageDecision
from jaxremat.simulate import simulate
from jaxremat.solvers import ALGORITHMS, min_budget, pareto, solve, store_all_peak
from jaxremat.units import format_bytes, parse_budget, parse_bytes

__version__ = "0.1.0"

__all__ = [
    "ALGORITHMS",
    "Chain",
    "ChainCosts",
    "InfeasibleBudget",
    "Plan",
    "RematChain",
    "RematSequential",
    "Repeat",
    "remat_nnx",
    "load_plan",
    "plan",
    "remat_chain",
    "compiler_options",
    "execute",
    "jit",
    "Schedule",
    "StageDecision",
    "format_bytes",
    "min_budget",
    "pareto",
    "profile",
    "parse_budget",
    "parse_bytes",
    "simulate",
    "solve",
    "store_all_peak",
]
