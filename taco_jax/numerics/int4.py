"""4-bit group codes (Echo's quantizers): per-group grid parameters, quantize and
dequantize, and nibble packing (two codes per byte, element 2i in the low nibble). The
codecs (`taco_jax.codecs.echo`) and their kernels share this math."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

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
