"""The walk over a schedule tree that runs its stages: stored stages plainly, regions as tied
checkpoints, loops and stacked runs by their scans."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxremat.core.compile import warn_unless_planned
from jaxremat.core.policies import Policy
from jaxremat.core.schedule import Block
from jaxremat.core.tree import Node, RegionUnit, StoreUnit, Unit, offloads_in, units
from jaxremat.model.chain import Chain
from jaxremat.model.stage import Rngs, stage_rngs
from jaxremat.run._grad_tie import tied_gradients
from jaxremat.run._offload import offloaded_stage
from jaxremat.run._regions import Enters, Leaves, mark_of, tap, tied_checkpoint
from jaxremat.run._scans import run_offload_loop, run_selective, scan_units
from jaxremat.run._variables import Cut, Env, unstack
from jaxremat.run.decisions import Decisions
from jaxremat.run.loop_plan import Alike, LoopPlan, OffloadLoop, PatternLoop, SelectiveLoop, Stretch


@dataclass(frozen=True)
class Tokens:
    """What orders a region's body against its region's backward
    (:func:`~jaxremat.run._regions.tied_checkpoint`): ``first``, the region's token for its body's
    first region, where the region hands its input's cotangent over directly
    (:attr:`~jaxremat.run._regions.Leaves.HANDED`); ``tapped``, a stage and the token tapped into
    its input (:attr:`~jaxremat.run._regions.Leaves.TAPPED`); ``marks``, which gets one element of
    the last stage's input where units run before it (the region's ``mark``)."""

    first: Any = None
    tapped: tuple[int, Any] | None = None
    marks: list | None = None


@dataclass(frozen=True)
class Handover:
    """A region's part in a direct hand-over (:meth:`Walker.handovers`): ``token``, the one the
    region before it returned, where this region hands its input's cotangent over directly;
    ``waits``, whether the region after this one does (its cotangent then enters after that
    region's token)."""

    token: Any = None
    waits: bool = False


class Walker:
    """Runs one call's stages: ``cut`` holds its variables as the ``loops`` plan runs them.

    ``scan=True`` also stacks the variables of runs of alike separate stages (a copy inside the
    step); ``None`` and ``False`` do not.
    """

    def __init__(
        self,
        chain: Chain,
        rngs: Rngs,
        cut: Cut,
        loops: LoopPlan,
        alike: Alike,
        scan: bool | None,
        decided: Decisions,
    ):
        self.chain, self.rngs, self.cut, self.loops, self.alike, self.scan = chain, rngs, cut, loops, alike, scan
        self.decided = decided  # what the schedule decided for each stage (run.decisions)
        self.offloaded = decided.offloaded
        self.L = len(chain)

    # -- one stage, one unit ---------------------------------------------------------------------

    def variables(self, i: int, env: Env | None) -> Any:
        return env.variables.get(i, self.cut.per_stage.get(i)) if env is not None else self.cut.per_stage[i]

    def keys(self, i: int, env: Env | None) -> Rngs:
        if env is not None and env.keys and i in env.keys:
            return env.keys[i]
        return stage_rngs(self.rngs, i + (env.offset if env is not None else 0))

    def stage(self, i: int, a: Any, updates: dict, env: Env | None, option: int = 0, top: bool = False) -> Any:
        """Stage ``i`` stored under ``option``, as :meth:`Decisions.stage
        <jaxremat.run.decisions.Decisions.stage>` says: 0 keeps every residual, another runs the
        stage under ``jax.checkpoint`` with the option's policy (its backward recomputes the rest);
        its bundle or input in host memory where the schedule offloads them; its parameter
        gradient tied to its input's cotangent (:func:`~jaxremat.run._grad_tie.tied_gradients`: no
        copies of donated kernels; inside a region, the region's own barrier does); its input
        through a barrier where sealed. Recomputed alone in a region, a stage holding the user's
        own checkpoint runs its body (:attr:`~jaxremat.model.stage.Stage.unwrapped`)."""
        stage = self.chain.stages[i]
        how = self.decided.stage(i, option, top, outermost=env is None)
        apply = stage.unwrapped if env is not None and env.alone and stage.unwrapped else stage.apply
        if how.policy is not None:
            # inside a loop's iteration no barrier is needed against CSE (the backward loop is
            # another loop), and one kept a copy of the iteration's parameter slice: every layer
            # of a scanned decoder under dots_saveable used 0.75 MiB (one layer's parameters)
            # more than the user's nn.scan(nn.remat(layer, policy)) (CPU, 2026-12-06)
            looped = env is not None and env.looped
            apply = jax.checkpoint(apply, policy=how.policy, prevent_cse=not looped)
        if how.host_bundle or how.host_input:
            moved = offloaded_stage(apply, bundle=how.host_bundle, inputs=how.host_input)
            apply = lambda v, a, keys: moved(v, keys, a)  # noqa: E731
        if how.tied:  # outermost: an offloaded stage's residuals are those of its own vjp
            apply = tied_gradients(apply)
        if how.sealed:
            a = lax.optimization_barrier(a)
        out, new = apply(self.variables(i, env), a, self.keys(i, env))
        if new:
            updates[i] = new
        return out

    def block(self, block: Block, policy: Policy, a: Any, updates: dict) -> Any:
        """The stages of ``block`` as one ``jax.checkpoint`` under ``policy``, as the user's
        ``jax.checkpoint(block, policy)`` runs them: untied (:meth:`stage`), the stages'
        boundaries inside recomputed unless the policy saves them."""
        span = range(block.start, block.stop)

        def apply(owned: dict, a: Any, keys: dict) -> tuple[Any, dict]:
            new = {}
            for i in span:
                a, n = self.chain.stages[i].apply(owned[i], a, keys[i])
                if n:
                    new[i] = n
            return a, new

        out, new = jax.checkpoint(apply, policy=policy)(
            {i: self.variables(i, None) for i in span}, a, {i: self.keys(i, None) for i in span}
        )
        updates.update(new)
        return out

    def unit(
        self, unit: Unit, a: Any, updates: dict, env: Env | None, handover: Handover = Handover()
    ) -> tuple[Any, Any]:
        """Run ``unit``; returns its output and, for a region, the order token of the region that
        runs right after it (:func:`~jaxremat.run._regions.tied_checkpoint`)."""
        if isinstance(unit, StoreUnit):
            return self.stage(unit.stage, a, updates, env, unit.option, top=env is None), None
        # everything the region reads is an explicit input (no closure over traced values), so
        # that its recomputation can run in the backward pass, after the cotangent arrives
        span = range(unit.start, unit.stop)
        owned = {i: self.variables(i, env) for i in span}
        owned_keys = {i: self.keys(i, env) for i in span}

        at_input = unit.start == 0 and (env is None or env.at_input)
        tap_at = last_read(unit.inner) if at_input else None
        inner = {j for u in units(unit.inner)[0] if isinstance(u, RegionUnit) for j in range(u.start, u.stop)}

        def body(owned: dict, owned_keys: dict, a: Any, first: Any, tapped: Any) -> tuple[Any, dict, Any]:
            local: dict = {}
            tokens = Tokens(
                first,
                None if tapped is None else (tap_at, tapped),
                [] if inner else None,  # the mark orders an inner region's kernel reads
            )
            env = Env(owned, 0, owned_keys, at_input, alone=unit.stop - unit.start == 1)
            out = self.run(unit.inner, unit.stop, a, local, env, tokens)
            return out, local, tokens.marks[0] if tokens.marks else None

        warn_unless_planned(stacklevel=7)
        offload = env is None and ("a", unit.start) in self.offloaded
        # a region at the chain's input has no region before it to be handed a token by (nor has
        # the first region inside it: its outer region is at the input too)
        token = handover.token
        assert token is None or tap_at is None, "a region at the chain's input was handed a cotangent"
        region = tied_checkpoint(
            body,
            enters=Enters.BARRIER if unit.stop >= self.L else Enters.AFTER_NEXT if handover.waits else Enters.DIRECT,
            leaves=Leaves.HANDED if token is not None else Leaves.TAPPED if tap_at is not None else Leaves.TOGETHER,
            offload=offload,
            inner=inner,
            stages=unit.stop - unit.start,
        )
        a, local, token = region(owned, owned_keys, a, token)
        updates.update(local)
        return a, token

    def handovers(self, run: tuple[Unit, ...]) -> list[bool]:
        """Per unit of ``run`` (units run one after another), whether it is a region that hands its
        input's cotangent to a region right before it directly, ordered by a token instead: where
        the stage before it writes over that cotangent in its FB (``ChainCosts.fb_reuse``)."""
        region = [isinstance(u, RegionUnit) for u in run]
        reuses = self.decided.reuses
        return [j > 0 and region[j] and region[j - 1] and run[j].start - 1 in reuses for j in range(len(run))]

    def in_turn(
        self,
        run: tuple[Unit, ...],
        a: Any,
        updates: dict,
        env: Env | None,
        tokens: Tokens = Tokens(),
    ) -> Any:
        """The units of ``run`` one after another, in a region's body as its ``tokens`` say: a
        region starting the body hands its input's cotangent over directly where the body's
        region does (the cotangent leaves through it)."""
        handed = self.handovers(run)
        if tokens.first is not None and run and isinstance(run[0], RegionUnit):
            handed[0] = True
        token, until, tapped = tokens.first, 0, tokens.tapped
        for j, unit in enumerate(run):
            if unit.start < until:  # inside a block that has run
                continue
            if tapped is not None and unit.start == tapped[0]:
                a = tap(a, tapped[1])
            if env is None and unit.start in self.decided.blocks:
                block, policy = self.decided.blocks[unit.start]
                a, token, until = self.block(block, policy, a, updates), None, block.stop
                continue
            handover = Handover(token if handed[j] else None, waits=j + 1 < len(run) and handed[j + 1])
            a, token = self.unit(unit, a, updates, env, handover)
        return a

    # -- trees -------------------------------------------------------------------------------------

    def run(
        self,
        node: Node,
        stop: int,
        a: Any,
        updates: dict,
        env: Env | None = None,
        tokens: Tokens = Tokens(),
    ) -> Any:
        """Apply the stages of ``node`` below ``stop`` (the loss is not a stage). Loops only at
        the top level (``env is None``); inside a region its variables are explicit inputs and
        ``tokens`` order it (:class:`Tokens`)."""
        spine, leaf = units(node)
        if env is None:
            a = self.top(a, updates)
        else:
            a = self.in_turn(spine, a, updates, env, tokens)
        if tokens.tapped is not None and leaf.stage == tokens.tapped[0]:
            a = tap(a, tokens.tapped[1])
        if tokens.marks is not None and spine:
            tokens.marks.append(mark_of(a))
        if leaf.stage < min(self.L, stop):  # FB or Fall; B: the stage's forward right before its backward
            a = self.stage(leaf.stage, a, updates, env, leaf.option)
        return a

    def top(self, a: Any, updates: dict) -> Any:
        """The top-level units, segment by segment."""
        for seg in self.loops.segments:
            if isinstance(seg, SelectiveLoop):
                warn_unless_planned(stacklevel=5)
                a = run_selective(
                    self.chain.stages[seg.start],
                    seg.start,
                    seg.stored,
                    a,
                    updates,
                    self.cut.pieces[seg.start],
                    self.rngs,
                )
            elif isinstance(seg, OffloadLoop):
                warn_unless_planned(stacklevel=5)
                a = run_offload_loop(
                    self.chain.stages[seg.start],
                    seg.start,
                    seg.kinds,
                    a,
                    updates,
                    self.cut.pieces[seg.start],
                    self.rngs,
                    self.decided.policies,
                )
            elif isinstance(seg, PatternLoop):
                a = self.pattern_loop(seg, a, updates)
            else:
                a = self.stretch(seg, a, updates)
        return a

    def pattern_loop(self, loop: PatternLoop, a: Any, updates: dict) -> Any:
        """``loop.repeats`` repeats of its pattern as one scan over the Repeat's variables
        reshaped to ``(n, p, ...)`` (``(n, ...)`` when ``p == 1``)."""
        p = loop.period
        views = (lambda P: [P]) if p == 1 else (lambda P: unstack(P, p))
        return scan_units(
            self.apply_all(loop.pattern),
            loop.start,
            p,
            loop.repeats,
            a,
            updates,
            self.cut.pieces[loop.start],
            views,
            cut_in_checkpoint=p > 1,
        )

    def stretch(self, stretch: Stretch, a: Any, updates: dict) -> Any:
        """Units between loops: runs of alike units over a Repeat's stacked variables (and with
        ``scan=True`` over separate stages) as one scan, the others in turn."""
        run_units, pending = stretch.units, 0  # run_units[pending:i] wait to run in turn
        for i, j in self.alike.runs(run_units):
            first = run_units[i]
            if first.start in self.loops.stacked_runs:
                stacked = self.cut.pieces[first.start]
            elif (
                self.scan
                and j - i >= 2
                and not self.moves(run_units[i:j])
                and self.keeps_shape(
                    first, jax.eval_shape(lambda a: self.in_turn(run_units[pending:i], a, {}, None), a)
                )
            ):
                stacked = self.stack(run_units[i:j])
            else:
                continue
            # the units before this scan in turn, together: a region among them may hand its input's
            # cotangent over directly to the one before it (handovers)
            a = self.in_turn(run_units[pending:i], a, updates, None)
            a = scan_units(
                self.apply_all((first,)),
                first.start,
                first.stop - first.start,
                j - i,
                a,
                updates,
                stacked,
                lambda P: P,
                cut_in_checkpoint=False,
            )
            pending = j
        return self.in_turn(run_units[pending:], a, updates, None)

    def moves(self, run: tuple[Unit, ...]) -> bool:
        """Whether the schedule offloads anything of ``run``'s units (they then run one by one)."""
        return any(offloads_in(self.offloaded, u.start, u.stop) for u in run)

    def apply_all(self, pattern: tuple[Unit, ...]):
        def apply(env: Env, a: Any, local: dict) -> Any:
            return self.in_turn(pattern, a, local, env)

        return apply

    # -- scan=True: stacking separate stages -------------------------------------------------------

    def keeps_shape(self, unit: Unit, a: Any) -> bool:
        out = jax.eval_shape(lambda a: self.unit(unit, a, {}, None)[0], a)
        same = lambda x, y: np.shape(x) == np.shape(y) and x.dtype == y.dtype  # noqa: E731
        return jax.tree.structure(out) == jax.tree.structure(a) and all(
            same(x, y) for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(a))
        )

    def stack(self, run: tuple[Unit, ...]) -> list[Any]:
        """The variables of ``run``'s units, per position in the unit stacked over the units (a copy)."""
        k = run[0].stop - run[0].start
        return [
            jax.tree.map(lambda *xs: jnp.stack(xs), *[self.cut.per_stage[u.start + p] for u in run]) for p in range(k)
        ]


def last_read(inner: Node) -> int | None:
    """The first stage after the chain's first that a region recomputing as ``inner`` (from the
    chain's input) owns, not a region inside it: its backward makes the last of the region's
    reads of its kernels for input gradients (the first stage's input gradient is dead).
    ``None`` where the region owns no such stage."""
    spine, leaf = units(inner)
    own = [u.stage for u in spine if isinstance(u, StoreUnit)] + [leaf.stage]
    return min((i for i in own if i > 0), default=None)


__all__ = ["Walker"]
