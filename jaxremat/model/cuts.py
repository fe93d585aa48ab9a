"""Where to cut a jaxpr into stages: by Flax module scope, by ``checkpoint_name`` markers, or
once per contraction where the fewest bytes cross (:func:`find_cuts`), with the jaxpr
helpers the chain shares (:mod:`jaxremat.model.jaxpr_chain`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from jaxremat.model.trees import itemsize

CONTRACTIONS = ("dot_general", "conv_general_dilated")
MAX_STAGES = 48
REMAT_PRIMITIVES = ("checkpoint", "remat2", "remat")  # jax.checkpoint's primitive, by jax version
LOOP_PRIMITIVES = ("scan", "while")  # never cut: a loop over layers is one stage


BY_CONTRACTIONS = "at contractions"
BY_SCOPE = "Flax module scope, depth "


@dataclass(frozen=True)
class Cuts:
    """Stage ``k`` is equations ``bounds[k] .. bounds[k+1]-1``; ``how`` says how they were chosen."""

    bounds: tuple[int, ...]
    how: str
    names: tuple[str, ...]

    @property
    def count(self) -> int:
        return len(self.bounds) - 1

    @property
    def at_contractions(self) -> bool:
        """Whether the stages were cut before contractions (:func:`bytes_cuts`): the first
        holds what precedes the first one, and a block of the user's is several stages."""
        return self.how.startswith(BY_CONTRACTIONS)

    @property
    def scope_depth(self) -> int | None:
        """How deep in the Flax module scopes the stages were cut; ``None`` if not by scopes."""
        if not self.how.startswith(BY_SCOPE):
            return None
        return int(self.how[len(BY_SCOPE) :].split(";")[0])


def _nbytes(v: Any) -> int:
    aval = v.aval
    return int(np.prod(aval.shape)) * itemsize(aval.dtype) if hasattr(aval, "shape") else 0


def _is_var(v: Any) -> bool:
    return isinstance(v, jcore.Var) and not isinstance(v, jcore.DropVar)


def _inexact(v: Any) -> bool:
    return hasattr(v.aval, "dtype") and jnp.issubdtype(v.aval.dtype, jnp.inexact)


def _stack(eqn: Any) -> str:
    return str(eqn.source_info.name_stack)


# -- where to cut ------------------------------------------------------------------------------


def _groups(keys: Sequence[Any]) -> list[tuple[int, Any]]:
    """Runs of equal keys as (first equation, key). Equations without a key (``None``: glue
    between modules, such as a residual add in the parent's ``__call__``) join the run after
    them; trailing ones the last run."""
    runs: list[tuple[int, Any]] = []
    last_keyed = -1
    for n, key in enumerate(keys):
        if key is None:
            continue
        if not runs or runs[-1][1] != key:
            runs.append((0 if not runs else last_keyed + 1, key))
        last_keyed = n
    return runs


def _from_keys(keys: Sequence[Any], n_eqns: int, how: str) -> Cuts | None:
    runs = _groups(keys)
    if len(runs) < 2:
        return None
    bounds = tuple(n for n, _ in runs) + (n_eqns,)
    return Cuts(bounds, how, tuple("/".join(k) if isinstance(k, tuple) else str(k) for _, k in runs))


def _sub_jaxprs(eqn: Any) -> list[Any]:
    """The jaxprs inside ``eqn`` (a ``checkpoint``'s, a ``pjit``'s, a ``scan``'s body ...)."""
    found = []
    for v in eqn.params.values():
        for x in v if isinstance(v, (list, tuple)) else (v,):
            j = getattr(x, "jaxpr", x)
            if hasattr(j, "eqns"):
                found.append(j)
    return found


def holds_loop(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` runs a loop (:data:`LOOP_PRIMITIVES`), at any depth."""
    return runs_loop(jaxpr.eqns)


def runs_loop(eqns: Sequence[Any]) -> bool:
    """Whether ``eqns`` run a loop (:data:`LOOP_PRIMITIVES`), at any depth."""
    return any(e.primitive.name in LOOP_PRIMITIVES or any(holds_loop(j) for j in _sub_jaxprs(e)) for e in eqns)


def _inner_path(eqn: Any) -> list[str]:
    """The module path the equations inside ``eqn`` share (a user's ``nn.remat`` block is one
    ``checkpoint`` equation at its parent's scope; inside, its own path): ``[]`` if none."""
    paths = [[p for p in _stack(e).split("/") if p] for j in _sub_jaxprs(eqn) for e in j.eqns]
    paths = [p for p in paths if p]
    if not paths:
        return []
    common = paths[0]
    for p in paths[1:]:
        n = 0
        while n < min(len(common), len(p)) and common[n] == p[n]:
            n += 1
        common = common[:n]
    return common


def _heavy(eqn: Any) -> bool:
    """A contraction, or an equation holding one (a user's ``jax.checkpoint``, a ``jit``)."""
    if eqn.primitive.name in CONTRACTIONS:
        return True
    return any(_heavy(e) for j in _sub_jaxprs(eqn) for e in j.eqns)


def scope_cuts(eqns: Sequence[Any], depth: int) -> Cuts | None:
    """Cut where the Flax module path (the equations' name stack) changes at ``depth`` levels.

    An equation above that depth joins the stage after it, unless it holds a contraction: a
    user's ``nn.remat`` block (one ``checkpoint`` equation at its parent's scope) or a matmul
    written in the parent's ``__call__`` is a stage of its own, named by the path inside it."""
    keys: list[Any] = []
    paths: list[tuple[str, ...]] = []
    for n, e in enumerate(eqns):
        parts = [p for p in _stack(e).split("/") if p]
        paths.append(tuple(parts))
        if len(parts) >= depth:
            keys.append(tuple(parts[:depth]))
        elif _heavy(e):
            inner = _inner_path(e)
            keys.append((*parts, *(inner or [f"{e.primitive.name}@{n}"]))[: max(depth, len(parts) + 1)])
        else:
            keys.append(None)
    return _from_keys(_glue_to_its_module(keys, paths), len(eqns), f"{BY_SCOPE}{depth}")


def _glue_to_its_module(keys: Sequence[Any], paths: Sequence[tuple[str, ...]]) -> list[Any]:
    """``keys`` with the glue that ends a module (an equation above the cut depth, in the module of
    the run before it and not of the run after: a block's last residual add) keyed as that run.

    Glue otherwise joins the run after it (:func:`_groups`), which put each decoder block's
    closing ``x + mlp(x)`` in the next block's first stage: every boundary between blocks then
    held the residual stream and the MLP's output, two activations where the user's block
    returns one, and the user's blocks under ``dots_with_no_batch_dims_saveable`` (49.49 MiB)
    were matched by jaxremat's only at 51.47, so its plan there ran 1.047x their flops (an
    8-block linen decoder, CPU, 2026-12-06)."""
    keys = list(keys)
    keyed = [n for n, k in enumerate(keys) if k is not None]
    for before, after in zip(keyed, keyed[1:]):
        prev, nxt = keys[before], keys[after]
        for n in range(before + 1, after):
            path = paths[n]
            if path and tuple(prev[: len(path)]) == path and tuple(nxt[: len(path)]) != path:
                keys[n] = prev
    return keys


def pattern_cuts(eqns: Sequence[Any], pattern: str, layers: Mapping[int, Sequence[str]] | None = None) -> Cuts | None:
    """Cut where the part of the module path that ``pattern`` (a regex) matches changes.
    ``layers``: for each layer stack (by equation index), its layers' names
    (``Decoder/layers[3]``), matched in place of its equation's path; ``None`` when nothing matches."""
    rx = re.compile(pattern)
    keys = []
    for n, e in enumerate(eqns):
        found = [m.group(0) for p in (layers or {}).get(n, (_stack(e),)) if (m := rx.search(p))]
        keys.append(found[0] if found else None)
    if all(k is None for k in keys):
        return None
    how = f"module paths matching {pattern!r}"
    # one run: one stage, which a layer stack inside still cuts per layer (find_cuts)
    return _from_keys(keys, len(eqns), how) or Cuts((0, len(eqns)), how, ("",))


def name_cuts(eqns: Sequence[Any]) -> Cuts | None:
    """Cut after every ``jax.ad_checkpoint.checkpoint_name`` marker."""
    after = [n + 1 for n, e in enumerate(eqns) if e.primitive.name == "name" and n + 1 < len(eqns)]
    if not after:
        return None
    bounds = tuple(sorted({0, *after})) + (len(eqns),)
    names = ["start"] + [str(eqns[b - 1].params.get("name", "")) for b in bounds[1:-1]]
    return Cuts(bounds, "checkpoint_name markers", tuple(names))


def crossing_bytes(jaxpr: Any) -> np.ndarray:
    """Bytes of gradient-carrying values live across each boundary ``t`` (between equations
    ``t-1`` and ``t``), ``t = 0 .. len(eqns)``."""
    eqns = jaxpr.eqns
    made: dict[Any, int] = {}
    last: dict[Any, int] = {}
    for n, e in enumerate(eqns):
        for v in e.invars:
            if _is_var(v):
                last[v] = n
        for v in e.outvars:
            if _is_var(v):
                made[v] = n
    for v in jaxpr.outvars:
        if _is_var(v):
            last[v] = len(eqns)
    diff = np.zeros(len(eqns) + 2)
    for v, d in made.items():
        if v in last and _inexact(v) and last[v] > d:
            diff[d + 1] += _nbytes(v)
            diff[last[v] + 1] -= _nbytes(v)
    return np.cumsum(diff)[: len(eqns) + 1]


def bytes_cuts(jaxpr: Any, max_stages: int) -> Cuts | None:
    """One cut per contraction (matmul, convolution), at most ``max_stages`` stages, each placed
    where the fewest bytes cross between the contraction before it and it (the latest such
    place: right before the contraction unless fewer bytes cross earlier).

    Why not always right before the contraction: in a pre-norm residual block the layer norm
    sits between the previous block's last matmul and this block's first, and right before the
    matmul both the residual stream and its normalised copy cross. Cut there, no stage boundary
    holds the residual stream alone, so the hand strategy "``jax.checkpoint`` on every block"
    (which keeps the block's input, one activation) is no schedule of the chain, and a plan at
    its memory needed 4-7% more flops (NNX and equinox transformers, ``benchmarks/outside.py``,
    2026-12-05). Cut after the residual add, every block boundary is a stage boundary."""
    eqns = jaxpr.eqns
    cb = crossing_bytes(jaxpr)
    heavy = [n for n, e in enumerate(eqns) if e.primitive.name in CONTRACTIONS]
    # between two contractions, the place where the fewest bytes cross (ties: the later); before
    # the first, right before it. (Merging what comes before the first contraction into the first
    # stage instead, as the first block's "jax.checkpoint" does, changed nothing on an NNX
    # transformer and left an equinox transformer's 75% plan 1.3-2 MiB under XLA through four
    # corrections, 2026-12-05.)
    cands = heavy[:1] + [min(range(a + 1, b + 1), key=lambda n: (cb[n], -n)) for a, b in zip(heavy, heavy[1:])]
    cands = [n for n in cands if n > 0]
    if not cands:
        return None
    if len(cands) >= max_stages:
        cands = sorted(sorted(cands, key=lambda n: (cb[n], n))[: max_stages - 1])
    bounds = tuple(sorted({0, *cands})) + (len(eqns),)
    if len(bounds) < 3:
        return None
    return Cuts(bounds, f"{BY_CONTRACTIONS}, where the fewest bytes cross", tuple(f"eqn {b}" for b in bounds[:-1]))


def with_loss_stage(jaxpr: Any, cuts: Cuts, max_stages: int) -> Cuts:
    """``cuts`` with the loss on a stage of its own: from the function's last contraction to its
    first reduction, cut where the fewest bytes cross (the latest such place before the
    reduction's input is made), when that last stage also holds the contraction and the
    function's outputs are smaller than what crosses there (a loss reduces).

    Why (measured 2026-12-05, an 8-layer loop MLP, ``mean(h ** 2)`` after the last layer): with
    the loss inside the last layer's stage, a plan that checkpoints that stage computes the loss
    value from a recomputation, which XLA:CPU made one YNNPACK reduction fusion with GELU's
    constants broadcast to four whole activations (6.36 MB of temp under ``value_and_grad``
    against 5.31 for ``jax.checkpoint`` on every layer); cut off, the reduction reads the stored
    activation as the hand policy's loss does (5.24 MB).
    """
    eqns = jaxpr.eqns
    heavy = [n for n, e in enumerate(eqns) if _heavy(e)]
    if not heavy or cuts.count >= max_stages or heavy[-1] < cuts.bounds[-2]:
        return cuts
    reductions = [n for n, e in enumerate(eqns) if n > heavy[-1] and e.primitive.name.startswith("reduce_")]
    if not reductions or reductions[0] <= heavy[-1] + 1:
        return cuts
    # the latest place before the reduction where the fewest bytes cross, the reduction's own
    # input excluded: a loss stage that is a reduction alone hands the stage before it a
    # constant cotangent (its broadcast), which a policy stage's jax.checkpoint barrier makes a
    # buffer at the forward's end (one activation more than planned, the MLP under dots_saveable)
    cb = crossing_bytes(jaxpr)
    at = min(range(heavy[-1] + 1, reductions[0]), key=lambda n: (cb[n], -n))
    out = sum(_nbytes(v) for v in jaxpr.outvars if _is_var(v) and _inexact(v))
    if at <= cuts.bounds[-2] or out >= cb[at]:
        return cuts
    return Cuts(cuts.bounds[:-1] + (at, len(eqns)), f"{cuts.how}; the loss a stage of its own", cuts.names + ("loss",))


def isolate(cuts: Cuts, stacks: Sequence[int], n_eqns: int) -> Cuts:
    """``cuts`` with each layer stack (by equation index, :mod:`~jaxremat.model.layer_stacks`) a
    stage of its own, with a stage before it and one after it (empty where the stack is the
    function's first or last equation): the stage before hands the stack its first carry as an
    activation, the one after reads its last."""
    bounds = sorted({*cuts.bounds, *stacks, *(q + 1 for q in stacks)})
    names = [_name_at(cuts, b) or ("before" if b < min(stacks) else "after") for b in bounds[:-1]]
    if stacks and min(stacks) == 0:  # an empty stage before: it reads the carry from the inputs
        bounds, names = [0, *bounds], ["input", *names]
    if stacks and max(stacks) == n_eqns - 1:  # an empty stage after: it returns the outputs
        bounds, names = [*bounds, n_eqns], [*names, "output"]
    how = cuts.how if not stacks else f"{cuts.how}; each layer stack (a scan over layers) a stage per layer"
    return Cuts(tuple(bounds), how, tuple(names))


def _name_at(cuts: Cuts, b: int) -> str:
    """The name of the stage of ``cuts`` holding equation ``b``."""
    k = max(k for k in range(cuts.count) if cuts.bounds[k] <= b)
    return cuts.names[k]


def find_cuts(
    jaxpr: Any, stages: Any = "auto", max_stages: int = MAX_STAGES, stacks: Mapping[int, Sequence[str]] | None = None
) -> Cuts:
    """The stages of ``jaxpr``'s equations; each of ``stacks`` (layer stacks by equation index,
    :mod:`~jaxremat.model.layer_stacks`, with their layers' names) a stage of its own between two
    others, cut per layer whatever ``stages`` says; a pattern may name those layers.

    ``stages``: ``"auto"`` (the Flax module-scope depth with the most stages up to
    ``max_stages``; else ``checkpoint_name`` markers; else one cut per contraction; with
    ``"bytes"`` too, the loss after the last contraction a stage of its own), an int
    (a module-scope depth), ``"names"`` (``checkpoint_name`` markers), ``"bytes"``, or a regular
    expression over module paths (``r"blocks_\\d+"``). ``ValueError`` saying what was found when
    fewer than two stages come out."""
    eqns = jaxpr.eqns
    depth_max = max((len([p for p in _stack(e).split("/") if p]) for e in eqns), default=0)
    if isinstance(stages, bool) or not isinstance(stages, (int, str)):
        raise ValueError(
            f"stages must be 'auto', 'names', 'bytes', a module-scope depth (int) or a regex; got {stages!r}"
        )
    if isinstance(stages, int):
        found = scope_cuts(eqns, stages)
        what = f"module scope depth {stages} (the deepest module path here has {depth_max} levels)"
    elif stages == "names":
        found, what = name_cuts(eqns), "checkpoint_name markers"
    elif stages == "bytes":
        found, what = bytes_cuts(jaxpr, max_stages), "matmuls or convolutions to cut before"
        found = found and with_loss_stage(jaxpr, found, max_stages)
    elif stages == "auto":
        found = None
        for d in range(1, depth_max + 1):
            c = scope_cuts(eqns, d)
            if c is not None and c.count <= max_stages and (found is None or c.count > found.count):
                found = c
        found = found or name_cuts(eqns) or bytes_cuts(jaxpr, max_stages)
        found = found and with_loss_stage(jaxpr, found, max_stages)
        what = "Flax module scopes, checkpoint_name markers or matmuls/convolutions"
    else:
        found = pattern_cuts(eqns, stages, stacks)
        if found is None:
            layers = [f"{names[0]} .. {names[-1]}" for names in (stacks or {}).values()]
            paths = (layers + sorted({_stack(e) for e in eqns if _stack(e)}))[:6]
            raise ValueError(
                f"stages={stages!r} matches no module path of this function; its paths look like "
                f"{paths or ['(none: the function has no Flax module scopes)']}"
            )
        what = f"module paths matching {stages!r}"
    if stacks:
        one = Cuts((0, len(eqns)), "one stage", ("",))
        found = isolate(found if found is not None else one, sorted(stacks), len(eqns))
    if found is None or found.count < 2:
        why = (
            " It runs a loop that is not a stack of layers (a while_loop or fori_loop, a scan of scans, or a scan "
            "whose per-step outputs are read or that reads values other than its per-layer slices): such a loop is "
            "one stage. A scan over stacked layers (nn.scan, nnx.scan, lax.scan) is cut per layer."
            if holds_loop(jaxpr)
            else ""
        )
        raise ValueError(
            f"jaxremat.remat found fewer than two stages in this function ({len(eqns)} equations) by {what}; "
            "cut it with stages=<a module-scope depth, or a regex over module paths>, mark cut points with "
            "jax.ad_checkpoint.checkpoint_name(x, name) and stages='names', or remat a function with more layers." + why
        )
    return found


__all__ = ["CONTRACTIONS", "Cuts", "MAX_STAGES", "REMAT_PRIMITIVES", "crossing_bytes", "find_cuts", "holds_loop"]
