"""Flax NNX modules as stages: each stage's variables are ``{"params": ..., "rest": ...}``."""

from __future__ import annotations

from typing import Any

import jax

from jaxremat.model.linen import linen_stage
from jaxremat.model.stage import Rngs, Stage, Variables


def nnx_stage(name: str, module: Any) -> Stage:
    """One NNX module (or a plain function such as ``nnx.relu``) as a stage. Its ``init`` returns
    the module's state as it is now; it returns its updated ``rest`` (batch statistics, RNG
    counters) like a mutable linen collection."""
    from flax import nnx

    if not isinstance(module, nnx.Module):  # a plain function inside nnx.Sequential (nnx.relu, ...)
        return linen_stage(name, module, (), ())
    graphdef = nnx.split(module, nnx.Param, ...)[0]

    def apply(variables: Variables, a: Any, rngs: Rngs) -> tuple[Any, Variables]:
        # fresh Variable objects at the current trace level, so the module may update them here
        params_now, rest_now = jax.tree.map(lambda v: v, (variables["params"], variables["rest"]))
        m = nnx.merge(graphdef, params_now, rest_now)
        out = m(a)
        return out, {"rest": nnx.split(m, nnx.Param, ...)[2]}

    def init(rng: jax.Array, a: Any) -> Variables:
        return nnx_state(module)  # the layer's state when asked, not when the stage was made

    return Stage(name, type(module).__name__, apply, init, ("rest",), (), key=f"nnx:{graphdef!r}")


def layer_list(modules: Any) -> list[Any] | None:
    """The layers of an ``nnx.Sequential``, an ``nnx.List`` (Flax 0.12's container for lists of
    modules) or a Python list or tuple of NNX modules; ``None`` for anything else."""
    from flax import nnx

    if isinstance(modules, nnx.Sequential):
        return list(modules.layers)
    nnx_list = getattr(nnx, "List", None)
    if isinstance(modules, (list, tuple)) or (nnx_list is not None and isinstance(modules, nnx_list)):
        return list(modules)
    return None


def nnx_layers(modules: Any) -> list[Any]:
    """The layers of an ``nnx.Sequential``, an ``nnx.List`` or a list of NNX modules."""
    layers = layer_list(modules)
    if layers is None:
        raise ValueError(
            "Chain.from_nnx expects an nnx.Sequential, an nnx.List or a list of NNX modules, got "
            f"{type(modules).__name__}"
        )
    if not layers:
        raise ValueError("Chain.from_nnx: the model has no layers; a chain needs at least one stage")
    return layers


def nnx_state(module: Any) -> Variables:
    """An NNX layer's state now, as its stage's variables (``{}`` for a plain function)."""
    from flax import nnx

    if not isinstance(module, nnx.Module):
        return {}
    _, params, rest = nnx.split(module, nnx.Param, ...)
    return {"params": params, "rest": rest}


__all__ = ["layer_list", "nnx_layers", "nnx_stage", "nnx_state"]
