"""Layer stacks in a jaxpr: a ``scan`` that runs one layer per iteration over stacked
parameters, as ``nn.scan``, ``nnx.scan``, an equinox ``lax.scan`` over ``filter_vmap``-made
layers and a plain ``lax.scan`` over stacked weights write a deep model.

Such a scan becomes ``length`` stages of one kind in the chain (a :class:`~jaxremat.Repeat`'s
stacked group), which the loop plans of :mod:`jaxremat.solvers.periodic` schedule and the
executor runs as loops over the stacked parameters: no copy of them, compile time flat in depth.

What makes a scan a layer stack (:func:`find_stacks`), and why each condition:

* it carries at least one floating value (the activation); its loop-invariant operands (``nn.scan``'s
  ``nn.broadcast`` inputs: MaxText's segment ids and positions) are of no floating dtype, and
  ride in the activation beside the carry, unchanged from layer to layer (one buffer, counted
  once). A floating one (a shared weight, a float mask) would be a variable of every copy that
  is no slice of the stacked ones, or a cotangent per layer: such a scan stays one stage;
* its per-iteration operands (``xs``) are the function's inputs or values that carry no
  gradient (per-layer RNG keys made before it): the stacked parameters, sliced per copy. An
  ``xs`` computed from parameters (``ws * 2``) is an activation: one stage;
* its stacked outputs (``ys``) are unused: a stage's output is its carry alone. A scan whose
  ``ys`` are read (an RNN's outputs per time step) stays one stage;
* its layer runs no loop itself: a scan of scans (``nn.remat_scan``) is one stage;
* it runs forwards and at least twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Sequence

from jaxremat.model.cuts import REMAT_PRIMITIVES, _inexact, _inner_path, _is_var, _stack, runs_loop


@dataclass(frozen=True)
class LayerStack:
    """A ``scan`` equation that runs a stack of layers: ``length`` iterations of ``body`` (a
    closed jaxpr of ``consts + carry + xs -> carry + ys``), from ``carry_in`` to ``carry_out``
    (its outputs, unused ones as the jaxpr's drop vars), over the stacked ``xs``, reading the
    loop-invariant ``consts``; ``path``, the module path its body runs in (``Decoder/layers``;
    empty for a plain function)."""

    eqn: Any
    length: int
    carry_in: tuple
    carry_out: tuple
    xs: tuple
    path: str
    consts: tuple = ()

    @property
    def body(self) -> Any:
        return self.eqn.params["jaxpr"]

    @property
    def layer_names(self) -> tuple[str, ...]:
        """Its layers' stage names, by module path and index (``Decoder/layers[3]``), as
        ``stages=`` patterns match them."""
        return tuple(f"{self.path or 'layers'}[{j}]" for j in range(self.length))


def no_gradient(jaxpr: Any, free: Collection[Any] = ()) -> set:
    """The values of ``jaxpr`` that carry no gradient: inputs of no floating dtype, its constants,
    ``free`` values (computed from literals alone) and what is computed from those alone."""
    nograd = {v for v in jaxpr.invars if not _inexact(v)} | set(jaxpr.constvars) | set(free)
    for e in jaxpr.eqns:
        if all(not _is_var(v) or v in nograd for v in e.invars):
            nograd.update(v for v in e.outvars if _is_var(v))
    return nograd


def layer_stack(e: Any, inputs: Collection[Any], nograd: Collection[Any]) -> LayerStack | None:
    """``e`` as a :class:`LayerStack`, or ``None`` where it is not one (the module docstring says
    why each condition). ``inputs``: the function's inputs; ``nograd``: :func:`no_gradient`."""
    if e.primitive.name != "scan":
        return None
    p = e.params
    consts, carry, length = int(p["num_consts"]), int(p["num_carry"]), int(p["length"])
    if p.get("reverse", False) or length < 2:
        return None
    invariant = tuple(e.invars[:consts])
    if any(not _is_var(v) or _inexact(v) for v in invariant):
        return None
    carry_in, xs = tuple(e.invars[consts : consts + carry]), tuple(e.invars[consts + carry :])
    carry_out, ys = tuple(e.outvars[:carry]), e.outvars[carry:]
    if not xs or any(_is_var(v) for v in ys):
        return None
    if not any(_inexact(v) for v in carry_out):
        return None
    if any(not _is_var(v) or not (v in inputs or v in nograd) for v in xs):
        return None
    if runs_loop(e.params["jaxpr"].jaxpr.eqns):  # a scan of scans (nn.remat_scan): one stage
        return None
    path = [p for p in _stack(e).split("/") if p] + _inner_path(e)  # the body's paths are relative to the scan's
    return LayerStack(e, length, carry_in, carry_out, xs, "/".join(path), invariant)


def find_stacks(jaxpr: Any, free: Collection[Any] = ()) -> dict[int, LayerStack]:
    """The layer stacks among ``jaxpr``'s top-level equations, by equation index."""
    nograd, inputs = no_gradient(jaxpr, free), set(jaxpr.invars)
    found = {n: layer_stack(e, inputs, nograd) for n, e in enumerate(jaxpr.eqns)}
    return {n: s for n, s in found.items() if s is not None}


def holds_remat(stack: LayerStack) -> bool:
    """Whether the user wrapped the stack's layer in ``jax.checkpoint`` / ``nn.remat``."""
    return any(e.primitive.name in REMAT_PRIMITIVES for e in stack.body.jaxpr.eqns)


def describe(stacks: Sequence[tuple[LayerStack, int]]) -> str:
    """For a plan's report: each stack (with its first stage's index), its layers' stages, and
    that the user's own remat inside them is replaced by the plan."""
    parts = []
    for st, start in stacks:
        where = f" ({st.path})" if st.path else ""
        part = f"a scan over {st.length} layers{where}: stages {start}-{start + st.length - 1}, run as loops"
        if holds_remat(st):
            part += "; your jax.checkpoint / nn.remat inside its layer is replaced by the plan"
        parts.append(part)
    return "; ".join(parts)


__all__ = ["LayerStack", "describe", "holds_remat", "find_stacks", "layer_stack", "no_gradient"]
