"""Compress: one pass over the input, blocks → wire rows (codes ‖ scales).

Kernel per tile of tm blocks: load → Hadamard by two tensor-core dots on the raw input
(eq. 8 without α) → one row sum of squares, which gives α (eqs. 6–7, by Parseval) → row
absmax and scale s (eq. 9) → one multiplier per row and the cast (eq. 10) → codes and
packed scales stored into the same row. α is applied after the transform (a per-block
scalar commutes with it), so the first dot sees bf16 data exactly.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from taco_jax.kernels.triton import tiling
from taco_jax.numerics import quant


def encode_tile(x, h1s, h2s, codec, cfg, exact_input, dot_in=None):
    """(tm, B) f32 → ((tm, B) uint8 codes, (tm, 4·n_scales) uint8 scales). Kernel math.

    h1s, h2s: the Hadamard factors divided by their sizes (±1/r, ±1/c;
    `tiling.hadamard_operands(B, scaled=True)`); dot_in: x as loaded (bf16 data goes into
    the tensor-core dot without a round trip). The kernel is bound by instruction issue at
    large sizes and by latency at small ones, not by memory (Nsight Compute on the H200), so
    per-element and per-block work is kept minimal:

    * z0 = H·x/B from the scaled factors: no 1/B pass, and no partial sum can overflow
      (|z0| ≤ max|x|).
    * One Σz0² per row gives α (eqs. 6–7) and, with max|z0|, the non-finite check: by
      Parseval Σz0² = Σx²/B = mean(x²) (HᵀH = B·I), so no Σx² pass over x in its own
      register layout (measured 7% of compress time); it differs from the exact mean by
      the bf16 rounding of the transform's intermediate (~1e-4 relative on bf16 data), and
      α is sent on the wire, so decode stays consistent. (A separate Σx² pass costs ~7%.) A
      NaN in x makes every z0 NaN; an ±Inf makes every z0 ±Inf or NaN (each coefficient
      sums all B inputs), so one compare, max|z0| < inf, finds the bad blocks. A finite
      block whose Σz0² overflows keeps a finite max|z0| and encodes (α = α_min).
    * eq. 8–10 as one multiplier per row: codes = z0 · g/s with g = α·sqrt(B) and
      s = g·max|z0|/Qmax (= max|z|/Qmax, as max|z0·g| = g·max|z0| exactly). No clip: this
      s bounds |z0·g/s| by Qmax up to a few ulps (s ≥ SCALE_MIN only for blocks far below
      Qmax), far from the next code's rounding threshold (a clip costs ~9%).
    """
    b = codec.block_size
    if codec.transform == "none":
        # one max that also finds non-finite blocks (NaN → +inf: Triton's max drops NaN)
        m0 = jnp.max(jnp.where(jnp.isnan(x), jnp.float32(np.inf), jnp.abs(x)), axis=1,
                     keepdims=True)
        s = quant.scale(m0, codec.qmax, m0 == np.inf)                  # eq. 9
        return (quant.quantize(x, s, codec.qmax, codec.code_dtype),   # eq. 10
                quant.pack_scales([s]))
    z0 = tiling.hadamard_tile(x if dot_in is None else dot_in, h1s, h2s, block_size=b,
                              inverse=False, exact_input=exact_input, cfg=cfg)
    meansq = jnp.sum(z0 * z0, axis=1, keepdims=True)               # = mean(x²), Parseval
    m0 = jnp.max(jnp.abs(z0), axis=1, keepdims=True)
    # Every z0 is non-finite when the block holds a NaN or ±Inf, so the block is bad
    # exactly when max|z0| is not finite (NaN; inf; or -inf from a max that drops NaN): one
    # compare. The codes come from the unselected gain and scale, which keeps the NaN
    # selects off the path to the stores; a bad block's codes are NaN or arbitrary, and its
    # NaN scales make it decode to NaN.
    bad = jnp.logical_not(jnp.abs(m0) < np.inf)
    gain = jnp.full((x.shape[0], 1), 1.0, jnp.float32)
    if codec.transform == "ash":                                   # eqs. 6–7
        gain = (jnp.clip(quant.TAU * tiling.rsqrt_approx(meansq + quant.EPS, cfg),
                         quant.ALPHA_MIN, quant.ALPHA_MAX)
                if cfg.fast_rowmath else quant.alpha_from_meansq(meansq, bad))
    g = gain * np.float32(np.sqrt(b))
    s = jnp.maximum(m0 * g * np.float32(1.0 / codec.qmax), quant.SCALE_MIN)   # eq. 9
    codes = quant.quantize_mult(z0, tiling.div(g, s, cfg), codec.qmax, codec.code_dtype,
                                clip=False)                        # eqs. 8, 10
    nan = np.float32(np.nan)
    scales = [jnp.where(bad, nan, s)] + ([jnp.where(bad, nan, gain)]
                                         if codec.transform == "ash" else [])
    return codes, quant.pack_scales(scales)


def compress_kernel(x_ref, h1_ref, h2_ref, skip_ref, o_ref, *, codec, cfg, n_rows, skip_rows):
    tm, b = cfg.blocks_per_program, codec.block_size
    h1s = tiling.factor_values(h1_ref, b, 0, True, cfg)      # ±1/r
    h2s = tiling.factor_values(h2_ref, b, 1, True, cfg)      # ±1/c
    skip0 = skip_ref[0]
    rows = tiling.mask_rows(cfg, n_rows)

    def work(t):
        raw = tiling.load_rows(x_ref, t, tm, 0, b, rows)
        x = raw.astype(jnp.float32)
        codes, scales = encode_tile(x, h1s, h2s, codec, cfg,
                                     exact_input=x_ref.dtype == jnp.bfloat16, dot_in=raw)
        tiling.store_rows(o_ref, t, codes, tm, 0, rows)
        tiling.store_rows(o_ref, t, scales, tm, b, rows)

    tiling.for_each_tile_outside(cfg, n_rows, work, skip0, skip_rows)


@functools.partial(jax.jit, static_argnames=("codec", "cfg", "interpret", "skip_rows"))
def compress(x, codec, cfg=None, interpret=False, skip_start=0, skip_rows=0):
    """(n_blocks, B) float → (n_blocks, row_bytes) uint8 with the fused Pallas kernel.
    Output rows [skip_start, skip_start + skip_rows) (skip_start may be traced) may be left
    unwritten: the two-shot all-reduce never reads the segment a device would send to
    itself, so at P devices it compresses (P − 1)/P of its input."""
    n_rows, b = x.shape
    if b != codec.block_size or not codec.has_kernel:
        raise ValueError(f"compress kernel: got {x.shape=} for {codec}")
    cfg = (cfg or tiling.KernelConfig.default(b, "compress", n_rows)).resolve(
        wide=x.dtype != jnp.bfloat16, interpret=interpret)
    h1, h2 = tiling.hadamard_operands(b, scaled=True)
    kernel = functools.partial(compress_kernel, codec=codec, cfg=cfg, n_rows=n_rows,
                               skip_rows=skip_rows)
    skip = jnp.asarray(skip_start, jnp.int32).reshape(1)
    out = tiling.out_struct((n_rows, codec.row_bytes), jnp.uint8, x)
    return tiling.launch(kernel, out, n_rows, cfg, interpret, "taco_compress", x, h1, h2,
                         skip)
