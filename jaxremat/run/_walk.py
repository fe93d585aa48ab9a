"""The walk over a schedule tree that runs its stages: stored stages plainly, regions as tied
checkpoints, loops and stacked runs by their scans."""

from __future__ import annotations

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
from jaxremat.run._regions import mark_of, tap, tied_checkpoint
from jaxremat.run._scans import run_offload_loop, run_selective, scan_units
from jaxremat.run._variables import Cut, Env, unstack
from jaxremat.run.loop_plan import Alike, LoopPlan, OffloadLoop, PatternLoop, SelectiveLoop, Stretch


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
        policies: dict[tuple[int, int], Policy],
        offloaded: frozenset[tuple[str, int]] = frozenset(),
        reuses: frozenset[int] = frozenset(),
        tie_policies: bool = True,
        sealed: frozenset[int] = frozenset(),
        blocks: dict[int, tuple[Block, Policy]] | None = None,
    ):
        self.chain, self.rngs, self.cut, self.loops, self.alike, self.scan = chain, rngs, cut, loops, alike, scan
        self.tie_policies = tie_policies  # whether top-level stages under a policy tie too (see stage)
        self.sealed = sealed  # top-level stages whose input passes a barrier (see stage)
        self.policies = policies  # (stage, store option) -> the checkpoint policy it runs under
        self.offloaded = offloaded  # ("a", i) / ("abar", i): buffers kept in host memory
        self.reuses = reuses  # stages whose FB writes over the incoming cotangent (ChainCosts.fb_reuse)
        self.blocks = blocks or {}  # first stage -> a block of top-level stored stages and its policy
        self.L = len(chain)

    # -- one stage, one unit ---------------------------------------------------------------------

    def variables(self, i: int, env: Env | None) -> Any:
        return env.variables.get(i, self.cut.per_stage.get(i)) if env is not None else self.cut.per_stage[i]

    def keys(self, i: int, env: Env | None) -> Rngs:
        if env is not None and env.keys and i in env.keys:
            return env.keys[i]
        return stage_rngs(self.rngs, i + (env.offset if env is not None else 0))

    def stage(self, i: int, a: Any, updates: dict, env: Env | None, option: int = 0, top: bool = False) -> Any:
        """Stage ``i`` stored under ``option``: 0 keeps every residual, another runs the stage
        under ``jax.checkpoint`` with the option's policy (its backward recomputes the rest).
        A top-level stage whose bundle or input the schedule offloads keeps them in host memory.
        A top-level stage after the first ties its parameter gradient to its input's cotangent
        (:func:`~jaxremat.run._grad_tie.tied_gradients`: no copies of donated kernels); inside a
        region, the region's own barrier does.

        A stage under a policy ties too, unless ``tie_policies`` is false: the plan stores every
        top-level stage under a policy, recomputes nothing, and then compiles to the hand-written
        strategy's step (measured on the CPU, 2026-12-04, update step). Untied, each convolution
        under a policy keeps a copy of its kernel from the step's start to its backward: the conv
        autoencoder's plan that recomputes three stages and stores seven under policies was
        predicted 15.38 MiB and used 15.79 untied, 15.38 tied. But where every stage is under
        ``dots_saveable``, the tie trades those copies for transposed activations in the
        backward: a ResNet's used 14.79 MiB tied where the strategy's used 14.67 (untied: the
        same 14.67), a 12-block GPT's 47.768 against 47.766.

        A top-level stage in ``sealed`` (stored whole, right after a stage under a policy) reads
        its input through an optimisation barrier, as made. A stage's output is often
        element-wise in buffers of its own (a residual block's ``relu(x + h)``), and XLA fuses it
        into every reader instead of making it. Where the previous stage is stored whole, those
        buffers are in its bundle anyway; under a policy, its bundle holds copies of the saved
        ones, so the fused reads in this stage's backward keep the originals alive: a ResNet's
        plan alternating blocks stored whole and under ``dots_saveable`` was predicted 20.80 MiB
        and used 22.27, 20.56 sealed. Not everywhere: between stages stored whole, the fusion
        saves memory (a store-all step of 6 small residual blocks used 4.18 MiB, 4.78 sealed)."""
        stage = self.chain.stages[i]
        # recomputed alone: the user's own checkpoint inside would only run its forward again
        apply = stage.unwrapped if env is not None and env.alone and stage.unwrapped else stage.apply
        if option:
            apply = jax.checkpoint(apply, policy=self.policies[(i, option)])
        bundle, inputs = top and ("abar", i) in self.offloaded, top and ("a", i) in self.offloaded
        if bundle or inputs:
            moved = offloaded_stage(apply, bundle=bundle, inputs=inputs)
            apply = lambda v, a, keys: moved(v, keys, a)  # noqa: E731
        # outermost: an offloaded stage's residuals are those of its own vjp
        if env is None and i > 0 and (not option or self.tie_policies):
            apply = tied_gradients(apply)
        if top and i in self.sealed:
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
        self, unit: Unit, a: Any, updates: dict, env: Env | None, token: Any = None, waits: bool = False
    ) -> tuple[Any, Any]:
        """Run ``unit``; returns its output and, for a region, the order token of the region that
        runs right after it (:func:`~jaxremat.run._regions.tied_checkpoint`). ``token``: the one
        the region before returned, where this region hands its input's cotangent over directly
        (:meth:`handovers`); ``waits``: the region after this one does."""
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

        def body(owned: dict, owned_keys: dict, a: Any, first: Any, token: Any) -> tuple[Any, dict, Any]:
            local: dict = {}
            tapped = None if token is None else (tap_at, token)
            marks: list | None = [] if inner else None  # the mark orders an inner region's kernel reads
            out = self.run(
                unit.inner,
                unit.stop,
                a,
                local,
                Env(owned, 0, owned_keys, at_input, alone=unit.stop - unit.start == 1),
                first,
                tapped,
                marks,
            )
            return out, local, marks[0] if marks else None

        warn_unless_planned(stacklevel=7)
        offload = env is None and ("a", unit.start) in self.offloaded
        region = tied_checkpoint(
            body,
            offload=offload,
            inner=inner,
            direct_cotangent=unit.stop < self.L,
            ordered=token is not None,
            waits=waits,
            tapped=tap_at is not None,
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
        return [j > 0 and region[j] and region[j - 1] and run[j].start - 1 in self.reuses for j in range(len(run))]

    def in_turn(
        self,
        run: tuple[Unit, ...],
        a: Any,
        updates: dict,
        env: Env | None,
        first: Any = None,
        tapped: tuple[int, Any] | None = None,
    ) -> Any:
        """The units of ``run`` one after another. ``first``: the token of a region whose body
        ``run`` is, where that region hands its input's cotangent over directly: a region
        starting the body does too (the cotangent leaves through it). ``tapped``: a stage and
        the token tapped into its input (:func:`~jaxremat.run._regions.tap`)."""
        handed = self.handovers(run)
        if first is not None and run and isinstance(run[0], RegionUnit):
            handed[0] = True
        token, until = first, 0
        for j, unit in enumerate(run):
            if unit.start < until:  # inside a block that has run
                continue
            if tapped is not None and unit.start == tapped[0]:
                a = tap(a, tapped[1])
            if env is None and unit.start in self.blocks:
                block, policy = self.blocks[unit.start]
                a, token, until = self.block(block, policy, a, updates), None, block.stop
                continue
            a, token = self.unit(
                unit, a, updates, env, token if handed[j] else None, waits=j + 1 < len(run) and handed[j + 1]
            )
        return a

    # -- trees -------------------------------------------------------------------------------------

    def run(
        self,
        node: Node,
        stop: int,
        a: Any,
        updates: dict,
        env: Env | None = None,
        first: Any = None,
        tapped: tuple[int, Any] | None = None,
        marks: list | None = None,
    ) -> Any:
        """Apply the stages of ``node`` below ``stop`` (the loss is not a stage). Loops only at
        the top level (``env is None``); inside a region its variables are explicit inputs.
        ``first`` and ``tapped``: as for :meth:`in_turn`; ``marks``: gets one element of the
        last stage's input where units run before it (:func:`~jaxremat.run._regions.mark_of`)."""
        spine, leaf = units(node)
        if env is None:
            a = self.top(a, updates)
        else:
            a = self.in_turn(spine, a, updates, env, first, tapped)
        if tapped is not None and leaf.stage == tapped[0]:
            a = tap(a, tapped[1])
        if marks is not None and spine:
            marks.append(mark_of(a))
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
                    self.policies,
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
