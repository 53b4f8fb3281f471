"""Decode-and-sum: the end of a one-shot all-reduce. P received wire buffers → their sum.

Every device runs this on the same P buffers in the same order (device 0 first), so every
device gets the same bits; each element was quantized once, by its sender."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from taco_jax.kernels.triton import decompress, tiling


def decode_sum_kernel(r_ref, h1_ref, h2_ref, o_ref, *, codec, cfg, n_rows, n_parts):
    tm, b, ns = cfg.blocks_per_program, codec.block_size, codec.n_scales
    h1 = tiling.factor_values(h1_ref, b, 0, False, cfg)
    h2 = tiling.factor_values(h2_ref, b, 1, False, cfg)
    rows = tiling.mask_rows(cfg, n_rows)

    def tile(t):
        acc = None
        for p in range(n_parts):      # P is small (the TP degree): unrolled, in device order
            codes = tiling.load_rows(r_ref, t, tm, 0, b, rows, lead=(p,))
            scale_bytes = tiling.load_rows(r_ref, t, tm, b, 4 * ns, rows, lead=(p,))
            dec = decompress.decode_tile(codes, scale_bytes, h1, h2, codec, cfg)
            acc = dec if acc is None else acc + dec
        tiling.store_rows(o_ref, t, acc.astype(o_ref.dtype), tm, 0, rows)
    tiling.for_each_tile(cfg, n_rows, tile)


@functools.partial(jax.jit, static_argnames=("codec", "out_dtype", "cfg", "interpret"))
def decode_sum(recv, codec, out_dtype=jnp.float32, cfg=None, interpret=False):
    """recv (P, n_blocks, row_bytes) uint8 → (n_blocks, B) out_dtype: Σ_p decode(recv[p]),
    summed in fp32 in the order p = 0, 1, …, P − 1."""
    n_parts, n_rows, row = recv.shape
    if row != codec.row_bytes or not codec.has_kernel:
        raise ValueError(f"decode_sum kernel: got {recv.shape=} for {codec}")
    b = codec.block_size
    cfg = (cfg or tiling.KernelConfig.default(b, "decompress")).resolve(
        wide=out_dtype != jnp.bfloat16, interpret=interpret)
    h1, h2 = tiling.hadamard_operands(b)
    kernel = functools.partial(decode_sum_kernel, codec=codec, cfg=cfg, n_rows=n_rows,
                               n_parts=n_parts)
    out = tiling.out_struct((n_rows, b), out_dtype, recv)
    return tiling.launch(kernel, out, n_rows, cfg, interpret, "taco_decode_sum", recv, h1, h2)
