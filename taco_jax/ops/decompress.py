"""Decompress: wire rows → blocks (eqs. 11–13), one pass.

Codes are exact in bf16, so the first tensor-core dot is exact; the scales multiply after
the transform (per-block scalars commute with it)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from taco_jax import hadamard
from taco_jax.ops import common, quant


def _decode_tile(codes, scale_bytes, h1, h2, codec, cfg):
    """(tm, B) uint8 codes + (tm, 4·n) uint8 scales → (tm, B) f32 values. Kernel math."""
    q = quant.dequant_codes(codes, codec.code_dtype, jnp.float32)
    scales = quant.unpack_scales(scale_bytes, codec.n_scales)
    gain = scales[0]                                               # eq. 11: Ẑ = q·s
    if codec.transform == "ash":
        gain = common.div(gain, scales[1], cfg)                    # eq. 13: G' = Ĝ / α
    if codec.transform == "none":
        return q * gain
    g = common.hadamard_tile(q, h1, h2, block_size=codec.block_size, inverse=True,
                             exact_input=True, cfg=cfg)  # eq. 12
    return g * (gain * np.float32(1 / np.sqrt(codec.block_size)))


def decompress_kernel(w_ref, h1_ref, h2_ref, *refs, codec, cfg, n_rows, row0):
    o_ref = refs[-1]                     # refs = (into_ref, o_ref) when writing in place
    tm, b = cfg.blocks_per_program, codec.block_size
    h1, h2 = h1_ref[...], h2_ref[...]

    def tile(t):
        codes = common.load_rows(w_ref, t, tm, 0, b, n_rows)
        scale_bytes = common.load_rows(w_ref, t, tm, b, 4 * codec.n_scales, n_rows)
        x = _decode_tile(codes, scale_bytes, h1, h2, codec, cfg)
        common.store_rows(o_ref, t, x.astype(o_ref.dtype), tm, 0, n_rows, row0=row0)
    common.for_each_tile(cfg, n_rows, tile)


@functools.partial(jax.jit, static_argnames=("codec", "out_dtype", "cfg", "interpret", "row0",
                                             "total_rows"))
def decompress(w, codec, out_dtype=jnp.float32, cfg=None, interpret=False, into=None,
               row0=0, total_rows=None):
    """(n_blocks, row_bytes) uint8 → (n_blocks, B) out_dtype with the fused Pallas kernel.

    Windowed: the result is a (total_rows, B) buffer whose rows [row0, row0 + n_blocks)
    hold the decoded values; with `into` (aliased, updated in place) the other rows keep
    into's values, without it they are left unwritten for later windowed calls to fill.
    This assembles a chunked collective's output without a concatenation copy."""
    n_rows, row = w.shape
    if row != codec.row_bytes or not codec.has_kernel:
        raise ValueError(f"decompress kernel: got {w.shape=} for {codec}")
    b = codec.block_size
    cfg = (cfg or common.KernelConfig.default(b, "decompress")).resolve(
        wide=out_dtype != jnp.bfloat16, interpret=interpret)
    h1, h2 = common.hadamard_operands(b)
    rows_out = into.shape[0] if into is not None else (total_rows or row0 + n_rows)
    if row0 < 0 or row0 + n_rows > rows_out:
        raise ValueError(f"decompress: window {row0=} + {n_rows} rows outside {rows_out} rows")
    kernel = functools.partial(decompress_kernel, codec=codec, cfg=cfg, n_rows=n_rows,
                               row0=row0)
    if into is not None:
        if into.shape[1] != b or into.dtype != out_dtype:
            raise ValueError(f"decompress into: got {into.shape=} {into.dtype=}")
        return common.launch(kernel, common.out_struct(into.shape, out_dtype, into), n_rows,
                             cfg, interpret, "taco_decompress", w, h1, h2, into,
                             aliases={3: 0})
    out = common.out_struct((total_rows or row0 + n_rows, b), out_dtype, w)
    return common.launch(kernel, out, n_rows, cfg, interpret, "taco_decompress", w, h1, h2)


def decompress_reference(w, codec, out_dtype=jnp.float32):
    """Plain-jnp decompress, eqs. 11–13 in the paper's order, f32."""
    if w.ndim != 2 or w.shape[1] != codec.row_bytes:
        raise ValueError(f"decompress: got {w.shape=} for {codec.name} (rows of "
                         f"{codec.row_bytes} bytes)")
    b = codec.block_size
    q = quant.dequant_codes(w[:, :b], codec.code_dtype, jnp.float32)
    scales = quant.unpack_scales(w[:, b:], codec.n_scales)
    z = q * scales[0]                                              # eq. 11
    g = z if codec.transform == "none" else hadamard.inverse(z)    # eq. 12
    if codec.transform == "ash":
        g = g / scales[1]                                          # eq. 13
    return g.astype(out_dtype)
