"""``Repeat(block, length)``: ``length`` copies of a block with stacked parameters, as ``nn.scan`` lays them out."""

from __future__ import annotations

import flax.linen as nn

BODY = "body"  # the name of the scanned block under a Repeat's variables


class Repeat(nn.Module):
    """``length`` copies of ``block`` applied in turn, their variables stacked on a leading axis.

    On its own it is the usual scanned stack of layers (``nn.scan`` over ``block``, every
    collection stacked on axis 0, every RNG stream split), storing every activation. Inside a
    model wrapped by :func:`jaxremat.remat_chain` (or a :class:`jaxremat.Chain`) it counts as
    ``length`` stages, and runs of them that the schedule treats alike execute as one
    ``lax.scan`` over the stacked variables, so the step's compile time stays flat with depth.

    ``block`` maps an activation to one of the same shapes and dtypes (the scan carry). Its
    variables live under ``{collection: {"body": ...}}`` with a leading axis of ``length``.
    """

    block: nn.Module
    length: int

    def __post_init__(self) -> None:
        if not isinstance(self.length, int) or self.length < 1:
            raise ValueError(f"Repeat: length must be a positive int, got {self.length!r}")
        if not isinstance(self.block, nn.Module):
            raise ValueError(f"Repeat: block must be a linen module instance, got {type(self.block).__name__}")
        super().__post_init__()

    @nn.compact
    def __call__(self, x):
        def body(module: nn.Module, carry, _):
            return self.block.clone(parent=module, name=BODY)(carry), None

        scanned = nn.scan(body, variable_axes={True: 0}, split_rngs={True: True}, length=self.length)
        return scanned(self, x, None)[0]
