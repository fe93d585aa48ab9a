"""The part of a :func:`jaxremat.remat` plan's report that says how the function was cut."""

from __future__ import annotations

from jaxremat.core.units import format_bytes
from jaxremat.model.jaxpr_chain import JaxprChain
from jaxremat.model.layer_stacks import describe as describe_stacks


def describe_cuts(traced: JaxprChain, static: int) -> str:
    """How ``traced`` was cut into stages, what it holds for the whole step, its layer stacks and
    the loops and user remat left as written; ``static``: how many input leaves were not arrays."""
    note = (
        f"{len(traced.chain)} stages cut by {traced.cuts.how}; held for the whole step: "
        f"{format_bytes(traced.context_bytes)} of values without a gradient (masks, positions)"
    )
    if traced.stacks:
        note += "; " + describe_stacks(traced.stacks)
    if traced.kept_remat:
        where = ", ".join(st.path or "a scan" for st in traced.kept_remat)
        note += (
            f"; your jax.checkpoint / nn.remat inside the scanned layers of {where} kept as written "
            "(user_remat='keep'): each such scan one stage, the plan decides around it"
        )
    if traced.loop_stages:
        names = ", ".join(traced.chain.stages[k].name for k in traced.loop_stages)
        note += (
            f"; stage(s) {names} hold a loop that is not a layer stack, or one kept as written (a while_loop, "
            "a scan whose per-step outputs are read, a nested scan): one stage each, what the loop stacks counted"
        )
    if static:
        note += f"; {static} static input leaves (not arrays) passed through as they are"
    if traced.user_remat:
        names = ", ".join(traced.chain.stages[k].name for k in traced.user_remat)
        note += (
            f"; your own jax.checkpoint / nn.remat inside stage(s) {names}: kept as written where the stage is "
            "stored, run as its body where the stage is recomputed alone"
        )
    return note


__all__ = ["describe_cuts"]
