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

echo4 and int4-sym have fused Pallas-Triton kernels (`taco_jax.kernels.echo4`: compress,
compress with error feedback, decompress, reduce, decode_sum) that write these references'
bytes; the dispatcher runs them on GPU. tah4 is reference only (XLA fuses it).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from taco_jax.codecs.base import WireCodec, register
from taco_jax.numerics import hadamard, quant

LEVELS = 15                  # 4 bits: codes 0..15, 15 steps between the grid's ends
SYM_QMAX = 7                 # symmetric grid: integers −7..7 (code 0 unused, so it stays odd)
# Smallest scale: 0/s stays 0 for all-zero groups. Only divides here (no constant folded into
# 1/s, unlike TACO's sqrt(B)), so FLT_MIN is safe and keeps tiny groups at full precision.
SCALE_MIN = float(np.finfo(np.float32).tiny)


# -- per-group math ((rows, B) f32 in, (rows, 1) scales) --------------------------------
def asym_params(x, bad):
    """Zero-aware asymmetric grid: s = (hi − lo)/15 over [lo, hi] ∋ 0, integer z = round(−lo/s).
    s = (hi/2 − lo/2)·(2/15): hi/2 − lo/2 cannot overflow for finite inputs (hi − lo can),
    and the halvings are exact, so a compiler that fuses a multiply into the subtraction
    (an FMA: XLA on CPU and GPU, Triton) gets the same bits as one that does not (s as
    hi/15 − lo/15 differed by an ulp between jit and eager). Below 2^-125, where halving
    is inexact, s is SCALE_MIN anyway. Rounding z moves the grid by < s/2, so clipping adds
    no more than the rounding error it replaces."""
    lo = jnp.minimum(jnp.min(x, axis=1, keepdims=True), 0.0)
    hi = jnp.maximum(jnp.max(x, axis=1, keepdims=True), 0.0)
    s = jnp.maximum((hi * np.float32(0.5) - lo * np.float32(0.5)) * np.float32(2 / LEVELS),
                    SCALE_MIN)
    # z through int32: its fp32 bytes are canonical (+0, never the −0 that round(−0/s) gives
    # for groups without negatives, which a max(−0, 0) may or may not keep, per compiler)
    z = jnp.clip(jnp.round(-lo * (1 / s)), 0, LEVELS).astype(jnp.int32).astype(jnp.float32)
    s = jnp.where(bad, jnp.float32(np.nan), s)               # NaN rule: the group decodes NaN
    return s, jnp.where(bad, 0.0, z)


def sym_params(x, bad):
    """Symmetric grid: s = max|x| / 7, zero point fixed at 8."""
    s = jnp.maximum(jnp.max(jnp.abs(x), axis=1, keepdims=True) * np.float32(1 / SYM_QMAX),
                    SCALE_MIN)
    return jnp.where(bad, jnp.float32(np.nan), s), jnp.full_like(s, SYM_QMAX + 1)


def quantize4(x, s, z):
    """codes q = clip(round(x·(1/s)) + z, 0, 15) as int32 (round half to even). One division
    per group, then products: XLA rewrites x / broadcast(s) into x · (1/s) when it compiles
    (not when it runs ops one by one), so writing the product makes the bytes the same
    either way, and lets the kernels round the same product."""
    q = jnp.clip(jnp.round(x * (1 / s)) + z, 0, LEVELS)
    return jnp.where(jnp.isnan(q), 0, q).astype(jnp.int32)   # non-finite groups: codes 0


def dequantize4(q, s, z):
    """(q − z)·s: q − z is an exact small integer, so code z decodes to exactly 0."""
    return (q.astype(jnp.float32) - z) * s


def pack_nibbles(q):
    """(rows, B) int32 codes in [0, 15] → (rows, B/2) uint8; element 2i in the low nibble."""
    q = q.reshape(q.shape[0], -1, 2)                          # (rows, B/2, 2)
    return (q[..., 0] | lax.shift_left(q[..., 1], 4)).astype(jnp.uint8)


def unpack_nibbles(b):
    """(rows, B/2) uint8 → (rows, B) int32."""
    b = b.astype(jnp.int32)
    return jnp.stack([b & 0xF, lax.shift_right_logical(b, 4)], axis=-1).reshape(b.shape[0], -1)


# -- the codec ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Echo(WireCodec):
    """4-bit group codec."""
    name: str = "echo4"
    block_size: int = 128           # Echo's group size
    symmetric: bool = False         # True: the "symmetric grid" ablation
    hadamard: bool = False          # True: rotate each group first (tah4)

    @property
    def has_kernel(self) -> bool:
        """echo4 and int4-sym: yes (taco_jax.kernels.echo4); tah4: no."""
        return not self.hadamard

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
