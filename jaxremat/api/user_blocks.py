"""The user's blocks in a chain that cuts them finer: spans of stages that a hand strategy wraps
in one ``jax.checkpoint`` (:class:`~jaxremat.core.schedule.Block`), found from how the chain was
cut. Verification compiles every block checkpointed and every block under each policy among its
hand strategies (:mod:`~jaxremat.api.verify`), so that a plan is never worse than the user's own
``jax.checkpoint(block, policy)``.
"""

from __future__ import annotations

from typing import Sequence

from jaxremat.core.costs import ChainCosts
from jaxremat.model.chain import Chain
from jaxremat.model.cuts import Cuts

Span = tuple[int, int]


def by_period(costs: ChainCosts, k: int) -> list[Span]:
    """The user's blocks, as spans of stages, in a chain cut before each contraction (its first
    stage holds what precedes the first one) whose block is ``k`` stages. Which boundaries are
    the blocks' is not in the stages' identities (a transformer's mid-block residual stream
    repeats with the same period as its block input); it is read from the bytes that cross, one
    phase's boundaries against as many of another's from the second block on (the first
    block's boundary moves with the first stage), ties to the later phase. Then:

    * the first stage joins the first block (it holds the first block's layer norm, or the
      input's reshape before the first layer): checkpointed apart, it kept 3 MiB more of an NNX
      transformer than the user's first block (47.19 MiB against the hand strategy's 44.22),
      one activation more of a 12-layer MLP (26.25 against 25.25);
    * after the last whole block, all but the last stage (the head, the loss) are a last block
      cut shorter (an equinox transformer's last block is 4 of its 6 stages). So its hand
      ``dots_saveable`` (8.54 MiB) is matched at 8.48 MiB; from the mid-block phase, 9.67.

    Measured on the CPU, 2026-12-05 (update step of ``tests/outside_models.py``)."""
    L = costs.length
    n = min(len(range(p + k, L, k)) for p in range(k))  # as many boundaries of each phase
    phase = min(range(k), key=lambda p: (sum(int(costs.x[s]) for s in range(p + k, L, k)[:n]), -p))
    stops = list(range(phase + k, L + 1, k))
    if stops[0] == 1 and len(stops) > 1:
        stops = stops[1:]
    if k > 1 and L - 1 - stops[-1] >= 2:
        stops.append(L - 1)
    return list(zip([0] + stops, stops))


def by_scope(names: Sequence[str], depth: int) -> list[Span]:
    """Runs of stages in one module, for a chain cut at Flax module scopes ``depth`` deep: stages
    whose paths share their first ``depth - 1`` parts (``LinenCNN/ConvBlock_0/Conv_0`` and
    ``.../BatchNorm_0``) are one block; a stage whose path is shorter (a user's ``nn.remat`` block,
    one stage) is a block of its own. The last stage (the loss) is in none."""
    keys = []
    for name in names:
        parts = name.split(":", 1)[-1].split("/")
        keys.append("/".join(parts[: depth - 1]) if len(parts) >= depth else "/".join(parts))
    spans, start = [], 0
    for i in range(1, len(keys) + 1):
        if i == len(keys) or keys[i] != keys[start]:
            spans.append((start, i))
            start = i
    return [(b, e) for b, e in spans if e < len(keys)]


def user_blocks(chain: Chain, cuts: Cuts, costs: ChainCosts) -> list[Span]:
    """The user's blocks of ``chain``, cut from a function by ``cuts``: by module scope where the
    cuts follow Flax scopes, by the period of the stages' identities where they are cut before
    each contraction (:attr:`~jaxremat.model.chain.Chain.period`); none otherwise, or where every
    block would be one stage (every stage under a policy is among the hand strategies already),
    or where the chain holds a layer stack (its hand strategies are per layer, among its loops)."""
    if chain.stacked:
        return []
    if cuts.scope_depth is not None:
        spans = by_scope([s.name for s in chain.stages], cuts.scope_depth)
    elif cuts.at_contractions and chain.period < len(chain):
        spans = by_period(costs, chain.period)
    else:
        return []
    return spans if len(spans) > 1 and any(e - b > 1 for b, e in spans) else []


__all__ = ["Span", "by_period", "by_scope", "user_blocks"]
