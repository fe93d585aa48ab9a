"""Models written the way jaxremat's users write them, not for the library: a corpus to check
its promise on (``tests/test_outside.py``, ``benchmarks/outside.py``).

Each case builds a loss the usual way for its framework (a Python loop over plain-JAX weights,
a linen decoder looping over its blocks, linen with the user's own ``nn.remat``, dropout and
BatchNorm, a U-Net with concatenated skips, an equinox transformer with its blocks in a list, NNX
with an ``nnx.List``) and can build the
same loss with a hand-written ``jax.checkpoint`` policy on every block (``hand=``), which is what
jaxremat must beat at the same memory. ``Case.loss(*args)`` returns a scalar, or ``(scalar, aux)``
with ``has_aux``; ``Case.args`` are concrete; ``Case.grad_args`` the arguments differentiated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jaxremat as jr
from jaxremat.core.compile import total_bytes

# hand strategies, applied to every block: None (plain autodiff), "full" (jax.checkpoint with no
# policy: keep the block's input only) or a jax.checkpoint policy
FULL = "full"
HAND = {
    "checkpoint every block": FULL,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
}


def update_step(loss: Callable, args: tuple, has_aux: bool = False) -> tuple[int, float]:
    """XLA's temp bytes and flops of ``loss``'s training step as jaxremat verifies it: the
    gradient with respect to the first argument's float leaves, consumed by Adam, donated, the loss
    returned (as users log it)."""
    compiled = compiled_step(loss, args, has_aux)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return int(compiled.memory_analysis().temp_size_in_bytes), float(cost["flops"])


def step_total(loss: Callable, args: tuple, optimizer: Any = None) -> int:
    """What the compiled training step of ``loss`` uses in all: temporaries, arguments and outputs,
    less the outputs written over donated arguments."""
    return total_bytes(compiled_step(loss, args, optimizer=optimizer).memory_analysis())


def compiled_step(loss: Callable, args: tuple, has_aux: bool = False, optimizer: Any = None) -> Any:
    """``loss``'s training step (:func:`update_step`), compiled; Adam unless ``optimizer``."""
    opt = optimizer or optax.adam(1e-3)
    leaves, tree = jax.tree.flatten(args[0])
    floats = [
        n for n, leaf in enumerate(leaves) if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jnp.inexact)
    ]
    other = {n: leaf for n, leaf in enumerate(leaves) if n not in floats}  # flags, static fields: as eqx.filter_grad

    def first(p):
        return jax.tree.unflatten(tree, [other[n] if n in other else p[floats.index(n)] for n in range(len(leaves))])

    def step(p, state, rest):
        value, g = jax.value_and_grad(lambda p, *r: loss(first(p), *r), has_aux=has_aux)(p, *rest)
        updates, state = opt.update(g, state, p)
        return value, optax.apply_updates(p, updates), state

    p0 = [leaves[n] for n in floats]
    return jr.jit(step, donate_argnums=(0, 1)).lower(p0, opt.init(p0), args[1:]).compile()


def wrap(block: Callable, hand: Any) -> Callable:
    """``block`` under the hand strategy ``hand`` (see :data:`HAND`)."""
    if hand is None:
        return block
    return jax.checkpoint(block) if hand == FULL else jax.checkpoint(block, policy=hand)


@dataclass
class Case:
    name: str
    make: Callable[[Any], Callable]  # hand strategy -> loss
    args: tuple
    grad_args: tuple[int, ...] = (0,)
    has_aux: bool = False
    notes: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def loss(self) -> Callable:
        return self.make(None)


# -- plain JAX: a Python loop over a list of weights -------------------------------------------


def loop_mlp(layers: int = 12, width: int = 256, tokens: tuple[int, int] = (8, 128)) -> Case:
    k = jax.random.split(jax.random.key(0), layers)
    ws = [jax.random.normal(k[i], (width, width)) / jnp.sqrt(width) for i in range(layers)]
    bs = [jnp.zeros((width,)) for _ in range(layers)]
    x = jax.random.normal(jax.random.key(1), (*tokens, width))

    def make(hand):
        layer = wrap(lambda w, b, h: jax.nn.gelu(h @ w + b), hand)

        def loss(params, x):
            ws, bs = params
            for w, b in zip(ws, bs):
                x = layer(w, b, x)
            return jnp.mean(x**2)

        return loss

    return Case("plain-JAX loop MLP", make, ((ws, bs), x))


# -- linen: the user's own nn.remat on some blocks, dropout, BatchNorm ---------------------------


class ConvBlock(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x, train: bool = True):
        h = nn.Conv(self.features, (3, 3))(x)
        h = nn.BatchNorm(use_running_average=not train)(h)
        h = nn.Dropout(0.1, deterministic=not train)(nn.relu(h))
        h = nn.Conv(self.features, (3, 3))(h)
        return nn.relu(h + x) if x.shape[-1] == self.features else nn.relu(h)


class LinenCNN(nn.Module):
    """Four blocks, the 2nd and 4th under the user's own ``nn.remat``; ``hand`` puts every
    block under one strategy instead."""

    hand: Any = None
    user_remat: bool = True

    @nn.compact
    def __call__(self, x, train: bool = True):
        for n, f in enumerate((16, 16, 32, 32)):
            if self.hand is not None:  # named as without it, so the same parameters fit
                policy = None if self.hand == FULL else self.hand
                own = self.user_remat and n % 2 == 1
                name = f"CheckpointConvBlock_{n // 2}" if own else f"ConvBlock_{n // 2 if self.user_remat else n}"
                block = nn.remat(ConvBlock, policy=policy, static_argnums=(2,))(f, name=name)
            elif self.user_remat and n % 2 == 1:
                block = nn.remat(ConvBlock, static_argnums=(2,))(f)
            else:
                block = ConvBlock(f)
            x = block(x, train)
        return nn.Dense(10)(jnp.mean(x, axis=(1, 2)))


def linen_cnn(shape: tuple[int, ...] = (8, 32, 32, 3), user_remat: bool = True) -> Case:
    """``user_remat=False``: no block under the user's own ``nn.remat``, so that a hand strategy
    on every block is what the user would otherwise write (jaxremat keeps a user's ``nn.remat``
    as written; a hand strategy replaces it)."""
    x = jax.random.normal(jax.random.key(1), shape)
    y = jax.nn.one_hot(jnp.arange(shape[0]) % 10, 10)
    v = LinenCNN(user_remat=user_remat).init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)

    def make(hand):
        m = LinenCNN(hand=hand, user_remat=user_remat)

        def loss(params, stats, x, key):
            logits, upd = m.apply(
                {"params": params, "batch_stats": stats}, x, rngs={"dropout": key}, mutable=["batch_stats"]
            )
            return -jnp.mean(jnp.sum(y * jax.nn.log_softmax(logits), -1)), upd["batch_stats"]

        return loss

    name = "linen CNN (nn.remat, dropout, BatchNorm)" if user_remat else "linen CNN (dropout, BatchNorm)"
    return Case(name, make, (v["params"], v["batch_stats"], x, jax.random.key(7)), has_aux=True)


# -- linen: a U-Net whose skips are concatenated ---------------------------------------------------


class ConcatUNet(nn.Module):
    hand: Any = None

    @nn.compact
    def __call__(self, x):
        skips = []
        for f in (8, 16, 32):
            x = _Level(f, hand=self.hand)(x)
            skips.append(x)
            x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = _Level(32, hand=self.hand)(x)
        for f, s in zip((32, 16, 8), reversed(skips)):
            x = jax.image.resize(x, (*s.shape[:3], x.shape[-1]), "nearest")
            x = _Level(f, hand=self.hand)(jnp.concatenate([x, s], axis=-1))
        return nn.Conv(3, (1, 1))(x)


class _Level(nn.Module):
    features: int
    hand: Any = None

    @nn.compact
    def __call__(self, x):
        f = self.features
        inner = _Convs if self.hand is None else nn.remat(_Convs, policy=None if self.hand == FULL else self.hand)
        return inner(f, name="_Convs_0")(x)  # named as without the hand strategy: the same parameters fit


class _Convs(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x):
        return nn.gelu(nn.Conv(self.features, (3, 3))(nn.gelu(nn.Conv(self.features, (3, 3))(x))))


def concat_unet(shape: tuple[int, ...] = (4, 32, 32, 3)) -> Case:
    x = jax.random.normal(jax.random.key(1), shape)
    v = ConcatUNet().init(jax.random.key(0), x)

    def make(hand):
        m = ConcatUNet(hand=hand)
        return lambda v, x: jnp.mean((m.apply(v, x) - x) ** 2)

    return Case("linen U-Net (concatenated skips)", make, (v, x))


# -- linen: a decoder written as a Python loop over its blocks -------------------------------------


class DecoderBlock(nn.Module):
    width: int
    heads: int

    @nn.compact
    def __call__(self, x, mask):
        x = x + nn.MultiHeadDotProductAttention(self.heads)(nn.LayerNorm()(x), mask=mask)
        return x + nn.Dense(self.width)(nn.gelu(nn.Dense(4 * self.width)(nn.LayerNorm()(x))))


class LoopDecoder(nn.Module):
    """A GPT as a user writes it in linen: positions and the causal mask in ``__call__``, a Python
    loop over its blocks; ``hand`` puts every block under one strategy."""

    blocks: int = 8
    width: int = 128
    heads: int = 4
    vocab: int = 512
    hand: Any = None

    @nn.compact
    def __call__(self, tokens):
        mask = nn.make_causal_mask(tokens)
        positions = jnp.arange(tokens.shape[1])
        x = nn.Embed(self.vocab, self.width)(tokens) + nn.Embed(tokens.shape[1], self.width)(positions)
        block = DecoderBlock
        if self.hand is not None:
            block = nn.remat(DecoderBlock, policy=None if self.hand == FULL else self.hand)
        for n in range(self.blocks):
            x = block(self.width, self.heads, name=f"DecoderBlock_{n}")(x, mask)  # named as without hand
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def loop_decoder(blocks: int = 8, width: int = 128, tokens: tuple[int, int] = (8, 128), vocab: int = 512) -> Case:
    ids = jax.random.randint(jax.random.key(1), tokens, 0, vocab)
    v = LoopDecoder(blocks, width, vocab=vocab).init(jax.random.key(0), ids)

    def make(hand):
        m = LoopDecoder(blocks, width, vocab=vocab, hand=hand)

        def loss(v, ids):  # next-token cross-entropy
            logits = m.apply(v, ids)[:, :-1]
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], -1))

        return loss

    return Case("linen loop decoder", make, (v, ids))


# -- equinox: a transformer with its blocks in a list, dropout and attention ---------------------


def equinox_transformer(blocks: int = 8, width: int = 64, heads: int = 4, seq: int = 64, batch: int = 4) -> Case:
    import equinox as eqx

    class Block(eqx.Module):
        ln1: eqx.nn.LayerNorm
        attn: eqx.nn.MultiheadAttention
        ln2: eqx.nn.LayerNorm
        up: eqx.nn.Linear
        down: eqx.nn.Linear
        drop: eqx.nn.Dropout

        def __init__(self, key):
            k1, k2, k3 = jax.random.split(key, 3)
            self.ln1, self.ln2 = eqx.nn.LayerNorm(width), eqx.nn.LayerNorm(width)
            self.attn = eqx.nn.MultiheadAttention(heads, width, key=k1)
            self.up, self.down = eqx.nn.Linear(width, 4 * width, key=k2), eqx.nn.Linear(4 * width, width, key=k3)
            self.drop = eqx.nn.Dropout(0.1)

        def __call__(self, x, key):
            k1, k2 = jax.random.split(key)
            h = jax.vmap(self.ln1)(x)
            x = x + self.drop(self.attn(h, h, h), key=k1)
            h = jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(jax.vmap(self.ln2)(x))))
            return x + self.drop(h, key=k2)

    class Model(eqx.Module):
        embed: eqx.nn.Embedding
        blocks: list
        head: eqx.nn.Linear

        def __init__(self, key):
            ks = jax.random.split(key, blocks + 2)
            self.embed = eqx.nn.Embedding(256, width, key=ks[0])
            self.blocks = [Block(k) for k in ks[1:-1]]
            self.head = eqx.nn.Linear(width, 256, key=ks[-1])

    model = Model(jax.random.key(0))
    tok = jax.random.randint(jax.random.key(1), (batch, seq), 0, 256)

    def make(hand):
        def one(x, key, m):  # one sequence
            x = jax.vmap(m.embed)(x)
            keys = jax.random.split(key, len(m.blocks))
            for b, k in zip(m.blocks, keys):
                params, static = eqx.partition(b, eqx.is_array)
                x = wrap(lambda p, x, k, static=static: eqx.combine(p, static)(x, k), hand)(params, x, k)
            return jax.vmap(m.head)(x)

        def loss(m, tok, key):
            logits = jax.vmap(one, in_axes=(0, 0, None))(tok, jax.random.split(key, tok.shape[0]), m)
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tok[..., None], -1))

        return loss

    return Case(
        "equinox list transformer (dropout, attention)", make, (model, tok, jax.random.key(3)), extra={"eqx": True}
    )


# -- NNX: blocks in an nnx.List ------------------------------------------------------------------


def nnx_list(blocks: int = 6, width: int = 64, batch: int = 128) -> Case:
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.norm = nnx.LayerNorm(width, rngs=rngs)
            self.up = nnx.Linear(width, 4 * width, rngs=rngs)
            self.down = nnx.Linear(4 * width, width, rngs=rngs)

        def __call__(self, x):
            return x + self.down(nnx.gelu(self.up(self.norm(x))))

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([Block(rngs) for _ in range(blocks)])
            self.head = nnx.Linear(width, 1, rngs=rngs)

        def __call__(self, x, hand=None):
            for b in self.blocks:
                if hand is None:
                    x = b(x)
                else:
                    x = nnx.remat(lambda b, x: b(x), policy=None if hand == FULL else hand)(b, x)
            return self.head(x)

    model = Model(nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    x = jax.random.normal(jax.random.key(1), (batch, 32, width))

    def make(hand):
        return lambda state, x: jnp.mean(nnx.merge(graphdef, state)(x, hand) ** 2)

    return Case("NNX nnx.List", make, (state, x), extra={"model": model})


CASES: dict[str, Callable[[], Case]] = {
    "loop_mlp": loop_mlp,
    "loop_decoder": loop_decoder,
    "linen_cnn": linen_cnn,
    "linen_cnn_plain": lambda: linen_cnn(user_remat=False),
    "concat_unet": concat_unet,
    "equinox": equinox_transformer,
    "nnx_list": nnx_list,
}
