"""The block view of a tensor that every codec and kernel works on: float dtypes checked,
flattened and zero-padded to whole blocks of B values, and back."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def check_float(x, what: str = "x") -> None:
    dt = jnp.result_type(x)
    if dt not in FLOAT_DTYPES:
        raise TypeError(
            f"{what} has dtype {dt}; taco_jax codecs take float32, bfloat16 or float16 "
            "(integer and bool tensors cannot be quantized: use lax.psum for them)")


def n_blocks(n: int, block_size: int) -> int:
    """Rows of the wire buffer for n elements (an empty tensor still sends one row)."""
    return max(1, -(-n // block_size))


def to_blocks(x: jax.Array, block_size: int) -> jax.Array:
    """Flatten and zero-pad to whole blocks: (n,) → (n_blocks, B). Zero padding quantizes to
    exact zeros and is sliced off by `from_blocks`, so it never leaks into results."""
    flat = x.reshape(-1)
    pad = (-flat.size) % block_size
    if pad or flat.size == 0:
        flat = jnp.pad(flat, (0, pad if flat.size else block_size))
    return flat.reshape(-1, block_size)                        # (n_blocks, B)


def from_blocks(blocks: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    n = math.prod(shape)
    flat = blocks.reshape(-1)
    return (flat if flat.size == n else flat[:n]).reshape(shape)
