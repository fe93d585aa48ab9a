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
