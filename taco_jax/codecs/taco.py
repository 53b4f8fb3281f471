"""TACO and its variants: block transform + per-block scaling + an 8-bit code format.

"taco" is the adaptive scale–Hadamard transform (ASH) with dual-scale FP8 E4M3 codes.
Row layout for B = 256: bytes [0, 256) the codes of the Hadamard coefficients in wire order
(see `taco_jax.numerics.hadamard`), [256, 260) the quantization scale s (eq. 9),
[260, 264) the adaptive scale α (eq. 7). Single-scale variants drop α.

Per-tensor-scale configurations ("fp8", "hadamard-fp8" in `baselines`) compute one scale
over the whole array they are given (in a collective: over each device's tensor) and repeat
it in every row, so they share this wire format and decoder at 4 bytes per block.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from taco_jax.codecs.base import WireCodec, register
from taco_jax.numerics import hadamard

FORMATS = {  # code format -> (Qmax, code dtype)
    "e4m3": (448.0, jnp.float8_e4m3fn),
    "e5m2": (57344.0, jnp.float8_e5m2),
    "int8": (127.0, jnp.int8),
}
TRANSFORMS = ("none", "hadamard", "ash")
SCALE_MODES = ("block", "tensor")


@dataclasses.dataclass(frozen=True)
class BlockCodec(WireCodec):
    """Block transform + scaling + code format. See the module docstring for the wire rows."""
    name: str
    transform: str = "ash"          # "none" | "hadamard" | "ash" (adaptive scale–Hadamard)
    scale_mode: str = "block"       # "block" (per-block absmax, eq. 9) | "tensor"
    fmt: str = "e4m3"               # "e4m3" | "e5m2" | "int8"
    block_size: int = 256           # B = 256 has the lowest error among 64..512 (TACO Table 2)

    def __post_init__(self):
        object.__setattr__(self, "block_size", hadamard.check_block_size(self.block_size))
        if self.transform not in TRANSFORMS:
            raise ValueError(f"transform={self.transform!r} must be one of {TRANSFORMS}")
        if self.scale_mode not in SCALE_MODES:
            raise ValueError(f"scale_mode={self.scale_mode!r} must be one of {SCALE_MODES}")
        if self.fmt not in FORMATS:
            raise ValueError(f"fmt={self.fmt!r} must be one of {tuple(FORMATS)}")

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
        """The fused kernels implement per-block scaling; a per-tensor scale is one global
        reduction that XLA fuses well, so those configurations use the reference."""
        return self.scale_mode == "block"

    def compress_reference(self, x):
        from taco_jax.kernels.compress import compress_reference
        return compress_reference(x, self)

    def decompress_reference(self, w, out_dtype=jnp.float32):
        from taco_jax.kernels.decompress import decompress_reference
        return decompress_reference(w, self, out_dtype)


def family(name: str, **fields):
    """A registry factory for a BlockCodec configuration (overrides such as block_size)."""
    return lambda **kw: BlockCodec(name=name, **{**fields, **kw})


register("taco", family("taco", transform="ash", fmt="e4m3"))
register("taco-e5m2", family("taco-e5m2", transform="ash", fmt="e5m2"))
register("taco-int8", family("taco-int8", transform="ash", fmt="int8"))
register("taco-1scale", family("taco-1scale", transform="hadamard", fmt="e4m3"))
