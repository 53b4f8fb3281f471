"""The wire format's block view and `WireCodec`, the encode / decode / roundtrip that codecs
built on the kernel dispatcher share.

A codec works on blocks of B elements. Its wire format is one uint8 array of shape
(n_blocks, row_bytes): each row holds the block's codes followed by its fp32 scale(s), so
payload and metadata travel in one buffer and the decoder finds the scales by offset.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from taco_jax.codec_registry import Codec, get, names, register  # noqa: F401
from taco_jax.kernels import dispatch
from taco_jax.numerics.blocks import (FLOAT_DTYPES, check_float, from_blocks,  # noqa: F401
                                      n_blocks, to_blocks)


@dataclasses.dataclass(frozen=True)
class Encoded:
    """A compressed tensor: the wire buffer plus the static facts needed to decode it."""
    data: jax.Array                 # (n_blocks, row_bytes) uint8
    shape: tuple[int, ...]
    dtype: Any

    @property
    def size(self) -> int:
        return math.prod(self.shape)


jax.tree_util.register_dataclass(Encoded, data_fields=["data"], meta_fields=["shape", "dtype"])


class WireCodec:
    """encode / decode / roundtrip for a codec dataclass that defines the references and
    `row_bytes`; compress and decompress go through the kernel dispatcher."""

    is_identity = False

    @property
    def has_kernel(self) -> bool:
        return self.kernels is not None

    def wire_bytes(self, n: int) -> int:
        return n_blocks(n, self.block_size) * self.row_bytes

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)

    def encode(self, x) -> Encoded:
        x = jnp.asarray(x)
        check_float(x)
        return Encoded(dispatch.compress(to_blocks(x, self.block_size), self), x.shape, x.dtype)

    def decode(self, enc: Encoded) -> jax.Array:
        if enc.data.shape != (n_blocks(enc.size, self.block_size), self.row_bytes):
            raise ValueError(f"{self.name}: wire buffer of shape {enc.data.shape} does not fit "
                             f"{enc.shape=} (expected rows of {self.row_bytes} bytes)")
        blocks = dispatch.decompress(enc.data, self, out_dtype=enc.dtype)
        return from_blocks(blocks, enc.shape)

    def roundtrip(self, x) -> jax.Array:
        """decode(encode(x)); differentiable with the straight-through gradient (identity),
        since the wire buffer itself is integer and carries no gradient."""
        x = jnp.asarray(x)
        check_float(x)
        return _straight_through(self, x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _straight_through(codec, x):
    return codec.decode(codec.encode(x))


_straight_through.defvjp(lambda codec, x: (_straight_through(codec, x), None),
                         lambda codec, _, g: (g,))
