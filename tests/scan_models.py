"""Layer stacks written with a scan, the way large JAX models are written: a plain ``lax.scan``
over stacked weights, linen ``nn.scan`` (with the user's own ``nn.remat`` and dropout inside,
as MaxText writes its decoder), NNX ``nnx.vmap`` + ``nnx.scan``, and equinox ``filter_vmap`` +
``lax.scan`` (as Levanter's ``Stacked``); and a scan that is no layer stack (an RNN over time
steps). Each case's ``make(hand)`` builds its loss with the hand strategy ``hand`` on the scanned
body (``None``: the model as plain autodiff runs it, no remat), as ``tests/outside_models.py``.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from outside_models import FULL, Case, wrap


def _policy(hand: Any) -> Any:
    return None if hand in (None, FULL) else hand


def scan_mlp(layers: int = 12, width: int = 128, batch: int = 1024) -> Case:
    """A plain ``lax.scan`` over stacked weights, its carry the activation."""
    ws = jax.random.normal(jax.random.key(0), (layers, width, width)) / jnp.sqrt(width)
    bs = jnp.zeros((layers, width))
    x = jax.random.normal(jax.random.key(1), (batch, width))

    def make(hand):
        def layer(h, wb):
            w, b = wb
            return jnp.tanh(h @ w + b), None

        def loss(params, x):
            h, _ = jax.lax.scan(wrap(layer, hand), x, params)
            return jnp.mean(h**2)

        return loss

    return Case("plain lax.scan MLP", make, ((ws, bs), x))


class _Block(nn.Module):
    width: int
    rate: float = 0.1

    @nn.compact
    def __call__(self, h, _):
        y = nn.Dense(4 * self.width)(nn.LayerNorm()(h))
        y = nn.Dropout(self.rate, deterministic=False)(nn.gelu(y))
        return h + nn.Dense(self.width)(y), None


class _Decoder(nn.Module):
    layers: int
    width: int
    hand: Any = None

    @nn.compact
    def __call__(self, x):
        block = _Block if self.hand is None else nn.remat(_Block, policy=_policy(self.hand))
        stack = nn.scan(
            block,
            variable_axes={"params": 0},
            split_rngs={"params": True, "dropout": True},
            length=self.layers,
        )
        h = nn.Dense(self.width, name="embed")(x)
        h, _ = stack(self.width, name="layers")(h, None)
        return nn.Dense(1, name="head")(nn.LayerNorm(name="ln_f")(h))


def linen_scan(layers: int = 8, width: int = 64, batch: int = 4, seq: int = 64) -> Case:
    """``nn.scan(nn.remat(Block))`` with dropout inside (``split_rngs``), as MaxText writes it;
    ``make(None)`` is the stack without the user's ``nn.remat``."""
    x = jax.random.normal(jax.random.key(1), (batch, seq, width))
    v = _Decoder(layers, width).init({"params": jax.random.key(0), "dropout": jax.random.key(2)}, x)

    def make(hand):
        model = _Decoder(layers, width, hand)

        def loss(v, x, key):
            return jnp.mean(model.apply(v, x, rngs={"dropout": key}) ** 2)

        return loss

    return Case("linen nn.scan(nn.remat(Block)) with dropout", make, (v, x, jax.random.key(3)))


class _SegmentBlock(nn.Module):
    width: int

    @nn.compact
    def __call__(self, h, segments):
        y = nn.Dense(4 * self.width)(nn.LayerNorm()(h))
        y = nn.Dense(self.width)(nn.gelu(y))
        return h + jnp.where(segments[:, :, None] > 0, y, 0.0), None


class _SegmentDecoder(nn.Module):
    layers: int
    width: int
    hand: Any = None

    @nn.compact
    def __call__(self, x, segments):
        block = _SegmentBlock if self.hand is None else nn.remat(_SegmentBlock, policy=_policy(self.hand))
        stack = nn.scan(
            block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=nn.broadcast,
            length=self.layers,
        )
        h, _ = stack(self.width, name="layers")(nn.Dense(self.width)(x), segments)
        return nn.Dense(1)(h)


def linen_scan_broadcast(layers: int = 8, width: int = 64, batch: int = 4, seq: int = 64) -> Case:
    """``nn.scan`` with an ``nn.broadcast`` input to every layer (integer segment ids, as MaxText
    broadcasts ``decoder_segment_ids`` and ``decoder_positions``)."""
    x = jax.random.normal(jax.random.key(1), (batch, seq, width))
    segments = (jnp.arange(batch * seq).reshape(batch, seq) % 5).astype(jnp.int32)
    v = _SegmentDecoder(layers, width).init(jax.random.key(0), x, segments)

    def make(hand):
        model = _SegmentDecoder(layers, width, hand)
        return lambda v, x, segments: jnp.mean(model.apply(v, x, segments) ** 2)

    return Case("linen nn.scan with an nn.broadcast input", make, (v, x, segments))


class _NnxBlock(nnx.Module):
    """A pre-norm MLP block of width ``width``."""

    def __init__(self, width: int, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, h):
        return h + self.down(nnx.gelu(self.up(self.norm(h))))


def nnx_scan(layers: int = 8, width: int = 64, batch: int = 256) -> Case:
    """Layers made by ``nnx.vmap`` and run by ``nnx.scan`` (Flax NNX's scan-over-layers idiom)."""

    @nnx.vmap(in_axes=0, out_axes=0)
    def make_blocks(key):
        return _NnxBlock(width, nnx.Rngs(key))

    blocks = make_blocks(jax.random.split(jax.random.key(0), layers))
    graphdef, state = nnx.split(blocks)
    x = jax.random.normal(jax.random.key(1), (batch, width))

    def make(hand):
        def loss(state, x):
            stack = nnx.merge(graphdef, state)

            def body(block, h):
                return block(h) if hand is None else nnx.remat(lambda b, h: b(h), policy=_policy(hand))(block, h)

            run = nnx.scan(body, in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
            return jnp.mean(run(stack, x) ** 2)

        return loss

    return Case("NNX nnx.vmap + nnx.scan", make, (state, x))


def equinox_scan(layers: int = 8, width: int = 64, batch: int = 256) -> Case:
    """Layers made by ``eqx.filter_vmap``, run by ``lax.scan`` over their stacked arrays (as
    Levanter's ``Stacked``)."""

    class Block(eqx.Module):
        up: eqx.nn.Linear
        down: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.up = eqx.nn.Linear(width, 4 * width, key=k1)
            self.down = eqx.nn.Linear(4 * width, width, key=k2)

        def __call__(self, h):
            return h + jax.vmap(lambda r: self.down(jax.nn.gelu(self.up(r))))(h)

    stacked = eqx.filter_vmap(Block)(jax.random.split(jax.random.key(0), layers))
    params, static = eqx.partition(stacked, eqx.is_array)
    x = jax.random.normal(jax.random.key(1), (batch, width))

    def make(hand):
        def layer(h, p):
            return eqx.combine(p, static)(h), None

        def loss(params, x):
            h, _ = jax.lax.scan(wrap(layer, hand), x, params)
            return jnp.mean(h**2)

        return loss

    return Case("equinox filter_vmap + lax.scan", make, (params, x))


def rnn(steps: int = 64, width: int = 128, batch: int = 64) -> Case:
    """A scan over time steps whose outputs per step are read (an RNN): no layer stack."""
    k = jax.random.split(jax.random.key(0), 3)
    w_in = jax.random.normal(k[0], (width, width)) / jnp.sqrt(width)
    w_h = jax.random.normal(k[1], (width, width)) / jnp.sqrt(width)
    w_out = jax.random.normal(k[2], (width, 1)) / jnp.sqrt(width)
    xs = jax.random.normal(jax.random.key(1), (steps, batch, width))

    def make(hand):
        def cell(params, h, x):
            w_in, w_h, _ = params
            h = jnp.tanh(x @ w_in + h @ w_h)
            return h, h

        def loss(params, xs):
            step = wrap(lambda h, x: cell(params, h, x), hand)
            _, hs = jax.lax.scan(step, jnp.zeros(xs.shape[1:]), xs)
            return jnp.mean((hs @ params[2]) ** 2)

        return loss

    return Case("RNN over time steps (lax.scan, outputs read)", make, ((w_in, w_h, w_out), xs))


class LinenStack(nn.Module):
    """A module of a linen ``nn.Sequential`` that runs its blocks with ``nn.scan`` (dropout inside)."""

    layers: int
    width: int

    @nn.compact
    def __call__(self, h):
        stack = nn.scan(
            _Block, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True}, length=self.layers
        )
        return stack(self.width, name="blocks")(h, None)[0]


class NnxStack(nnx.Module):
    """An NNX module of an ``nnx.Sequential`` whose blocks are made by ``nnx.vmap`` and run by ``nnx.scan``."""

    def __init__(self, layers: int, width: int, rngs: nnx.Rngs):
        self.blocks = nnx.vmap(lambda key: _NnxBlock(width, nnx.Rngs(key)), in_axes=0, out_axes=0)(
            jax.random.split(rngs.params(), layers)
        )

    def __call__(self, h):
        return nnx.scan(lambda block, h: block(h), in_axes=(0, nnx.Carry), out_axes=nnx.Carry)(self.blocks, h)


CASES = {
    "scan_mlp": scan_mlp,
    "linen_scan": linen_scan,
    "linen_scan_broadcast": linen_scan_broadcast,
    "nnx_scan": nnx_scan,
    "equinox_scan": equinox_scan,
}
