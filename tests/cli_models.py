"""Small models for the command line's tests (``--model tests.cli_models:NAME``): the built-in
ones at a few blocks, so that the demo and the benchmark compile in seconds."""

from jaxremat.tools import models


def mixer():
    return models.mixer(blocks=3, width=32)


def resnet():
    return models.resnet(blocks=(1, 1), width=8)


def mlp():
    import flax.linen as nn

    return nn.Sequential([nn.Dense(64), nn.gelu, nn.Dense(64), nn.gelu, nn.Dense(8)])


def mlp_strategies():
    """The strategies a user writes for ``jaxremat fit``: name -> make(batch) -> (loss, args)."""
    import jax
    import jax.numpy as jnp

    def strategy(policy):
        def make(batch):
            m = mlp()
            x = jnp.ones((batch, 64, 64))
            v = m.init(jax.random.key(0), x)
            apply = m.apply if policy is None else jax.checkpoint(m.apply, policy=policy)
            return (lambda v, x: jnp.mean(apply(v, x) ** 2)), (v, x)

        return make

    return {"no remat": strategy(None), "my dots_saveable": strategy(jax.checkpoint_policies.dots_saveable)}


def not_strategies():
    return {"remat": 1}
