"""Baselines: no compression ("none") and 8-bit codecs without the adaptive transform.

"fp8" (one E4M3 scale per tensor), "block-fp8" (one per block), "hadamard-fp8" (Hadamard,
one scale per tensor): the comparisons of the codec ablation."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from taco_jax.codecs.base import Encoded, check_float, from_blocks, n_blocks, register, to_blocks
from taco_jax.codecs.taco import family
from taco_jax.numerics import hadamard


@dataclasses.dataclass(frozen=True)
class Identity:
    """"none": no compression. The collectives use lax's exact operations for it; encode keeps
    the values (as float32 bytes per row), so the codec interface holds for it too."""
    name: str = "none"
    block_size: int = 256

    is_identity = True
    kernels = None
    has_kernel = False

    def __post_init__(self):
        object.__setattr__(self, "block_size", hadamard.check_block_size(self.block_size))

    @property
    def row_bytes(self) -> int:
        return 4 * self.block_size

    def wire_bytes(self, n: int) -> int:
        return n_blocks(n, self.block_size) * self.row_bytes

    def replace(self, **kw) -> "Identity":
        return dataclasses.replace(self, **kw)

    def compress_reference(self, x):
        x = x.astype(jnp.float32)
        return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(x.shape[0], -1)

    def decompress_reference(self, w, out_dtype=jnp.float32):
        b = jax.lax.bitcast_convert_type(w.reshape(w.shape[0], self.block_size, 4), jnp.float32)
        return b.astype(out_dtype)

    def encode(self, x) -> Encoded:
        x = jnp.asarray(x)
        check_float(x)
        return Encoded(self.compress_reference(to_blocks(x, self.block_size)), x.shape, x.dtype)

    def decode(self, enc: Encoded) -> jax.Array:
        return from_blocks(self.decompress_reference(enc.data, enc.dtype), enc.shape)

    def roundtrip(self, x) -> jax.Array:
        x = jnp.asarray(x)
        check_float(x)
        return x


register("fp8", family("fp8", transform="none", scale_mode="tensor", fmt="e4m3"))
register("block-fp8", family("block-fp8", transform="none", fmt="e4m3"))
register("hadamard-fp8", family("hadamard-fp8", transform="hadamard", scale_mode="tensor"))
register("none", lambda **kw: Identity(**kw))
