"""The user-facing layer: plans (made, saved, loaded), the planner behind ``remat_chain`` and
``remat_nnx``, and calibrated planning with XLA in the loop."""

from jaxremat.api.linen_model import RematChain, remat_chain
from jaxremat.api.nnx_model import RematSequential, remat_nnx
from jaxremat.api.planner import Planner, plan
from jaxremat.api.plans import Plan, PlanOptions, load_plan
from jaxremat.api.remat_fn import RematFunction, remat

__all__ = [
    "Plan",
    "PlanOptions",
    "Planner",
    "RematChain",
    "RematFunction",
    "RematSequential",
    "load_plan",
    "plan",
    "remat",
    "remat_chain",
    "remat_nnx",
]
