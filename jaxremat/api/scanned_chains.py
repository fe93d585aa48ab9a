"""A chain one of whose modules runs a scan over stacked layers (an ``nn.scan`` decoder inside an
``nn.Sequential``, an NNX module running ``nnx.scan`` over ``nnx.vmap``-made blocks): planned
from its jaxpr, as :func:`jaxremat.remat` plans a function, so the scan's layers are stages of
their own, run as loops (:mod:`jaxremat.model.layer_stacks`).

A module of the chain is otherwise one stage, and a scan inside it could only be stored or
recomputed whole. :func:`~jaxremat.remat_chain` and :func:`~jaxremat.remat_nnx` look for a
layer stack once per input signature (one trace of the plain forward pass) and, where they find
one, run the chain through a :class:`~jaxremat.api.remat_fn.RematFunction` of that forward pass:
the same cuts by module scope, the same loop plans and verification as ``jaxremat.remat``.
"""

from __future__ import annotations

from typing import Any, Callable

import jax

from jaxremat.api.plans import Plan, PlanOptions, signature
from jaxremat.api.remat_fn import RematFunction
from jaxremat.core.budgets import Budget
from jaxremat.model.chain import Chain
from jaxremat.model.cuts import MAX_STAGES, _is_var
from jaxremat.model.jaxpr_chain import split_constants, trace
from jaxremat.model.layer_stacks import find_stacks
from jaxremat.model.stage import Rngs, Variables, stage_rngs


def forward(chain: Chain) -> Callable[[Any, Any, Rngs], tuple[Any, dict[int, Variables]]]:
    """The chain's plain forward pass: ``(output, {stage: updated collections})``, each stage
    drawing its keys as the executor draws them (:func:`~jaxremat.model.stage.stage_rngs`)."""

    def run(variables: Any, x: Any, rngs: Rngs) -> tuple[Any, dict[int, Variables]]:
        a, updates = x, {}
        for i, (st, v) in enumerate(zip(chain.stages, chain.split(variables))):
            a, new = st.apply(v, a, stage_rngs(rngs, i))
            if new:
                updates[i] = new
        return a, updates

    return run


class ScannedChain:
    """Plans and runs a chain through :func:`forward`'s jaxpr where a module of it holds a layer
    stack (:meth:`holds_stack`, once per signature); :class:`~jaxremat.RematChain` and
    :class:`~jaxremat.RematSequential` ask it first."""

    def __init__(self, chain: Chain, budget: Budget, options: PlanOptions, fn: RematFunction | None = None):
        self.chain = chain
        self.fn = fn or RematFunction(forward(chain), budget, "auto", MAX_STAGES, options)
        self._holds: dict[str, bool] = {}

    def with_budget(self, budget: Budget) -> "ScannedChain":
        """The same chain under ``budget``, sharing the profiles and what was found."""
        other = ScannedChain(self.chain, budget, self.fn.options, self.fn.with_budget(budget))
        other._holds = self._holds
        return other

    def holds_stack(self, variables: Any, x: Any, rngs: Rngs = None) -> bool:
        """Whether the chain's forward pass on these shapes runs a layer stack (``rngs``: as the
        call gets them; ``None``, keys of the chain's streams)."""
        rngs = rngs if rngs is not None else sample_rngs(self.chain)
        key = signature(self.chain, variables, x)
        if key not in self._holds:
            closed = trace(lambda v, a, r: forward(self.chain)(v, a, r), (variables, x, rngs))[0]
            kept, constants = split_constants(closed)
            free = {v for e in constants for v in e.outvars if _is_var(v)}
            self._holds[key] = bool(find_stacks(kept.jaxpr, free))
        return self._holds[key]

    def plan(self, variables: Any, x: Any, rngs: Rngs = None) -> Plan:
        """The plan for these shapes (``rngs`` as for :meth:`holds_stack`)."""
        return self.fn.plan(variables, x, rngs if rngs is not None else sample_rngs(self.chain))

    def __call__(self, variables: Any, x: Any, rngs: Rngs) -> tuple[Any, dict[int, Variables]]:
        return self.fn(variables, x, rngs)


def sample_rngs(chain: Chain) -> Rngs:
    """Keys of the chain's streams for a plan made without them (the values do not matter)."""
    streams = sorted({s for st in chain.stages for s in st.rng_streams})
    return {s: jax.random.key(0) for s in streams} or None


__all__ = ["ScannedChain", "forward", "sample_rngs"]
