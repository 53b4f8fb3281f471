"""The codec interface, the wire format's block view, and the registry.

A codec works on blocks of B elements. Its wire format is one uint8 array of shape
(n_blocks, row_bytes): each row holds the block's codes followed by its fp32 scale(s), so
payload and metadata travel in one buffer and the decoder finds the scales by offset.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


@runtime_checkable
class Codec(Protocol):
    """What the collectives and kernels need of a compression scheme.

    `compress_reference` / `decompress_reference` are the plain-jnp definitions of the
    wire format ((rows, B) float ↔ (rows, row_bytes) uint8); `has_kernel` says whether the
    fused GPU kernels implement the same format. `is_identity` codecs are never applied:
    the collectives use the exact lax operation instead."""
    name: str
    block_size: int

    @property
    def row_bytes(self) -> int: ...
    @property
    def has_kernel(self) -> bool: ...
    @property
    def is_identity(self) -> bool: ...
    def wire_bytes(self, n: int) -> int: ...
    def compress_reference(self, x: jax.Array) -> jax.Array: ...
    def decompress_reference(self, w: jax.Array, out_dtype: Any = jnp.float32) -> jax.Array: ...
    def encode(self, x: jax.Array) -> "Encoded": ...
    def decode(self, enc: "Encoded") -> jax.Array: ...
    def roundtrip(self, x: jax.Array) -> jax.Array: ...
    def replace(self, **kw: Any) -> "Codec": ...


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


class WireCodec:
    """encode / decode / roundtrip for a codec dataclass that defines the references and
    `row_bytes`; compress and decompress go through the kernel dispatcher."""

    is_identity = False

    def wire_bytes(self, n: int) -> int:
        return n_blocks(n, self.block_size) * self.row_bytes

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)

    def encode(self, x) -> Encoded:
        from taco_jax.kernels import dispatch
        x = jnp.asarray(x)
        check_float(x)
        return Encoded(dispatch.compress(to_blocks(x, self.block_size), self), x.shape, x.dtype)

    def decode(self, enc: Encoded) -> jax.Array:
        from taco_jax.kernels import dispatch
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


# -- registry -----------------------------------------------------------------
_REGISTRY: dict[str, Callable[..., Codec]] = {}


def register(name: str, factory: Callable[..., Codec]) -> None:
    """Make `get(name, **overrides)` return `factory(**overrides)`."""
    _REGISTRY[name] = factory


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get(codec: "str | Codec", **overrides: Any) -> Codec:
    """Codec by name (or pass a codec object through). `overrides` e.g. block_size=128."""
    if not isinstance(codec, str):
        if not isinstance(codec, Codec):
            raise TypeError(f"codec={codec!r} is neither a codec name ({', '.join(_REGISTRY)}) "
                            f"nor an object implementing taco_jax.codecs.Codec")
        return codec.replace(**overrides) if overrides else codec
    try:
        factory = _REGISTRY[codec]
    except KeyError:
        raise ValueError(f"unknown codec {codec!r}; known: {', '.join(_REGISTRY)}") from None
    return factory(**overrides)
