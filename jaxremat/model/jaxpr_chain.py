"""A chain cut out of any JAX function's jaxpr: what :func:`jaxremat.remat` plans.

``fun`` is traced once per input signature to a jaxpr; its equations are cut into stages
(:func:`find_cuts`: by Flax module scope, by ``checkpoint_name`` markers, or before the
contractions where the fewest bytes cross), and each stage becomes a function that evaluates its
equations (:class:`JaxprChain`), so the profiler, the solvers and the executor apply unchanged.

What a stage reads:

* ``params``: the inputs of ``fun`` it reads that can carry a gradient (inexact dtypes). A
  parameter read by several stages (tied weights) is given to each; autodiff adds the pieces.
* constants: values computed from literals alone (a dropout's ``zeros_like``, an ``iota``, a
  causal mask from one) are not a stage's: :meth:`JaxprChain.of` takes their equations out
  before the cuts, and every stage that reads one computes it again, as XLA fuses a broadcast
  into each reader. Held as a value (a constant of the jaxpr, or the context below), each is a
  buffer from the step's start to its end: a linen CNN's four dropout ``zeros_like`` kept
  1.5 MiB more than the user's own step (CPU, 2026-12-05).
* ``context``: values that carry no gradient (integer inputs, ``fun``'s constants, and values
  computed from those alone, such as a causal mask or positions). A context value made in one
  stage and read by a later one is computed once, before the chain, and held for the whole step
  (counted once, in the plan's ``x[0]``), not passed from stage to stage as an activation.
* its activation ``a_k``: every value that can carry a gradient, made by an earlier stage and
  read by this stage or a later one (a tuple, in the order the values were made). A value read
  by a stage past the next one (a U-Net's skip tensor) is part of each ``a_k`` it crosses, passed
  through unchanged: one buffer, which the plan counts once however many of those activations
  are live (:meth:`JaxprChain.shared_values`, ``ChainCosts.shared``).

An equation with sub-jaxprs (``pjit``, ``custom_jvp_call``, ``custom_vjp_call``, ``cond``,
``scan``, ``while``) is never cut: a user's ``jax.checkpoint`` / ``nn.remat`` block is a stage
of its own, kept as written, and a loop is one stage, except a layer stack (a ``scan`` over
stacked layers: ``nn.scan``, ``nnx.scan``, ``lax.scan``; :mod:`~jaxremat.model.layer_stacks`),
which is a stage per layer, stacked as a :class:`~jaxremat.Repeat`'s copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import jax

from jaxremat.model.chain import Chain, Stacked
from jaxremat.model.cuts import (  # noqa: F401 - find_cuts, crossing_bytes: part of this module's API
    runs_loop,
    MAX_STAGES,
    REMAT_PRIMITIVES,
    Cuts,
    _inexact,
    _is_var,
    _nbytes,
    crossing_bytes,
    find_cuts,
)
from jaxremat.model.identity import function_key
from jaxremat.model.jaxpr_eval import evaluate, read, stage_digest, trace
from jaxremat.model.layer_stacks import LayerStack, find_stacks, holds_remat, no_gradient
from jaxremat.model.repeat import BODY
from jaxremat.model.stage import Stage

#: What ``jaxremat.remat(..., user_remat=)`` does with the user's own ``jax.checkpoint`` /
#: ``nn.remat`` around a scanned layer: ``"replace"`` (the default) plans each layer of the stack
#: as if it were not there (the plan decides what each layer keeps); ``"keep"`` keeps it as
#: written: the scan is one stage holding a loop, stored (each layer under the user's policy) or
#: recomputed as a whole, and the plan decides around it.
USER_REMAT = ("replace", "keep")

# -- the chain -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StagePlan:
    """What stage ``k`` reads and makes (indices into ``fun``'s flat inputs, and jaxpr vars)."""

    eqns: tuple
    params: tuple[int, ...]  # flat inputs carrying a gradient
    inputs: tuple[int, ...]  # flat inputs carrying none
    context: tuple  # vars made by the prologue (no gradient), held for the step
    acts_in: tuple  # the activation a_k
    outs: tuple  # a_{k+1}, or the function's outputs for the last stage


class JaxprChain:
    """A traced function cut into a :class:`~jaxremat.Chain` of stages."""

    #: the layer stacks kept as one stage for the user's remat inside (``user_remat="keep"``)
    kept_remat: tuple[LayerStack, ...] = ()

    def __init__(
        self,
        closed: Any,
        cuts: Cuts,
        constants: Sequence[Any] = (),
        stacks: Mapping[int, LayerStack] | None = None,
        differentiated: int | None = None,
    ):
        """``closed`` cut by ``cuts`` (bounds into its equations); ``constants``: equations of
        literals alone taken out of it (:func:`split_constants`), recomputed by each stage that
        reads them; ``stacks``: layer stacks by equation index, each a stage of ``cuts``
        (:func:`~jaxremat.model.cuts.isolate`), which become a stage per layer; ``differentiated``:
        how many of the function's leading flat inputs the training step differentiates (the
        first argument's), the others profiled without their gradient (``None``: all)."""
        self.closed, self.cuts, self.constants = closed, cuts, tuple(constants)
        self.differentiated = differentiated
        jaxpr = closed.jaxpr
        eqns = jaxpr.eqns
        free = {v for e in self.constants for v in e.outvars if _is_var(v)}
        self.invars = list(jaxpr.invars)
        pos = {v: n for n, v in enumerate(self.invars)}
        consts = dict(zip(jaxpr.constvars, closed.consts))
        self.consts = consts
        stage_of: dict[Any, int] = {}
        for k in range(cuts.count):
            for e in eqns[cuts.bounds[k] : cuts.bounds[k + 1]]:
                for v in e.outvars:
                    if _is_var(v):
                        stage_of[v] = k
        nograd = self.nograd = no_gradient(jaxpr, free)
        used_by: dict[Any, set[int]] = {}
        for k in range(cuts.count):
            for e in eqns[cuts.bounds[k] : cuts.bounds[k + 1]]:
                for v in e.invars:
                    if _is_var(v):
                        used_by.setdefault(v, set()).add(k)
        L = cuts.count
        outs = [v for v in jaxpr.outvars if _is_var(v)]
        for v in outs:
            used_by.setdefault(v, set()).add(L - 1)
        made = [v for e in eqns for v in e.outvars if _is_var(v)]
        stacks = stacks or {}
        self.stack_at = {
            k: stacks[cuts.bounds[k]]
            for k in range(L)
            if cuts.bounds[k] in stacks and cuts.bounds[k + 1] == cuts.bounds[k] + 1
        }
        # a layer stack's activation: its carry, then the values that pass it (made before it,
        # read after it); into its first layer and out of its last in the same layout
        layout_in, layout_out = {}, {}
        for k, st in self.stack_at.items():
            passing = tuple(v for v in made if stage_of[v] < k and v not in nograd and max(used_by.get(v, {-1})) > k)
            layout_in[k] = (*st.carry_in, *st.consts, *passing)
            layout_out[k] = (*st.carry_out, *st.consts, *passing)
        plans = []
        self.context_vars: list = []
        for k in range(L):
            sl = tuple(eqns[cuts.bounds[k] : cuts.bounds[k + 1]])
            reads = {v for e in sl for v in e.invars if _is_var(v)} | (set(outs) if k == L - 1 else set())
            if k in self.stack_at:  # its carry comes as the activation
                reads = {v for v in self.stack_at[k].xs if _is_var(v)}
            if k + 1 in self.stack_at:  # hands the stack its first carry
                reads |= {v for v in layout_in[k + 1] if _is_var(v)}
            sl = _needed(self.constants, reads) + sl if k not in self.stack_at else sl
            params = tuple(sorted(pos[v] for v in reads if v in pos and _inexact(v)))
            inputs = tuple(sorted(pos[v] for v in reads if v in pos and not _inexact(v)))
            after = set(layout_out.get(k - 1, ()))
            context = tuple(v for v in made if v in reads and stage_of[v] < k and v in nograd and v not in after)
            if k in self.stack_at:
                acts = layout_in[k]
            elif k - 1 in self.stack_at:
                acts = layout_out[k - 1]
            else:
                acts = tuple(v for v in made if stage_of[v] < k and v not in nograd and max(used_by.get(v, {-1})) >= k)
            plans.append(StagePlan(sl, params, inputs, context, acts, ()))
            self.context_vars += [v for v in context if v not in self.context_vars]
        for k in range(L):
            nxt = plans[k + 1].acts_in if k + 1 < L else tuple(jaxpr.outvars)
            plans[k] = StagePlan(
                plans[k].eqns, plans[k].params, plans[k].inputs, plans[k].context, plans[k].acts_in, nxt
            )
        self.plans = plans
        # the prologue: the equations the context values need, in order
        need = set(self.context_vars)
        prologue = []
        for e in reversed((*self.constants, *eqns)):  # the constants depend on nothing after them
            if any(_is_var(v) and v in need for v in e.outvars):
                prologue.append(e)
                need.update(v for v in e.invars if _is_var(v))
        self.prologue = tuple(reversed(prologue))
        # the chain's stages: one per cut stage, a layer stack's one per layer (cut stage, layer)
        self.at: list[tuple[int, int]] = [
            (k, j) for k in range(L) for j in range(self.stack_at[k].length if k in self.stack_at else 1)
        ]
        stages: list[Stage] = []
        stacked = []
        for k in range(L):
            if k in self.stack_at:
                stacked.append(Stacked(k, len(stages), self.stack_at[k].length, None))
                stages += self._layers(k, len(stages))
            else:
                stages.append(self._stage(k, len(stages)))
        self.chain = Chain(tuple(stages), stacked=tuple(stacked))

    @classmethod
    def of(
        cls,
        closed: Any,
        stages: Any = "auto",
        max_stages: int = MAX_STAGES,
        differentiated: int | None = None,
        user_remat: str = "replace",
    ) -> "JaxprChain":
        """``closed`` cut into stages by :func:`find_cuts` (``stages``, ``max_stages``), its
        constants taken out first (:func:`split_constants`), its layer stacks a stage per layer;
        with ``user_remat="keep"``, a stack whose layer the user wrapped in ``jax.checkpoint`` /
        ``nn.remat`` stays one stage, run as written (:data:`USER_REMAT`)."""
        if user_remat not in USER_REMAT:
            raise ValueError(f"user_remat must be one of {', '.join(map(repr, USER_REMAT))}; got {user_remat!r}")
        kept, constants = split_constants(closed)
        stacks = find_stacks(kept.jaxpr, {v for e in constants for v in e.outvars if _is_var(v)})
        kept_remat = tuple(st for st in stacks.values() if user_remat == "keep" and holds_remat(st))
        stacks = {n: st for n, st in stacks.items() if st not in kept_remat}
        cuts = find_cuts(kept.jaxpr, stages, max_stages, {n: st.layer_names for n, st in stacks.items()})
        traced = cls(kept, cuts, constants, stacks, differentiated)
        traced.kept_remat = kept_remat
        return traced

    def _stage(self, k: int, index: int) -> Stage:
        p = self.plans[k]
        consts = self.consts

        def run(variables: dict, a: tuple, inline: bool) -> tuple[Any, dict]:
            env = {**consts, **self._given(p, variables)}
            env.update(zip(p.acts_in, a))
            evaluate(p.eqns, env, inline)
            return tuple(read(env, v) for v in p.outs), {}

        def apply(variables: dict, a: tuple, rngs: Any) -> tuple[Any, dict]:
            return run(variables, a, False)

        def unwrapped(variables: dict, a: tuple, rngs: Any) -> tuple[Any, dict]:
            return run(variables, a, True)

        name = self.cuts.names[k]
        return Stage(
            f"{index}:{name}",
            name.split("/")[-1] or "stage",
            apply,
            key=function_key(apply) + ":" + stage_digest(p, self.invars),
            unwrapped=unwrapped if any(e.primitive.name in REMAT_PRIMITIVES for e in p.eqns) else None,
            cost_key=function_key(apply) + ":" + stage_digest(p, self.invars, costs=True),
        )

    def _layers(self, k: int, start: int) -> list[Stage]:
        """The stages of layer stack ``k``, one per layer, the first at chain index ``start``: each
        runs the scan's body once on its carry and its slices of the stacked operands, the values
        passing the stack unchanged. The user's own ``jax.checkpoint`` / ``nn.remat`` inside the
        body runs as its body: the plan decides what each layer keeps."""
        p, st = self.plans[k], self.stack_at[k]
        body, n = st.body, len(st.carry_in)

        def apply(variables: dict, a: tuple, rngs: Any) -> tuple[Any, dict]:
            given = self._given(p, variables)
            env = dict(zip(body.jaxpr.constvars, body.consts))
            invariant = a[n : n + len(st.consts)]
            env.update(zip(body.jaxpr.invars, [*invariant, *a[:n], *(given[v] for v in st.xs)]))
            evaluate(body.jaxpr.eqns, env, inline=True)
            return (*(read(env, w) for w in body.jaxpr.outvars[:n]), *a[n:]), {}

        key = function_key(apply) + ":" + stage_digest(p, self.invars)
        return [Stage(f"{start + j}:{name}", "layer", apply, key=key) for j, name in enumerate(st.layer_names)]

    def variables(self, flat: Sequence[Any]) -> list[dict]:
        """Each layer's variables from ``fun``'s flat inputs (the prologue runs here): a stage's,
        or a layer stack's stacked (``{collection: {"body": ...}}``, as a Repeat's)."""
        return [
            self._layer(k, self._collections(p, flat, c))
            for k, (p, c) in enumerate(zip(self.plans, self._contexts(flat)))
        ]

    def variable_shapes(self, flat: Sequence[Any]) -> list[dict]:
        """:meth:`variables` as shapes, from ``fun``'s flat inputs as ShapeDtypeStructs (their
        shardings kept for the parameters and inputs)."""
        contexts = jax.eval_shape(self._contexts, list(flat))
        return [self._layer(k, self._collections(p, flat, c)) for k, (p, c) in enumerate(zip(self.plans, contexts))]

    def _contexts(self, flat: Sequence[Any]) -> list[tuple]:
        """Each stage's context values (the prologue run on ``fun``'s flat inputs)."""
        env = dict(self.consts)
        env.update(zip(self.invars, flat))
        evaluate(self.prologue, env)
        return [tuple(env[v] for v in p.context) for p in self.plans]

    def _differentiated(self, j: int) -> bool:
        return self.differentiated is None or j < self.differentiated

    def _collections(self, p: StagePlan, flat: Sequence[Any], context: Sequence[Any]) -> dict:
        """A stage's variables by collection: ``params`` (the differentiated inputs it reads),
        ``data`` (the other floating inputs: their gradient is not profiled), ``inputs`` (inputs
        of no floating dtype), ``context``."""
        return {
            "params": tuple(flat[j] for j in p.params if self._differentiated(j)),
            "data": tuple(flat[j] for j in p.params if not self._differentiated(j)),
            "inputs": tuple(flat[j] for j in p.inputs),
            "context": tuple(context),
        }

    def _given(self, p: StagePlan, variables: dict) -> dict:
        """What stage plan ``p`` reads from its variables (:meth:`_collections`), by jaxpr var."""
        given = dict(zip((self.invars[j] for j in p.params if self._differentiated(j)), variables["params"]))
        given.update(zip((self.invars[j] for j in p.params if not self._differentiated(j)), variables["data"]))
        given.update(zip((self.invars[j] for j in p.inputs), variables["inputs"]))
        given.update(zip(p.context, variables["context"]))
        return given

    def _layer(self, k: int, v: dict) -> dict:
        return {col: {BODY: tree} for col, tree in v.items()} if k in self.stack_at else v

    def activation_bytes(self, i: int) -> int:
        """Bytes of the chain's ``a_i`` (global shapes), ``i = 0 .. L``."""
        vs = self.plans[self.at[i][0]].acts_in if i < len(self.at) else self.plans[-1].outs
        return sum(_nbytes(v) for v in vs if _is_var(v))

    def shared_values(self) -> list[tuple[int, int, int, str]]:
        """``(first, last, bytes, name)`` of each value that is part of ``a_first .. a_last``
        (two or more activations), with its global size and the name of the stage that makes it.
        A layer stack's carry is another value at each layer; what passes the stack is one."""
        where: dict[Any, list[int]] = {}
        for i, (k, j) in enumerate(self.at):
            carry = len(self.stack_at[k].carry_in) if k in self.stack_at and j > 0 else 0
            for v in self.plans[k].acts_in[carry:]:
                if _is_var(v):  # not a literal first carry (an auxiliary loss's 0.0)
                    where.setdefault(v, []).append(i)
        L = len(self.at)
        for v in dict.fromkeys(v for v in self.closed.jaxpr.outvars if _is_var(v)):
            if v in where:
                where[v].append(L)
        return [
            (ks[0], ks[-1], _nbytes(v), self.chain.stages[ks[0] - 1].name.split(":", 1)[-1])
            for v, ks in where.items()
            if len(ks) > 1
        ]

    @property
    def user_remat(self) -> tuple[int, ...]:
        """The stages holding the function's own ``jax.checkpoint`` / ``nn.remat`` (kept as written
        inside them: the plan decides around them); a layer stack's layers run theirs as its body."""
        return tuple(
            i
            for i, (k, _) in enumerate(self.at)
            if k not in self.stack_at and any(e.primitive.name in REMAT_PRIMITIVES for e in self.plans[k].eqns)
        )

    @property
    def loop_stages(self) -> tuple[int, ...]:
        """The stages holding a loop that is no layer stack (one stage each, their memory counted)."""
        return tuple(i for i, (k, _) in enumerate(self.at) if k not in self.stack_at and runs_loop(self.plans[k].eqns))

    @property
    def stacks(self) -> list[tuple[LayerStack, int]]:
        """The layer stacks, each with the chain index of its first layer's stage."""
        return [(self.stack_at[g.layer], g.start) for g in self.chain.stacked]

    @property
    def context_bytes(self) -> int:
        """Bytes of the context values held for the whole step."""
        return sum(_nbytes(v) for v in self.context_vars)


def split_constants(closed: Any) -> tuple[Any, tuple]:
    """``closed`` without the equations that compute from literals alone (transitively; none with
    effects), and those equations in order. The jaxpr returned reads their outputs without making
    them: it is for cutting and for :class:`JaxprChain`, which recomputes them where read."""
    free: set = set()
    constants, kept = [], []
    for e in closed.jaxpr.eqns:
        if not e.effects and all(not _is_var(v) or v in free for v in e.invars):
            constants.append(e)
            free.update(v for v in e.outvars if _is_var(v))
        else:
            kept.append(e)
    if not constants:
        return closed, ()
    return closed.replace(jaxpr=closed.jaxpr.replace(eqns=kept)), tuple(constants)


def _needed(constants: Sequence[Any], reads: set) -> tuple:
    """The equations of ``constants`` that the values ``reads`` need, in order."""
    need, found = set(reads), []
    for e in reversed(constants):
        if any(_is_var(v) and v in need for v in e.outvars):
            found.append(e)
            need.update(v for v in e.invars if _is_var(v))
    return tuple(reversed(found))


__all__ = ["Cuts", "JaxprChain", "StagePlan", "crossing_bytes", "find_cuts", "split_constants", "trace"]
