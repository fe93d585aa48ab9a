"""The model's variables cut the way a :class:`~jaxremat.run.loop_plan.LoopPlan` runs them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
from jax import lax

from jaxremat.model.chain import Chain
from jaxremat.model.repeat import BODY
from jaxremat.run.loop_plan import LoopPlan, PatternLoop


@dataclass(frozen=True)
class Env:
    """What the stages of a loop iteration or a region read instead of the step's own:
    ``variables`` by stage, the ``offset`` of their copy index (iteration ``u`` of a loop over
    ``p`` stages runs copies ``u * p + ...``, whose keys are folded with that index), and
    ``keys`` by stage (a region's stages get their keys as inputs); ``at_input``: a region's
    stages start at the chain's input, whose cotangent is dead; ``alone``: a region of one stage
    (its stage runs :attr:`~jaxremat.model.stage.Stage.unwrapped` where it has one); ``looped``: the
    body of a loop's iteration."""

    variables: dict[int, Any]
    offset: Any = 0
    keys: dict[int, Any] | None = None
    at_input: bool = False
    alone: bool = False
    looped: bool = False


@dataclass(frozen=True)
class Cut:
    """``per_stage``: each stage's variables, for stages that run on their own; ``pieces``: by
    first stage, the stacked variables a loop or a stacked run scans over."""

    per_stage: dict[int, Any]
    pieces: dict[int, Any]


def unstack(tree: Any, k: int) -> list[Any]:
    """``k`` trees from one with leading axis ``k`` (one ``lax.split`` per leaf)."""
    leaves, treedef = jax.tree.flatten(tree)
    cut = [lax.split(t, [1] * k, axis=0) for t in leaves]
    return [treedef.unflatten([c[q].reshape(c[q].shape[1:]) for c in cut]) for q in range(k)]


def positions(tree: Any, n: int, k: int) -> list[Any]:
    """A tree with leading axis ``n * k`` (``n`` units of ``k`` stages) as ``k`` trees, one per
    position in the unit, each with leading axis ``n``."""
    if k == 1:
        return [tree]
    leaves, treedef = jax.tree.flatten(tree)
    cut = [lax.split(t.reshape(n, k, *t.shape[1:]), [1] * k, axis=1) for t in leaves]
    return [treedef.unflatten([c[p].reshape(n, *c[p].shape[2:]) for c in cut]) for p in range(k)]


def cut_variables(chain: Chain, variables: Any, plan: LoopPlan) -> Cut:
    """Per-stage variables, and each loop's or stacked run's stacked variables. A looped Repeat's
    stack is reshaped (no copy); any other Repeat's stack is cut once (``lax.split``, whose
    gradient is one concatenate) into its runs and single stages."""
    per_stage: dict[int, Any] = {}
    pieces: dict[int, Any] = {}
    for (first, g), v in zip(chain.layers, chain.layer_variables(variables)):
        if g is None:
            per_stage[first] = v
            continue
        loop = plan.loops.get(g.start)
        if loop is not None:  # a reshape: no copy
            n, p = (loop.repeats, loop.period) if isinstance(loop, PatternLoop) else (loop.length, 1)
            shape = (n,) if p == 1 else (n, p)
            pieces[g.start] = {
                col: jax.tree.map(lambda t: t.reshape(*shape, *t.shape[1:]), tree[BODY]) for col, tree in v.items()
            }
            continue
        spans, i = [], g.start
        while i < g.start + g.length:
            run = plan.stacked_runs.get(i)
            n, k = (run.count, run.stages) if run is not None else (1, 1)
            spans.append((i, n, k))
            i += n * k
        sizes = [n * k for _, n, k in spans]

        def parts(t: jax.Array, sizes: list = sizes) -> list:
            return [t] if len(sizes) == 1 else list(lax.split(t, sizes, axis=0))

        split = {col: jax.tree.map(parts, tree[BODY]) for col, tree in v.items()}
        for q, (i, n, k) in enumerate(spans):
            piece = {
                col: jax.tree.map(lambda ps: ps[q], tree, is_leaf=lambda x: isinstance(x, list))
                for col, tree in split.items()
            }
            if i in plan.stacked_runs:
                pieces[i] = positions(piece, n, k)
            else:
                per_stage[i] = jax.tree.map(lambda t: t.reshape(t.shape[1:]), piece)
    return Cut(per_stage, pieces)


__all__ = ["Cut", "Env", "cut_variables", "positions", "unstack"]
