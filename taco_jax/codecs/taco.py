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
from taco_jax.kernels import providers
from taco_jax.numerics import hadamard, quant

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
    def kernels(self):
        """The fused kernels (`providers.TACO`) implement per-block scaling; a per-tensor
        scale is one global reduction that XLA fuses well, so those configurations use the
        reference."""
        return providers.TACO if self.scale_mode == "block" else None

    def compress_reference(self, x):
        """Plain-jnp compress, following the paper's order of operations in f32."""
        x = x.astype(jnp.float32)
        bad = quant.nonfinite_rows(x)
        scales = []
        if self.transform == "ash":
            a = quant.alpha(x, bad)                                    # eqs. 6–7
            x = x * a
        z = x if self.transform == "none" else hadamard.forward(x)     # eq. 8
        absmax = jnp.max(jnp.abs(z), axis=1, keepdims=True)
        if self.scale_mode == "tensor":
            absmax = jnp.broadcast_to(jnp.max(absmax), absmax.shape)
            bad = jnp.broadcast_to(jnp.any(bad), bad.shape)
        s = quant.scale(absmax, self.qmax, bad)                        # eq. 9
        codes = quant.quantize(z, s, self.qmax, self.code_dtype)       # eq. 10
        scales = [s, a] if self.transform == "ash" else [s]
        return quant.seal(jnp.concatenate([codes, quant.pack_scales(scales)], axis=1))

    def decompress_reference(self, w, out_dtype=jnp.float32):
        """Plain-jnp decompress, eqs. 11–13 in the paper's order, f32."""
        if w.ndim != 2 or w.shape[1] != self.row_bytes:
            raise ValueError(f"decompress: got {w.shape=} for {self.name} (rows of "
                             f"{self.row_bytes} bytes)")
        b = self.block_size
        q = quant.dequant_codes(w[:, :b], self.code_dtype, jnp.float32)
        scales = quant.unpack_scales(w[:, b:], self.n_scales)
        z = q * scales[0]                                              # eq. 11
        g = z if self.transform == "none" else hadamard.inverse(z)     # eq. 12
        if self.transform == "ash":
            g = g / scales[1]                                          # eq. 13
        return g.astype(out_dtype)


def family(name: str, **fields):
    """A registry factory for a BlockCodec configuration (overrides such as block_size)."""
    return lambda **kw: BlockCodec(name=name, **{**fields, **kw})


register("taco", family("taco", transform="ash", fmt="e4m3"))
register("taco-e5m2", family("taco-e5m2", transform="ash", fmt="e5m2"))
register("taco-int8", family("taco-int8", transform="ash", fmt="int8"))
register("taco-1scale", family("taco-1scale", transform="hadamard", fmt="e4m3"))
