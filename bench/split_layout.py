"""Experiment (issue 2): a "split" wire layout, all codes first, then all scales.

Today a wire row is codes ‖ scales (264 bytes for taco), so every other row starts 8 bytes
off a 16-byte boundary and each 256-byte code run straddles 32-byte sectors. In the split
layout a segment of n blocks is [n·B code bytes][n·4·n_scales scale bytes]: code rows are
256-byte aligned and a tile's scales are one contiguous run. Same bytes on the wire; one
buffer per segment, decode finds the scales by offset. This module times compress and
decompress kernels in that layout (same tile math as taco_jax.ops) beside the default; the
kernels address a flat uint8 buffer with pointer arithmetic (index arrays).

`to_rows` converts a split buffer back to (n, row_bytes) rows, so tests compare the
experiment with the production kernels exactly.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from taco_jax.ops import common, compress, decompress


def _flat_tile(ref, idx, mask, value=None):
    view = ref.at[(idx,)]
    if value is None:
        return plgpu.load(view, mask=mask, other=0)
    plgpu.store(view, value, mask=mask)


def _indices(t, tm, width, n_rows, base, stride):
    rows = t * tm + jnp.arange(tm)
    idx = base + rows[:, None] * stride + jnp.arange(width)[None, :]
    return idx, (rows < n_rows)[:, None]


def _compress_kernel(x_ref, h1_ref, h2_ref, o_ref, *, codec, cfg, n_rows):
    tm, b, sb = cfg.blocks_per_program, codec.block_size, codec.scale_bytes
    h1s, h2s = h1_ref[...], h2_ref[...]

    def tile(t):
        raw = common.load_rows(x_ref, t, tm, 0, b, n_rows)
        codes, scales = compress._encode_tile(raw.astype(jnp.float32), h1s, h2s, codec, cfg,
                                              exact_input=x_ref.dtype == jnp.bfloat16,
                                              dot_in=raw)
        idx, mask = _indices(t, tm, b, n_rows, 0, b)
        _flat_tile(o_ref, idx, mask, codes)
        idx, mask = _indices(t, tm, sb, n_rows, n_rows * b, sb)
        _flat_tile(o_ref, idx, mask, scales)
    common.for_each_tile(cfg, n_rows, tile)


@functools.partial(jax.jit, static_argnames=("codec", "cfg", "interpret"))
def compress_split(x, codec, cfg=None, interpret=False):
    """(n, B) → flat uint8 [n·B codes][n·scale_bytes scales]."""
    n, b = x.shape
    cfg = (cfg or common.KernelConfig.default(b)).resolve(wide=x.dtype != jnp.bfloat16)
    h1, h2 = common.hadamard_operands(b, scaled=True)
    kernel = functools.partial(_compress_kernel, codec=codec, cfg=cfg, n_rows=n)
    out = jax.ShapeDtypeStruct((n * (b + codec.scale_bytes),), jnp.uint8)
    return common.launch(kernel, out, n, cfg, interpret, "taco_compress_split", x, h1, h2)


def _decompress_kernel(w_ref, h1_ref, h2_ref, o_ref, *, codec, cfg, n_rows):
    tm, b, sb = cfg.blocks_per_program, codec.block_size, codec.scale_bytes
    h1, h2 = h1_ref[...], h2_ref[...]

    def tile(t):
        idx, mask = _indices(t, tm, b, n_rows, 0, b)
        codes = _flat_tile(w_ref, idx, mask)
        idx, mask = _indices(t, tm, 4 * codec.n_scales, n_rows, n_rows * b, sb)
        scale_bytes = _flat_tile(w_ref, idx, mask)
        x = decompress._decode_tile(codes, scale_bytes, h1, h2, codec, cfg)
        common.store_rows(o_ref, t, x.astype(o_ref.dtype), tm, 0, n_rows)
    common.for_each_tile(cfg, n_rows, tile)


@functools.partial(jax.jit, static_argnames=("codec", "n", "out_dtype", "cfg", "interpret"))
def decompress_split(w, codec, n, out_dtype=jnp.bfloat16, cfg=None, interpret=False):
    b = codec.block_size
    cfg = (cfg or common.KernelConfig.default(b)).resolve(wide=out_dtype != jnp.bfloat16)
    h1, h2 = common.hadamard_operands(b)
    kernel = functools.partial(_decompress_kernel, codec=codec, cfg=cfg, n_rows=n)
    out = jax.ShapeDtypeStruct((n, b), out_dtype)
    return common.launch(kernel, out, n, cfg, interpret, "taco_decompress_split", w, h1, h2)


def to_rows(flat, codec, n):
    """Split buffer → the default (n, row_bytes) wire rows."""
    b = codec.block_size
    codes = flat[: n * b].reshape(n, b)
    scales = flat[n * b:].reshape(n, codec.scale_bytes)
    return jnp.concatenate([codes, scales], axis=1)
