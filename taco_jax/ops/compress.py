"""Compress: one pass over the input, blocks → wire rows (codes ‖ scales).

Kernel per program (tm blocks): load → α from the block RMS (eqs. 6–7) → Hadamard by two
tensor-core dots (eq. 8) → per-block absmax and scale (eq. 9) → clip + cast (eq. 10) →
store codes and packed scales into the same row. α multiplies after the transform (it is a
per-block scalar, so H(αG) = αHG): the first dot then sees the raw bf16 input, exactly.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from taco_jax import hadamard
from taco_jax.ops import common, quant


def _encode_tile(x, h1s, h2s, codec, cfg, exact_input, dot_in=None):
    """(tm, B) f32 → ((tm, B) uint8 codes, (tm, 4·n_scales) uint8 scales). Kernel math.

    h1s, h2s: the Hadamard factors divided by their sizes (±1/r, ±1/c;
    `common.hadamard_operands(B, scaled=True)`); dot_in: x as loaded (bf16 data goes into
    the tensor-core dot without a round trip). The kernel is issue-bound, not memory-bound
    (Nsight Compute on H200, docs/results.md), so per-element work is kept minimal:

    * z0 = H·x/B from the scaled factors: no 1/B pass, and no partial sum can overflow
      (|z0| ≤ max|x|).
    * One Σx² gives α (eqs. 6–7) and, with max|z0|, the non-finite check, per row instead
      of per element: a NaN in x makes Σx² NaN; an ±Inf makes every z0 ±Inf or NaN (each
      coefficient sums all B inputs), and Triton's max drops NaN (all-NaN gives −inf), so
      the block is bad unless 0 ≤ max|z0| < inf. A finite block whose Σx² overflows keeps a
      finite max|z0| and encodes (α = α_min).
    * eq. 8–10 as one multiplier per row: codes = clip(z0 · g/s) with g = α·sqrt(B) and
      s = g·max|z0|/Qmax (= max|z|/Qmax, as max|z0·g| = g·max|z0| exactly).
    """
    b = codec.block_size
    if codec.transform == "none":
        # one max that also finds non-finite blocks (NaN → +inf: Triton's max drops NaN)
        m0 = jnp.max(jnp.where(jnp.isnan(x), jnp.float32(np.inf), jnp.abs(x)), axis=1,
                     keepdims=True)
        s = quant.scale(m0, codec.qmax, m0 == np.inf)                  # eq. 9
        return (quant.quantize(x, s, codec.qmax, codec.code_dtype),   # eq. 10
                quant.pack_scales([s]))
    z0 = common.hadamard_tile(x if dot_in is None else dot_in, h1s, h2s, block_size=b,
                              inverse=False, exact_input=exact_input, cfg=cfg)
    if "A" in cfg.exp:
        ss = jnp.sum(z0 * z0, axis=1, keepdims=True) * np.float32(b)
    else:
        ss = jnp.sum(x * x, axis=1, keepdims=True)
    m0 = jnp.max(jnp.abs(z0), axis=1, keepdims=True)
    bad = jnp.isnan(ss) | jnp.logical_not((m0 >= 0) & (m0 < np.inf))
    gain = jnp.full((x.shape[0], 1), 1.0, jnp.float32)
    if codec.transform == "ash":
        gain = quant.alpha_from_meansq(ss * np.float32(1 / b), bad)   # eqs. 6–7
    g = gain * np.float32(np.sqrt(b))
    s = quant.scale(m0 * g, codec.qmax, bad)                       # eq. 9
    codes = quant.quantize_mult(z0, g / s, codec.qmax, codec.code_dtype,
                                clip="C" not in cfg.exp)   # eqs. 8, 10
    scales = [s, gain] if codec.transform == "ash" else [s]
    return codes, quant.pack_scales(scales)


def _work_layout(x_ref, o_ref, t, h, codec, cfg, n_rows, row0):
    """EXPERIMENT L: tile loaded as X2[p, (t, q)] (16, tm·16), H applied on the left (one
    2D dot over p), reshape to [(p, t), q] (no transpose), H on the right; codes stored
    row-major per block (Y[p, q] at p·16 + q: NOT the current wire order)."""
    from jax.experimental.pallas import triton as plgpu
    tm, b = cfg.blocks_per_program, codec.block_size
    r = 16
    n = tm * r
    col = jnp.arange(n)
    rows = t * tm + col // r                        # (n,)
    cols = jnp.arange(r)[:, None] * r + (col % r)[None, :]   # (16, n)
    mask = jnp.broadcast_to((rows < n_rows)[None, :], (r, n))
    raw = plgpu.load(x_ref.at[row0 + rows[None, :], cols], mask=mask, other=0)  # (16, n)
    y1 = jnp.dot(h, raw, preferred_element_type=jnp.float32)       # (16, n): H·X / 16
    y1 = y1.astype(jnp.bfloat16).reshape(r * tm, r)                # [(p', t), q]
    z = jnp.dot(y1, h, preferred_element_type=jnp.float32)          # [(p', t), q'] / 256
    z3 = z.reshape(r, tm, r)
    m0 = jnp.max(jnp.max(jnp.abs(z3), axis=2), axis=0)              # (tm,)
    ss = jnp.sum(jnp.sum(z3 * z3, axis=2), axis=0) * np.float32(b)
    bad = jnp.isnan(ss) | jnp.logical_not((m0 >= 0) & (m0 < np.inf))
    gain = quant.alpha_from_meansq(ss * np.float32(1 / b), bad)
    g = gain * np.float32(np.sqrt(b))
    s = quant.scale(m0 * g, codec.qmax, bad)
    mult = (g / s)
    codes = quant.quantize_mult(z3, mult[None, :, None], codec.qmax, codec.code_dtype,
                                clip=False).reshape(r, n)
    plgpu.store(o_ref.at[rows[None, :], cols], codes, mask=mask)
    scales = quant.pack_scales([s[:, None], gain[:, None]])
    common.store_rows(o_ref, t, scales, tm, b, n_rows)


def compress_kernel(x_ref, h1_ref, h2_ref, skip_ref, o_ref, *, codec, cfg, n_rows, row0,
                    skip_rows):
    tm, b = cfg.blocks_per_program, codec.block_size
    h1s, h2s = h1_ref[...], h2_ref[...]      # ±1/r, ±1/c
    skip0 = skip_ref[0]

    def work(t):
        if "L" in cfg.exp:
            return _work_layout(x_ref, o_ref, t, h1s, codec, cfg, n_rows, row0)
        raw = common.load_rows(x_ref, t, tm, 0, b, n_rows, row0=row0)
        x = raw.astype(jnp.float32)
        codes, scales = _encode_tile(x, h1s, h2s, codec, cfg,
                                     exact_input=x_ref.dtype == jnp.bfloat16, dot_in=raw)
        common.store_rows(o_ref, t, codes, tm, 0, n_rows)
        common.store_rows(o_ref, t, scales, tm, b, n_rows)

    def tile(t):
        if not skip_rows:
            return work(t)
        # Tiles wholly inside the skipped window are left unwritten (see `compress`).
        inside = (t * tm >= skip0) & (t * tm + tm <= skip0 + skip_rows)
        pl.when(jnp.logical_not(inside))(lambda: work(t))
    common.for_each_tile(cfg, n_rows, tile)


@functools.partial(jax.jit, static_argnames=("codec", "cfg", "interpret", "row0", "n_rows",
                                             "skip_rows"))
def compress(x, codec, cfg=None, interpret=False, row0=0, n_rows=None, skip_start=0,
             skip_rows=0):
    """(n_blocks, B) float → (n_blocks, row_bytes) uint8 with the fused Pallas kernel.
    With row0/n_rows: compress only rows [row0, row0 + n_rows) of x (no slicing copy).
    With skip_rows: output rows [skip_start, skip_start + skip_rows) (skip_start may be
    traced) may be left unwritten — the two-shot all-reduce never reads the segment a device
    sends to itself, so it need not be compressed."""
    b = x.shape[1]
    n_rows = x.shape[0] - row0 if n_rows is None else n_rows
    if b != codec.block_size or not codec.has_kernel:
        raise ValueError(f"compress kernel: got {x.shape=} for {codec}")
    if row0 < 0 or n_rows < 0 or row0 + n_rows > x.shape[0]:
        raise ValueError(f"compress: window {row0=} {n_rows=} outside {x.shape[0]} rows")
    cfg = (cfg or common.KernelConfig.default(b)).resolve(wide=x.dtype != jnp.bfloat16)
    h1, h2 = common.hadamard_operands(b, scaled=True)
    kernel = functools.partial(compress_kernel, codec=codec, cfg=cfg, n_rows=n_rows,
                               row0=row0, skip_rows=skip_rows)
    skip = jnp.asarray(skip_start, jnp.int32).reshape(1)
    out = common.out_struct((n_rows, codec.row_bytes), jnp.uint8, x)
    return common.launch(kernel, out, n_rows, cfg, interpret, "taco_compress", x, h1, h2,
                         skip)


def compress_reference(x, codec):
    """Plain-jnp compress, following the paper's order of operations in f32."""
    x = x.astype(jnp.float32)
    bad = quant.nonfinite_rows(x)
    scales = []
    if codec.transform == "ash":
        a = quant.alpha(x, bad)                                    # eqs. 6–7
        x = x * a
    z = x if codec.transform == "none" else hadamard.forward(x)    # eq. 8
    absmax = jnp.max(jnp.abs(z), axis=1, keepdims=True)
    if codec.scale_mode == "tensor":
        absmax = jnp.broadcast_to(jnp.max(absmax), absmax.shape)
        bad = jnp.broadcast_to(jnp.any(bad), bad.shape)
    s = quant.scale(absmax, codec.qmax, bad)                       # eq. 9
    codes = quant.quantize(z, s, codec.qmax, codec.code_dtype)     # eq. 10
    scales = [s, a] if codec.transform == "ash" else [s]
    return quant.seal(jnp.concatenate([codes, quant.pack_scales(scales)], axis=1))
