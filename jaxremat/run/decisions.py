"""What a schedule decides for each stage, computed once before anything is traced: the checkpoint
policy of each store option used, the buffers kept in host memory, which stages tie their
parameter gradient or read their input through a barrier, where a region hands its input's
cotangent over directly, and the user's blocks. The walker (:mod:`~jaxremat.run._walk`) reads
it; it decides nothing itself."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from jaxremat.core.policies import Policy, resolve
from jaxremat.core.schedule import Block, Schedule
from jaxremat.core.tree import StoreUnit, units
from jaxremat.model.chain import Chain


@dataclass(frozen=True)
class StageRun:
    """How one stored stage runs (:meth:`Decisions.stage`)."""

    policy: Policy | None  # the checkpoint policy of its store option; None: every residual kept
    host_bundle: bool  # its residuals kept in host memory
    host_input: bool  # its input kept in host memory
    tied: bool  # its parameter gradient tied to its input's cotangent (run._grad_tie)
    sealed: bool  # its input read through an optimisation barrier


@dataclass(frozen=True)
class Decisions:
    """A schedule's decisions (:func:`decide`).

    ``tie_policies``: whether top-level stages under a policy tie their gradients too. A plan that
    stores every top-level stage (but the first, never tied) under a policy is the hand-written
    strategy's step, and its stages stay as ``jax.checkpoint`` makes them: untied, each
    convolution under a policy keeps a copy of its kernel from the step's start to its backward
    (the conv autoencoder's plan that recomputes three stages and stores seven under policies
    was predicted 15.38 MiB and used 15.79 untied, 15.38 tied), but where every stage is under
    ``dots_saveable`` the tie trades those copies for transposed activations in the backward (a
    ResNet's used 14.79 MiB tied where the strategy's used 14.67; CPU, 2026-12-04).

    ``sealed``: top-level stages stored whole right after one under a policy, which read their
    input through a barrier, as made. A stage's output is often element-wise in buffers of its
    own (a residual block's ``relu(x + h)``), and XLA fuses it into every reader instead of
    making it; under a policy the previous stage's bundle holds copies of the saved buffers, so
    the fused reads keep the originals alive too (a ResNet's plan alternating blocks stored
    whole and under ``dots_saveable``: predicted 20.80 MiB, used 22.27, 20.56 sealed). Between
    stages stored whole the fusion saves memory (6 small residual blocks stored whole: 4.18 MiB,
    4.78 sealed), so only there.
    """

    policies: Mapping[tuple[int, int], Policy]  # (stage, store option) -> its checkpoint policy
    offloaded: frozenset[tuple[str, int]]  # ("a", i) / ("abar", i): buffers kept in host memory
    reuses: frozenset[int]  # stages whose FB writes over the incoming cotangent (ChainCosts.fb_reuse)
    tie_policies: bool
    sealed: frozenset[int]
    blocks: Mapping[int, tuple[Block, Policy]] = field(default_factory=dict)  # first stage -> block, policy

    def stage(self, i: int, option: int, top: bool, outermost: bool) -> StageRun:
        """How stage ``i`` runs stored under ``option``: ``top``, stored at the top level (not in a
        loop); ``outermost``, not inside a region (whose own barrier ties its gradients)."""
        return StageRun(
            policy=self.policies[(i, option)] if option else None,
            host_bundle=top and ("abar", i) in self.offloaded,
            host_input=top and ("a", i) in self.offloaded,
            tied=outermost and i > 0 and (not option or self.tie_policies),
            sealed=top and i in self.sealed,
        )


def decide(
    chain: Chain, schedule: Schedule, tree: Any, offloaded: frozenset, policies: Mapping[str, Policy] | None
) -> Decisions:
    """The :class:`Decisions` of ``schedule`` (its op tree ``tree`` and offloaded buffers, as
    :func:`~jaxremat.core.tree.parse_offloads` reads them) on ``chain``; ``policies`` name the
    store options' policies that are not built in."""
    L = len(chain)
    spine, leaf = units(tree)
    used = {(op.stage, op.option) for op in schedule.ops if op.option}
    resolved = {
        (i, k): resolve(schedule.costs.option(i, k).name, policies, f"stage {i} ({chain.stages[i].name}), option {k},")
        for i, k in sorted(used)
    }
    # stages whose FB writes over the incoming cotangent: the region after one hands it over directly
    reuses = frozenset(int(i) for i in np.flatnonzero(schedule.costs.fb_reuse))
    under_policy = lambda stage, option: option > 0 or stage == 0  # noqa: E731
    tie_policies = not (
        all(isinstance(u, StoreUnit) and under_policy(u.stage, u.option) for u in spine)
        and (leaf.stage == L or (under_policy(leaf.stage, leaf.option) and not leaf.fused))
    )
    sealed = frozenset(
        u.stage
        for t, u in zip(spine, spine[1:])
        if isinstance(t, StoreUnit) and t.option and isinstance(u, StoreUnit) and not u.option
    )
    blocks = {}
    top_stored = {u.stage for u in spine if isinstance(u, StoreUnit)}
    for b in schedule.blocks:
        if not top_stored.issuperset(range(b.start, b.stop)) or chain.group_of(b.start) is not None:
            raise ValueError(f"{b}: a block runs stages stored at the top level, outside a Repeat")
        blocks[b.start] = (b, resolve(b.policy, policies, f"stages {b.start}-{b.stop - 1} (a block),"))
    return Decisions(resolved, offloaded, reuses, tie_policies, sealed, blocks)


__all__ = ["Decisions", "StageRun", "decide"]
