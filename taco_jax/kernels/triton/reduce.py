"""Owner-side step of the two-shot all-reduce, fused: decompress the P − 1 received copies
of this device's segment, sum them in fp32 with the device's own segment taken
unquantized, and compress the sum once.

Every element is thus quantized at most twice for any P: once by its sender (step 1) and
once here; the owner's own contribution is quantized only here."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from taco_jax.kernels.triton import compress, decompress, tiling


def reduce_kernel(r_ref, x_ref, idx_ref, h1_ref, h2_ref, h1s_ref, h2s_ref, o_ref, *, codec,
                  cfg, n_rows, n_peers):
    tm, b, ns = cfg.blocks_per_program, codec.block_size, codec.n_scales
    h1 = tiling.factor_values(h1_ref, b, 0, False, cfg)
    h2 = tiling.factor_values(h2_ref, b, 1, False, cfg)
    h1s = tiling.factor_values(h1s_ref, b, 0, True, cfg)   # / their sizes, for the encode
    h2s = tiling.factor_values(h2s_ref, b, 1, True, cfg)
    me, own_row0 = idx_ref[0], idx_ref[1]
    rows = tiling.mask_rows(cfg, n_rows)

    def tile(t):
        acc = tiling.load_rows(x_ref, t, tm, 0, b, rows, row0=own_row0).astype(jnp.float32)
        for p in range(n_peers):   # P is small (the TP degree): unrolled
            def add(a, p=p):
                codes = tiling.load_rows(r_ref, t, tm, 0, b, rows, lead=(p,))
                scale_bytes = tiling.load_rows(r_ref, t, tm, b, 4 * ns, rows, lead=(p,))
                return a + decompress.decode_tile(codes, scale_bytes, h1, h2, codec, cfg)
            # The own copy is skipped (never read: the sender may not have written it);
            # the exact input stands in for it.
            acc = jax.lax.cond(me == p, lambda a: a, add, acc)
        codes, scales = compress.encode_tile(acc, h1s, h2s, codec, cfg, exact_input=False)
        tiling.store_rows(o_ref, t, codes, tm, 0, rows)
        tiling.store_rows(o_ref, t, scales, tm, b, rows)
    tiling.for_each_tile(cfg, n_rows, tile)


@functools.partial(jax.jit, static_argnames=("codec", "cfg", "interpret"))
def reduce(recv, own, me, codec, cfg=None, interpret=False, own_row0=0):
    """recv (P, n_blocks, row_bytes) uint8, own (≥ own_row0 + n_blocks, B) float, me int32
    → (n_blocks, row_bytes) uint8: the compressed fp32 sum. The exact own segment is rows
    [own_row0, own_row0 + n_blocks) of `own` (own_row0 may be traced, e.g. from me)."""
    n_peers, n_rows, row = recv.shape
    if row != codec.row_bytes or own.shape[1] != codec.block_size or own.shape[0] < n_rows:
        raise ValueError(f"reduce kernel: got {recv.shape=}, {own.shape=} for {codec}")
    cfg = (cfg or tiling.KernelConfig.default(codec.block_size, "reduce")).resolve(
        wide=own.dtype != jnp.bfloat16, interpret=interpret)
    h1, h2 = tiling.hadamard_operands(codec.block_size)
    h1s, h2s = tiling.hadamard_operands(codec.block_size, scaled=True)
    idx = jnp.stack([jnp.asarray(me, jnp.int32), jnp.asarray(own_row0, jnp.int32)])
    kernel = functools.partial(reduce_kernel, codec=codec, cfg=cfg, n_rows=n_rows,
                               n_peers=n_peers)
    out = tiling.out_struct((n_rows, row), jnp.uint8, own)
    return tiling.launch(kernel, out, n_rows, cfg, interpret, "taco_reduce",
                         recv, own, idx, h1, h2, h1s, h2s)
