"""Flax linen modules as stages: a list of modules or an ``nn.Sequential``, ``Repeat`` included."""

from __future__ import annotations

from typing import Any, Sequence

import jax

from jaxremat.model.identity import function_key
from jaxremat.model.repeat import Repeat
from jaxremat.model.stage import Rngs, Stage, Variables


def label(m: Any) -> str:
    """A module's name if it has one, else its type; a function's name."""
    name = getattr(m, "name", None)
    if isinstance(name, str) and name:
        return name
    return getattr(m, "__name__", None) or type(m).__name__


def linen_stage(name: str, module: Any, mutable: Sequence[str], rng_streams: Sequence[str]) -> Stage:
    """One linen module (or a plain function such as ``nn.relu``) as a stage."""
    import flax.linen as nn

    if not isinstance(module, nn.Module):  # a plain function inside nn.Sequential (nn.relu, ...)
        fn = module
        return Stage(
            name, getattr(fn, "__name__", type(fn).__name__), lambda v, a, rngs: (fn(a), {}), key=function_key(fn)
        )

    def apply(variables: Variables, a: Any, rngs: Rngs) -> tuple[Any, Variables]:
        if mutable:
            return module.apply(variables, a, rngs=rngs, mutable=list(mutable))
        return module.apply(variables, a, rngs=rngs), {}

    def init(rng: jax.Array, a: Any) -> Variables:
        rngs = {"params": rng, **{s: jax.random.fold_in(rng, k + 1) for k, s in enumerate(rng_streams)}}
        return dict(module.init(rngs, a))

    return Stage(name, type(module).__name__, apply, init, tuple(mutable), tuple(rng_streams), key=f"linen:{module!r}")


def linen_layers(modules: Any) -> tuple[list[Any], bool]:
    """The layers of an ``nn.Sequential`` or a list of modules, and whether it was a Sequential."""
    import flax.linen as nn

    sequential = isinstance(modules, nn.Sequential)
    layers = list(modules.layers) if sequential else list(modules) if isinstance(modules, (list, tuple)) else None
    if layers is None:
        raise ValueError(
            f"Chain.from_linen expects a list of linen modules or an nn.Sequential, got {type(modules).__name__}"
        )
    if not layers:
        raise ValueError("Chain.from_linen: the model has no layers; a chain needs at least one stage")
    return layers, sequential


def repeat_stages(
    k: int, first: int, m: Repeat, mutable: Sequence[str], rng_streams: Sequence[str]
) -> tuple[Stage, list[Stage]]:
    """A Repeat layer (model layer ``k``, first stage ``first``): the stage that inits its
    stacked variables, and one stage per copy of its block."""
    whole = linen_stage(f"{k}:{label(m)}", m, mutable, rng_streams)
    copies = [linen_stage(f"{first + j}:{label(m)}[{j}]", m.block, mutable, rng_streams) for j in range(m.length)]
    return whole, copies


__all__ = ["label", "linen_layers", "linen_stage", "repeat_stages"]
