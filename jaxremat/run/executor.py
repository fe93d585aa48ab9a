"""Run a schedule: the forward pass of a chain whose gradient follows the schedule's op list.

The schedule is read as a tree (:mod:`jaxremat.core.tree`): a stored stage runs plainly and
autodiff keeps its residuals; a checkpoint region runs its stages inside one region that keeps
only its input and is recomputed, following its inner tree, once the backward pass reaches it
(:func:`~jaxremat.run._regions.tied_checkpoint`). Before anything is traced, the schedule's
loops are planned once (:func:`~jaxremat.run.loop_plan.plan_loops`): a ``Repeat`` layer runs as
one ``lax.scan`` over its stacked variables. On the CPU compile the step with
:func:`jaxremat.jit` so that XLA keeps the remat.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Mapping

from jaxremat.core.policies import Policy
from jaxremat.core.schedule import Schedule
from jaxremat.core.tree import offloads_in, parse_offloads, units
from jaxremat.model.chain import Chain
from jaxremat.model.stage import Rngs
from jaxremat.run._variables import cut_variables
from jaxremat.run._walk import Walker
from jaxremat.run.decisions import decide
from jaxremat.run.loop_plan import Alike, plan_loops


def _warn_copies(layer: int, offloads: bool = False) -> None:
    why = (
        f"the schedule offloads buffers of Repeat layer {layer} but does not store or checkpoint each of its "
        "copies alone, which a loop that offloads needs, so it runs unrolled"
        if offloads
        else f"the schedule does not repeat one pattern over Repeat layer {layer} (a Repeat or a scanned layer stack)"
    )
    warnings.warn(
        f"jaxremat: {why}: its stacked parameters are sliced, and XLA copies the slices and the gradient's "
        "pieces: up to about twice the layer's parameter bytes more than the plan, and compile time grows "
        "with depth."
        + ("" if offloads else " Plans made by jaxremat.plan / remat_chain repeat a pattern when one fits the budget."),
        stacklevel=4,
    )


def execute(
    chain: Chain, schedule: Schedule, *, scan: bool | None = None, policies: Mapping[str, Policy] | None = None
) -> Callable[..., tuple[Any, Any]]:
    """``f(variables, x, rngs=None) -> (output, updated_collections)`` whose gradient follows
    ``schedule``: stored stages keep their residuals (all of them, or those their store option's
    checkpoint policy saves; a :class:`~jaxremat.core.schedule.Block` of them, those its policy
    saves over the whole block), checkpoint regions keep only their input and are recomputed in the
    schedule's order. ``updated_collections`` (e.g. ``batch_stats``) are per stage index, each
    updated once per step. ``policies`` names the checkpoint policies of store options that are
    not built in (:mod:`jaxremat.core.policies`).

    Offloaded buffers (``Offload`` / ``Prefetch`` ops of ``"optimal_offload"``) are moved with
    ``jax.device_put`` to ``jax.memory.Space.Host`` in the forward pass and back before the
    backward reads them (:mod:`~jaxremat.run._offload`): a region's saved input, a stored stage's
    residuals. A Repeat layer with an offloaded buffer runs as loops over runs of alike copies
    (:mod:`~jaxremat.run.offload_loop`) when each copy is stored or checkpointed alone, and
    unrolled otherwise (a warning says so).

    Runs of alike units (same structure over stages with the same identity) run as one
    ``lax.scan``, so that tracing and compiling stay flat with depth:

    * ``scan=None`` (default): runs over the copies of a :class:`~jaxremat.Repeat`, whose
      variables are already stacked (cut once, no copy);
    * ``scan=True``: also runs over separately stored identical stages (shape-preserving); the
      price is that their variables are stacked inside the step (a copy, and a stacked
      gradient), memory the plan does not count;
    * ``scan=False``: no scan.
    """
    L = len(chain)
    if schedule.costs.length != L:
        raise ValueError(f"the schedule is for a chain of {schedule.costs.length} stages; this chain has {L}")
    tree, offloaded = parse_offloads(schedule.ops, L)
    spine, _ = units(tree)
    decided = decide(chain, schedule, tree, offloaded, policies)

    def forward(variables: Any, x: Any, rngs: Rngs = None) -> tuple[Any, Any]:
        shapes = chain.stage_shapes(variables)  # the loops depend on the variables' shapes
        alike = Alike(chain, shapes)
        loops = plan_loops(chain, shapes, spine, scan, alike, offloaded)
        for layer in loops.sliced_layers:
            g = next(g for g in chain.stacked if g.layer == layer)
            _warn_copies(layer, offloads=offloads_in(offloaded, g.start, g.start + g.length))
        updates: dict[int, Any] = {}
        walker = Walker(chain, rngs, cut_variables(chain, variables, loops), loops, alike, scan, decided)
        return walker.run(tree, L, x, updates), updates

    return forward


__all__ = ["execute"]
