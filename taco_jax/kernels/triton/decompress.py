"""Decompress: wire rows → blocks (eqs. 11–13), one pass.

Codes are exact in bf16, so the first tensor-core dot is exact; the scales multiply after
the transform (per-block scalars commute with it)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from taco_jax.kernels.triton import tiling
from taco_jax.numerics import quant


def decode_tile(codes, scale_bytes, h1, h2, codec, cfg):
    """(tm, B) uint8 codes + (tm, 4·n) uint8 scales → (tm, B) f32 values. Kernel math."""
    q = quant.dequant_codes(codes, codec.code_dtype, jnp.float32)
    scales = quant.unpack_scales(scale_bytes, codec.n_scales)
    gain = scales[0]                                               # eq. 11: Ẑ = q·s
    if codec.transform == "ash":
        gain = tiling.div(gain, scales[1], cfg)                    # eq. 13: G' = Ĝ / α
    if codec.transform == "none":
        return q * gain
    g = tiling.hadamard_tile(q, h1, h2, block_size=codec.block_size, inverse=True,
                             exact_input=True, cfg=cfg)  # eq. 12
    return g * (gain * np.float32(1 / np.sqrt(codec.block_size)))


def decompress_kernel(w_ref, h1_ref, h2_ref, o_ref, *, codec, cfg, n_rows):
    tm, b = cfg.blocks_per_program, codec.block_size
    h1 = tiling.factor_values(h1_ref, b, 0, False, cfg)
    h2 = tiling.factor_values(h2_ref, b, 1, False, cfg)
    rows = tiling.mask_rows(cfg, n_rows)

    def tile(t):
        codes = tiling.load_rows(w_ref, t, tm, 0, b, rows)
        scale_bytes = tiling.load_rows(w_ref, t, tm, b, 4 * codec.n_scales, rows)
        x = decode_tile(codes, scale_bytes, h1, h2, codec, cfg)
        tiling.store_rows(o_ref, t, x.astype(o_ref.dtype), tm, 0, rows)
    tiling.for_each_tile(cfg, n_rows, tile)


@functools.partial(jax.jit, static_argnames=("codec", "out_dtype", "cfg", "interpret"))
def decompress(w, codec, out_dtype=jnp.float32, cfg=None, interpret=False):
    """(n_blocks, row_bytes) uint8 → (n_blocks, B) out_dtype with the fused Pallas kernel."""
    n_rows, row = w.shape
    if row != codec.row_bytes or not codec.has_kernel:
        raise ValueError(f"decompress kernel: got {w.shape=} for {codec}")
    b = codec.block_size
    cfg = (cfg or tiling.KernelConfig.default(b, "decompress")).resolve(
        wide=out_dtype != jnp.bfloat16, interpret=interpret)
    h1, h2 = tiling.hadamard_operands(b)
    kernel = functools.partial(decompress_kernel, codec=codec, cfg=cfg, n_rows=n_rows)
    out = tiling.out_struct((n_rows, b), out_dtype, w)
    return tiling.launch(kernel, out, n_rows, cfg, interpret, "taco_decompress", w, h1, h2)
