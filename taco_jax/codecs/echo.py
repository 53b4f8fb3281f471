"""Echo codecs: 4-bit codes, two per byte, per-group fp32 scale and zero point.

"echo4" is Echo's quantizer (zero-aware asymmetric, groups of 128): each group of
B values gets the grid {(q − z)·s : q = 0..15} over [min(x, 0), max(x, 0)] with an
*integer* zero point z, so x = 0 maps to code z and decodes to exactly 0 (a float offset at
min(x), the "naive zero point", does not, and Echo measures it worse).
"int4-sym" is the "symmetric grid" ablation: {(q − 8)·s : q = 1..15}, s = max|x| / 7.
"tah4" is the pipeline-activation codec of TAH-Quant's kind: groups of 128 along the channel
dimension (the flattened tensor's last axis, when its size is a multiple of 128), an
orthonormal Hadamard transform of each group against channel outliers, then echo4's
zero-aware 4-bit grid per group.

Wire row (little-endian, like the TACO codecs' rows): B/2 bytes of codes — element 2i in
the low nibble of byte i, element 2i+1 in the high nibble — then fp32 s and, for echo4,
the zero point z as fp32: row_bytes = B/2 + 8 (echo4) or B/2 + 4 (int4-sym).

The per-group math is `taco_jax.numerics.int4`'s. echo4 and int4-sym have fused
Pallas-Triton kernels (`taco_jax.kernels.triton.echo4`: compress, compress with error
feedback, decompress, reduce, decode_sum) that write these references' bytes; the
dispatcher runs them on GPU. tah4 is reference only (XLA fuses it).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from taco_jax.codecs.base import WireCodec, register
from taco_jax.kernels import providers
from taco_jax.numerics import hadamard, quant
from taco_jax.numerics.int4 import (LEVELS, SCALE_MIN, SYM_QMAX,  # noqa: F401
                                    asym_params, dequantize4, pack_nibbles, quantize4,
                                    sym_params, unpack_nibbles)


# -- the codec ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Echo(WireCodec):
    """4-bit group codec."""
    name: str = "echo4"
    block_size: int = 128           # Echo's group size
    symmetric: bool = False         # True: the "symmetric grid" ablation
    hadamard: bool = False          # True: rotate each group first (tah4)

    @property
    def kernels(self):
        """echo4 and int4-sym: the 4-bit kernels (`providers.ECHO4`); tah4: none."""
        return None if self.hadamard else providers.ECHO4

    def __post_init__(self):
        hadamard.check_block_size(self.block_size)

    @property
    def n_scales(self) -> int:
        return 1 if self.symmetric else 2                    # (s,) or (s, z)

    @property
    def row_bytes(self) -> int:
        return self.block_size // 2 + 4 * self.n_scales

    def compress_reference(self, x):
        """(rows, B) float → (rows, row_bytes) uint8."""
        x = x.astype(jnp.float32)
        bad = quant.nonfinite_rows(x)
        if self.hadamard:
            x = jnp.where(bad, 0.0, hadamard.forward(jnp.where(bad, 0.0, x)))
        s, z = (sym_params if self.symmetric else asym_params)(x, bad)
        q = quantize4(jnp.where(bad, 0.0, x), s, z)
        scales = [s] if self.symmetric else [s, z]
        return quant.seal(jnp.concatenate([pack_nibbles(q), quant.pack_scales(scales)], axis=1))

    def decompress_reference(self, w, out_dtype=jnp.float32):
        """(rows, row_bytes) uint8 → (rows, B) out_dtype."""
        half = self.block_size // 2
        scales = quant.unpack_scales(w[:, half:], self.n_scales)
        z = jnp.float32(SYM_QMAX + 1) if self.symmetric else scales[1]
        x = dequantize4(unpack_nibbles(w[:, :half]), scales[0], z)
        if self.hadamard:     # a NaN scale (non-finite group) spreads to the whole group
            x = hadamard.inverse(x)
        return x.astype(out_dtype)


register("echo4", lambda **kw: Echo(**{"name": "echo4", **kw}))
register("int4-sym", lambda **kw: Echo(**{"name": "int4-sym", "symmetric": True, **kw}))
register("tah4", lambda **kw: Echo(**{"name": "tah4", "hadamard": True, **kw}))
