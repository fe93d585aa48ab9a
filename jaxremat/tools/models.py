"""Example Flax linen models written as sequences of blocks, for the demo, benchmarks and examples.

Each factory returns an ``nn.Sequential`` that :func:`jaxremat.remat_chain` and
:meth:`jaxremat.Chain.from_linen` accept; :data:`SAMPLES` gives the input each was sized for
(small enough that a training step runs on a laptop CPU in well under a second).
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxremat.model.repeat import Repeat


# -- ResNet-style CNN -----------------------------------------------------------------------------


class ResidualBlock(nn.Module):
    """Two 3x3 convolutions with a skip connection; ``stride`` 2 halves the resolution."""

    features: int
    stride: int = 1

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        s = (self.stride, self.stride)
        h = nn.relu(nn.GroupNorm(num_groups=4)(nn.Conv(self.features, (3, 3), strides=s)(x)))
        h = nn.GroupNorm(num_groups=4)(nn.Conv(self.features, (3, 3))(h))
        if x.shape[-1] != self.features or self.stride != 1:
            x = nn.Conv(self.features, (1, 1), strides=s)(x)
        return nn.relu(x + h)


class Stem(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.relu(nn.Conv(self.features, (3, 3))(x))


class ClassifierHead(nn.Module):
    classes: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(self.classes)(x.mean(axis=tuple(range(1, x.ndim - 1))))


def resnet(blocks: tuple[int, ...] = (2, 2, 2), width: int = 16, classes: int = 10) -> nn.Sequential:
    """A ResNet-style CNN: a stem, residual blocks in groups (each group after the first halves
    the resolution and doubles the width), and a pooled classifier head. Input ``(B, H, W, C)``."""
    layers: list[Any] = [Stem(width)]
    for g, n in enumerate(blocks):
        for b in range(n):
            layers.append(ResidualBlock(width * 2**g, stride=2 if g and b == 0 else 1))
    layers.append(ClassifierHead(classes))
    return nn.Sequential(layers)


# -- GPT-style decoder ----------------------------------------------------------------------------


class Embed(nn.Module):
    vocab: int
    width: int
    max_len: int = 4096

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        pos = self.param("pos", nn.initializers.normal(0.02), (self.max_len, self.width))
        return nn.Embed(self.vocab, self.width)(tokens) + pos[: tokens.shape[-1]]


class DecoderBlock(nn.Module):
    """Pre-norm causal self-attention and a 4x MLP, each with a residual connection."""

    width: int
    heads: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.LayerNorm()(x)
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h, mask=mask)
        h = nn.LayerNorm()(x)
        return x + nn.Dense(self.width)(nn.gelu(nn.Dense(4 * self.width)(h)))


class LMHead(nn.Module):
    vocab: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def gpt(
    blocks: int = 12, width: int = 128, heads: int = 4, vocab: int = 512, *, stacked: bool = False
) -> nn.Sequential:
    """A GPT-2-style decoder: token and position embedding, ``blocks`` decoder blocks, a language
    model head. Input: integer tokens ``(B, T)``; output logits ``(B, T, vocab)``.

    ``stacked=True`` writes the blocks as one :class:`~jaxremat.Repeat` (parameters stacked, as
    with ``nn.scan``) instead of ``blocks`` separate layers."""
    body = (
        [Repeat(DecoderBlock(width, heads), blocks)] if stacked else [DecoderBlock(width, heads) for _ in range(blocks)]
    )
    return nn.Sequential([Embed(vocab, width), *body, LMHead(vocab)])


#: The ``remat`` settings of :class:`ScanDecoder`, as MaxText's ``remat_policy`` names its
#: choices: ``None`` no remat, ``"full"`` a plain ``nn.remat``, else a ``jax.checkpoint_policies`` name.
SCAN_REMAT = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")


class _ScanBody(nn.Module):
    width: int
    heads: int

    @nn.compact
    def __call__(self, x: jax.Array, _: Any) -> tuple[jax.Array, None]:
        return DecoderBlock(self.width, self.heads)(x), None


class ScanDecoder(nn.Module):
    """:func:`gpt` written as large JAX models are: its blocks one ``nn.scan`` over stacked
    parameters, with the user's own ``nn.remat`` around the scanned block when ``remat`` (one of
    :data:`SCAN_REMAT`) says so. Input: integer tokens ``(B, T)``."""

    blocks: int = 12
    width: int = 128
    heads: int = 4
    vocab: int = 512
    remat: str = "none"

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        if self.remat not in SCAN_REMAT:
            raise ValueError(f"ScanDecoder: remat must be one of {SCAN_REMAT}, got {self.remat!r}")
        body: Any = _ScanBody
        if self.remat != "none":
            policy = None if self.remat == "full" else getattr(jax.checkpoint_policies, self.remat)
            body = nn.remat(body, policy=policy, prevent_cse=False)  # inside a scan, as MaxText writes it
        scan = nn.scan(body, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.blocks)
        x, _ = scan(self.width, self.heads, name="layers")(Embed(self.vocab, self.width)(tokens), None)
        return LMHead(self.vocab)(x)


# -- a strongly heterogeneous chain: a convolutional autoencoder ------------------------------------


class Down(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.gelu(nn.Conv(self.features, (3, 3), strides=(2, 2))(x))


class Up(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.gelu(nn.ConvTranspose(self.features, (3, 3), strides=(2, 2))(x))


class Conv(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.gelu(nn.Conv(self.features, (3, 3))(x))


def autoencoder(width: int = 16, depth: int = 3, channels: int = 3) -> nn.Sequential:
    """An hourglass: full-resolution convolutions, ``depth`` downsamplings that double the width,
    as many upsamplings back, and a projection to ``channels``. Activation sizes vary by
    ``2**depth`` along the chain. Input ``(B, H, W, channels)``, H and W divisible by ``2**depth``."""
    layers: list[Any] = [Conv(width), Conv(width)]
    layers += [Down(width * 2 ** (d + 1)) for d in range(depth)]
    layers += [Conv(width * 2**depth)]
    layers += [Up(width * 2 ** (depth - d - 1)) for d in range(depth)]
    layers += [Conv(width), nn.Conv(channels, (1, 1))]
    return nn.Sequential(layers)


# -- MLP-Mixer --------------------------------------------------------------------------------------


class PatchEmbed(nn.Module):
    patch: int
    width: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        p = (self.patch, self.patch)
        x = nn.Conv(self.width, p, strides=p)(x)
        return x.reshape(x.shape[0], -1, x.shape[-1])


class MixerBlock(nn.Module):
    """Token mixing then channel mixing, each a 2-layer MLP with a residual connection."""

    token_hidden: int
    channel_hidden: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.LayerNorm()(x).swapaxes(1, 2)
        h = nn.Dense(x.shape[1])(nn.gelu(nn.Dense(self.token_hidden)(h)))
        x = x + h.swapaxes(1, 2)
        h = nn.LayerNorm()(x)
        return x + nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(self.channel_hidden)(h)))


def mixer(blocks: int = 8, patch: int = 4, width: int = 128, classes: int = 10) -> nn.Sequential:
    """An MLP-Mixer: patch embedding, ``blocks`` mixer blocks, a pooled classifier head.
    Input ``(B, H, W, C)`` with H and W divisible by ``patch``."""
    return nn.Sequential(
        [PatchEmbed(patch, width), *[MixerBlock(2 * width, 4 * width) for _ in range(blocks)], ClassifierHead(classes)]
    )


# -- inputs ------------------------------------------------------------------------------------------

#: name -> (factory, input shape, input dtype): the sizes the benchmarks and demo use.
SAMPLES: dict[str, tuple[Callable[..., nn.Module], tuple[int, ...], str]] = {
    "resnet": (resnet, (16, 32, 32, 3), "float32"),
    "gpt": (gpt, (4, 128), "int32"),
    "autoencoder": (autoencoder, (8, 64, 64, 3), "float32"),
    "mixer": (mixer, (16, 32, 32, 3), "float32"),
    "scan_decoder": (ScanDecoder, (4, 128), "int32"),
}


def sample_input(shape: tuple[int, ...], dtype: str = "float32", seed: int = 0, high: int = 2) -> jax.Array:
    """A deterministic input of ``shape``: standard normal floats, or integers in ``[0, high)``."""
    key = jax.random.key(seed)
    if jnp.issubdtype(jnp.dtype(dtype), jnp.integer):
        return jax.random.randint(key, shape, 0, high, dtype=dtype)
    return jax.random.normal(key, shape, dtype=dtype)
