"""The codec interface (`Codec`) and the registry of codecs by name (`taco_jax.codecs`
re-exports them): below the codec families and the kernels, so that the recipe checks codec
names without loading either."""
from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

import jax
import jax.numpy as jnp


@runtime_checkable
class Codec(Protocol):
    """What the collectives and kernels need of a compression scheme.

    `compress_reference` / `decompress_reference` are the plain-jnp definitions of the
    wire format ((rows, B) float ↔ (rows, row_bytes) uint8); `kernels` is the codec
    family's kernel provider (`taco_jax.kernels.providers`: which fused GPU kernels
    implement the same format), or None, and `has_kernel` says whether it has one.
    `is_identity` codecs are never applied: the collectives use the exact lax operation
    instead."""
    name: str
    block_size: int

    @property
    def row_bytes(self) -> int: ...
    @property
    def kernels(self) -> Any: ...
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


_REGISTRY: dict[str, Callable[..., Codec]] = {}


def family(codec: Codec) -> str | None:
    """The name of the codec's kernel family (its provider's `name`: "taco", "echo4"), or
    None for a codec without kernels. The kernels check the codecs they are given by it, so
    they need not import the providers that load them."""
    return None if codec.kernels is None else codec.kernels.name


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
