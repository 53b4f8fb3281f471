"""Kernel providers: which fused GPU kernels a codec family has, for which calls, which
implementation runs each, and its tile codec.

A codec names its family's provider (`Codec.kernels`: `TACO`, `ECHO4`, or None for codecs
that run their jnp references only); the dispatcher and the kernels that move wire tiles
themselves (`kernels.tile_codec`) ask that provider rather than knowing the families, so a
new codec family brings its kernels with a provider of its own. A provider's kernels read
the fields its family's codecs declare (TACO: `codecs.BlockCodec`'s transform, fmt, qmax,
code_dtype, n_scales; ECHO4: `codecs.Echo`'s symmetric).
Providers import their kernels when one is first built: the Pallas-Triton kernels import
`jax.experimental.pallas.triton`, which jax deprecates from 0.11 on. Where that module is
missing (`triton_missing`, which warns once), a provider has no Triton kernels and the
dispatcher runs the Mosaic GPU kernels where they cover a call, the references elsewhere.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Callable

# every kernel a codec family may provide (`KernelProvider.kernel`)
CODEC_KERNELS = ("compress", "decompress", "reduce", "decode_sum", "compress_feedback")
TRITON_MODULE = "jax.experimental.pallas.triton"


@functools.cache
def triton_missing() -> str | None:
    """Why the Pallas-Triton kernels cannot be built here (None: they can). The first call
    that finds the module missing warns."""
    try:
        from jax.experimental.pallas import triton  # noqa: F401
    except ImportError as err:
        why = f"{TRITON_MODULE} cannot be imported ({err})"
        warnings.warn(f"taco_jax: {why}; the codec kernels run as Mosaic GPU kernels where "
                      f"those cover a call and as jnp references elsewhere", RuntimeWarning,
                      stacklevel=2)
        return why
    return None


@dataclasses.dataclass(frozen=True)
class KernelProvider:
    """A codec family's kernels.

    name: the family, for messages. triton: loads {kernel name: function} of its
    Pallas-Triton kernels (from `CODEC_KERNELS`; compress_feedback only where it has a
    kernel of its own). mosaic: loads ({kernel name: function} of its Mosaic GPU kernels, their
    `unsupported(kernel, codec, shape, dtype)`), or None where it has none. tiles: loads
    its tile-codec class (`kernels.tile_codec.TileCodec`: made as cls(codec, **options)),
    or None where it has none. The loaders run when a kernel is first asked for."""
    name: str
    triton: Callable[[], dict]
    mosaic: Callable[[], tuple[dict, Callable]] | None = None
    tiles: Callable[[], type] | None = None

    def kernel(self, kernel: str, impl: str) -> Callable | None:
        """The function of `kernel` in implementation `impl` ("triton" or "mosaic"), or
        None where the family has none (or Triton is missing here)."""
        if kernel not in CODEC_KERNELS:
            raise ValueError(f"{self.name} kernels: unknown kernel {kernel!r} "
                             f"({CODEC_KERNELS})")
        if impl == "mosaic":
            return None if self.mosaic is None else self.mosaic()[0].get(kernel)
        if impl != "triton":
            raise ValueError(f"{self.name} kernels: impl={impl!r} is not 'triton' or 'mosaic'")
        return None if triton_missing() is not None else self.triton().get(kernel)

    def mosaic_unsupported(self, kernel: str, codec, shape, dtype) -> str | None:
        """Why no Mosaic GPU kernel covers this call (None: one does). dtype: compress's
        input, decompress's output, reduce's own data."""
        if self.mosaic is None:
            return f"{self.name}: no Mosaic GPU kernels"
        return self.mosaic()[1](kernel, codec, shape, dtype)


@functools.cache
def _taco_triton() -> dict:
    from taco_jax.kernels.triton import compress, decode_sum, decompress, reduce
    return {"compress": compress.compress, "decompress": decompress.decompress,
            "reduce": reduce.reduce, "decode_sum": decode_sum.decode_sum}


@functools.cache
def _taco_mosaic() -> tuple[dict, Callable]:
    from taco_jax.kernels.mosaic import taco, taco_tiles
    return {"compress": taco.compress, "decompress": taco.decompress}, taco_tiles.unsupported


def _taco_tiles() -> type:
    from taco_jax.kernels.mosaic import taco_tiles
    return taco_tiles.TacoTiles


@functools.cache
def _echo4_triton() -> dict:
    from taco_jax.kernels.triton import echo4
    return {k: getattr(echo4, k) for k in CODEC_KERNELS}


def _echo4_tiles() -> type:
    from taco_jax.kernels.mosaic import echo4
    return echo4.Echo4Tiles


# The TACO codecs with per-block scales: Triton kernels for every block size and dtype,
# Mosaic GPU compress and decompress and the tile codec for the B = 256 Hadamard FP8 codecs.
TACO = KernelProvider("taco", _taco_triton, _taco_mosaic, _taco_tiles)
# Echo's 4-bit codecs (echo4, int4-sym): Triton kernels, compress_feedback among them; the
# tile codec for echo4.
ECHO4 = KernelProvider("echo4", _echo4_triton, tiles=_echo4_tiles)
