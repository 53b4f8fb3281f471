"""Codec registry: one object per compression scheme, with encode / decode / roundtrip.

A codec works on blocks of B elements. Its wire format is one uint8 array of shape
(n_blocks, row_bytes): each row holds the block's B codes followed by its fp32 scale(s)
(paper §4.4.2, "zero-copy metadata": payload and scales travel in one buffer and decode
finds the scales by offset). Row layout for TACO (B = 256): bytes [0, 256) FP8 E4M3 codes
of the Hadamard coefficients in wire order (see `hadamard`), [256, 260) the quantization
scale s (eq. 9), [260, 264) the adaptive scale α (eq. 7). Single-scale codecs drop α.

Per-tensor-scale baselines ("fp8", "hadamard-fp8") compute one scale over the whole array
they are given (in a collective: over each device's tensor) and repeat it in every row, so
they share the wire format and decoder of the block codecs at 4 bytes per block.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from taco_jax import hadamard

FORMATS = {  # code format -> (Qmax, code dtype)
    "e4m3": (448.0, jnp.float8_e4m3fn),
    "e5m2": (57344.0, jnp.float8_e5m2),
    "int8": (127.0, jnp.int8),
}
TRANSFORMS = ("none", "hadamard", "ash")
SCALE_MODES = ("block", "tensor")
FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


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


@dataclasses.dataclass(frozen=True)
class Codec:
    """Block transform + scaling + code format. See module docstring for the wire format."""
    name: str
    transform: str = "ash"          # "none" | "hadamard" | "ash" (adaptive scale–Hadamard)
    scale_mode: str = "block"       # "block" (per-block absmax, eq. 9) | "tensor"
    fmt: str = "e4m3"               # "e4m3" | "e5m2" | "int8"
    block_size: int = 256           # paper's best B (Table 2)

    def __post_init__(self):
        object.__setattr__(self, "block_size", hadamard.check_block_size(self.block_size))
        if self.transform not in TRANSFORMS:
            raise ValueError(f"transform={self.transform!r} must be one of {TRANSFORMS}")
        if self.scale_mode not in SCALE_MODES:
            raise ValueError(f"scale_mode={self.scale_mode!r} must be one of {SCALE_MODES}")
        if self.fmt not in FORMATS:
            raise ValueError(f"fmt={self.fmt!r} must be one of {tuple(FORMATS)}")

    # -- static layout facts -------------------------------------------------
    @property
    def is_identity(self) -> bool:
        return False

    @property
    def qmax(self) -> float:
        return FORMATS[self.fmt][0]

    @property
    def code_dtype(self):
        return FORMATS[self.fmt][1]

    @property
    def n_scales(self) -> int:
        return 2 if self.transform == "ash" else 1   # dual scale: (s, α)

    @property
    def row_bytes(self) -> int:
        return self.block_size + 4 * self.n_scales

    @property
    def has_kernel(self) -> bool:
        """Fused Pallas kernels exist for per-block codecs; per-tensor baselines use XLA."""
        return self.scale_mode == "block"

    def wire_bytes(self, n: int) -> int:
        return n_blocks(n, self.block_size) * self.row_bytes

    def replace(self, **kw) -> "Codec":
        return dataclasses.replace(self, **kw)

    # -- public API ----------------------------------------------------------
    def encode(self, x) -> Encoded:
        from taco_jax import dispatch
        x = jnp.asarray(x)
        check_float(x)
        return Encoded(dispatch.compress(to_blocks(x, self.block_size), self), x.shape, x.dtype)

    def decode(self, enc: Encoded) -> jax.Array:
        from taco_jax import dispatch
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


def n_blocks(n: int, block_size: int) -> int:
    """Rows of the wire buffer for n elements (an empty tensor still sends one row)."""
    return max(1, -(-n // block_size))


@dataclasses.dataclass(frozen=True)
class Identity:
    """"none": no compression. encode keeps the values (as float32 bytes per row)."""
    name: str = "none"
    block_size: int = 256

    is_identity = True
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

    def encode(self, x) -> Encoded:
        x = jnp.asarray(x)
        check_float(x)
        b = to_blocks(x, self.block_size).astype(jnp.float32)
        data = jax.lax.bitcast_convert_type(b, jnp.uint8).reshape(b.shape[0], -1)
        return Encoded(data, x.shape, x.dtype)

    def decode(self, enc: Encoded) -> jax.Array:
        b = jax.lax.bitcast_convert_type(
            enc.data.reshape(enc.data.shape[0], self.block_size, 4), jnp.float32)
        return from_blocks(b.astype(enc.dtype), enc.shape)

    def roundtrip(self, x) -> jax.Array:
        x = jnp.asarray(x)
        check_float(x)
        return x


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


# -- registry -----------------------------------------------------------------
_REGISTRY: dict[str, Callable[..., Any]] = {}


def register(name: str, factory: Callable[..., Any]) -> None:
    _REGISTRY[name] = factory


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get(codec, **overrides):
    """Codec by name (or pass a codec object through). `overrides` e.g. block_size=128."""
    if not isinstance(codec, str):
        if overrides:
            return codec.replace(**overrides)
        return codec
    try:
        factory = _REGISTRY[codec]
    except KeyError:
        raise ValueError(f"unknown codec {codec!r}; known: {', '.join(_REGISTRY)}") from None
    return factory(**overrides)


def _codec(name, **fields):
    return lambda **kw: Codec(name=name, **{**fields, **kw})


register("taco", _codec("taco", transform="ash", fmt="e4m3"))
register("taco-e5m2", _codec("taco-e5m2", transform="ash", fmt="e5m2"))
register("taco-int8", _codec("taco-int8", transform="ash", fmt="int8"))
register("taco-1scale", _codec("taco-1scale", transform="hadamard", fmt="e4m3"))
register("fp8", _codec("fp8", transform="none", scale_mode="tensor", fmt="e4m3"))
register("block-fp8", _codec("block-fp8", transform="none", fmt="e4m3"))
register("hadamard-fp8", _codec("hadamard-fp8", transform="hadamard", scale_mode="tensor"))
register("none", lambda **kw: Identity(**kw))

Taco = _REGISTRY["taco"]

# Echo's 4-bit codecs register themselves; imported last so taco_jax.echo finds every name
# above even when it is imported first (then this import returns the partly built module).
from taco_jax import echo as _echo  # noqa: E402,F401
