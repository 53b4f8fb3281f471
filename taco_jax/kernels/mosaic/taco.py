"""Compress and decompress as Pallas Mosaic GPU kernels (Hopper: TMA, wgmma), B = 256, on
`taco_tiles`' tile math.

The Triton kernels (`triton.compress`, `triton.decompress`) stay the general path; these
cover the Hadamard codecs with FP8 codes at B = 256 — taco, taco-e5m2, taco-1scale — with
bf16 or f16 input to compress and bf16, f16 or f32 output from decompress, for row counts
that are a multiple of `ROWS`. `unsupported` says why a call is not covered; `dispatch`
then uses Triton. Mosaic GPU kernels do not run in Pallas' interpreter: on CPU they only
lower (the tests check that), the numerics are tested on a GPU.

Outputs are staged in shared memory and leave by TMA in whole lines (`MosaicConfig`): a
wire tile of 64 rows is one contiguous run of 64·row_bytes bytes, written as 256-byte lines.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from taco_jax.kernels.mosaic.registers import (BLOCK, FACTOR, LANE, ROWS, sm_count,
                                               store_values, swizzled)
from taco_jax.kernels.mosaic.taco_tiles import (SMEM_TRANSFORMS, decode_tile, encode_tile,
                                                hadamard_operand, load_wire_tile,
                                                store_wire_tile, unsupported)


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """Launch shape and work split. `ctas_per_sm` blocks of one warpgroup per
    multiprocessor, each looping over tiles of ROWS rows with `steps` input tiles in flight
    (TMA pipeline). `parts`: a tile's columns done in 1 or 2 passes of 128 coefficients
    each — 2 halves the registers a thread holds (64 instead of 128 values), so more blocks
    fit per multiprocessor; compress then computes the first half twice (its row statistics
    are needed before either half is quantized). `tma_store`: outputs staged in shared
    memory and written by TMA (contiguous lines) instead of stored from registers
    (compress, and decompress to 16-bit values; f32 values are stored from registers)."""
    ctas_per_sm: int = 2
    steps: int = 2
    parts: int = 1
    # Stores from registers put 8 (16) bytes per lane 32 (64) bytes apart: the L2 then
    # merges partial sectors and becomes the limit (85% busy, 0.42 of the roofline
    # measured at 256 MiB); staged tiles leave by TMA in whole lines (0.81).
    tma_store: bool = True

    def __post_init__(self):
        if self.parts not in (1, 2):
            raise ValueError(f"MosaicConfig.parts={self.parts} must be 1 or 2")

    def grid(self, n_tiles: int) -> int:
        return max(1, min(n_tiles, sm_count() * self.ctas_per_sm))


# -- kernels ---------------------------------------------------------------------------------
def _load_operand(h_gmem, h_smem, barrier):
    plgpu.copy_gmem_to_smem(h_gmem, h_smem, barrier)
    plgpu.barrier_wait(barrier)


def _tiles_of_this_block(n_tiles: int, grid: int, hole=None):
    """This block's tiles: blk, blk + grid, blk + 2·grid, … of the tiles outside the hole
    (first tile, count), if any. Returns (count, index map from step to tile)."""
    blk = lax.axis_index("blk")
    if hole is None:
        return (n_tiles - blk + grid - 1) // grid, lambda i: blk + i * grid
    h0, nh = hole[0], hole[1]
    count = (n_tiles - nh - blk + grid - 1) // grid
    return count, lambda i: (lambda u: jnp.where(u >= h0, u + nh, u))(blk + i * grid)


def _lines(n_rows: int, row: int) -> int:
    """A tile of wire rows is one contiguous run of ROWS·row bytes: rows of 264 bytes are
    not a TMA stride (a multiple of 16), runs of 256-byte lines are."""
    return n_rows * row // 256


def _compress_kernel(x, hole, codec, cfg):
    n_rows, row = x.shape[0], codec.row_bytes
    n_tiles = n_rows // ROWS
    grid = cfg.grid(n_tiles)
    x_spec = lambda tile: plgpu.BlockSpec((ROWS, BLOCK), lambda i: (tile(i), 0),  # noqa: E731
                                          transforms=SMEM_TRANSFORMS)

    def body(x_gmem, h_gmem, hole_gmem, w_gmem, h_smem, barrier):
        _load_operand(h_gmem, h_smem, barrier)
        count, tile = _tiles_of_this_block(n_tiles, grid,
                                           None if hole is None else hole_gmem)
        if cfg.tma_store:
            def step(idx, x_smem, w_smem):
                store_wire_tile(w_smem.reshape(ROWS, row),
                                *encode_tile(x_smem, h_smem, codec, cfg.parts))
            pipeline = plgpu.emit_pipeline(
                step, grid=(count,), max_concurrent_steps=cfg.steps, in_specs=[x_spec(tile)],
                out_specs=[plgpu.BlockSpec((_lines(ROWS, row), 256), lambda i: (tile(i), 0))])
            args = (x_gmem, w_gmem)
        else:
            def step(idx, x_smem):
                store_wire_tile(w_gmem.at[pl.ds(tile(idx[0]) * ROWS, ROWS)],
                                *encode_tile(x_smem, h_smem, codec, cfg.parts))
            pipeline = plgpu.emit_pipeline(step, grid=(count,), max_concurrent_steps=cfg.steps,
                                           in_specs=[x_spec(tile)])
            args = (x_gmem,)

        @pl.when(count > 0)
        def _():
            pipeline(*args)

    out_shape = (_lines(n_rows, row), 256) if cfg.tma_store else (n_rows, row)
    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct(out_shape, jnp.uint8),
        grid=(grid,), grid_names=("blk",), kernel_name="taco_compress_mosaic",
        scratch_types=[plgpu.SMEM((FACTOR, FACTOR), x.dtype, transforms=SMEM_TRANSFORMS),
                       plgpu.Barrier()],
        compiler_params=plgpu.CompilerParams(lowering_semantics=LANE))
    w = kernel(x, hadamard_operand("encode", x.dtype),
               jnp.zeros(2, jnp.int32) if hole is None else hole)
    return w.reshape(n_rows, row)


def _decompress_kernel(w, codec, out_dtype, cfg):
    n_rows, row = w.shape
    n_tiles = n_rows // ROWS
    grid = cfg.grid(n_tiles)

    def body(w_gmem, h_gmem, o_gmem, h_smem, barrier):
        _load_operand(h_gmem, h_smem, barrier)
        count, tile = _tiles_of_this_block(n_tiles, grid)
        w_spec = plgpu.BlockSpec((_lines(ROWS, row), 256), lambda i: (tile(i), 0))

        def values_of(w_smem):
            codes, scales = load_wire_tile(w_smem.reshape(ROWS, row), codec)
            return decode_tile(codes, scales, h_smem, codec, out_dtype, cfg.parts)
        # 4-byte values in 16-byte vectors cannot be stored into the swizzled tile without
        # bank conflicts (Mosaic refuses the transfer): f32 output is stored directly.
        if cfg.tma_store and jnp.dtype(out_dtype).itemsize == 2:
            def step(idx, w_smem, o_smem):
                store_values(o_smem, values_of(w_smem))
            pipeline = plgpu.emit_pipeline(
                step, grid=(count,), max_concurrent_steps=cfg.steps, in_specs=[w_spec],
                out_specs=[plgpu.BlockSpec((ROWS, BLOCK), lambda i: (tile(i), 0),
                                           transforms=swizzled(out_dtype))])
            args = (w_gmem, o_gmem)
        else:
            def step(idx, w_smem):
                store_values(o_gmem.at[pl.ds(tile(idx[0]) * ROWS, ROWS)], values_of(w_smem))
            pipeline = plgpu.emit_pipeline(step, grid=(count,), max_concurrent_steps=cfg.steps,
                                           in_specs=[w_spec])
            args = (w_gmem,)

        @pl.when(count > 0)
        def _():
            pipeline(*args)

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((n_rows, BLOCK), out_dtype),
        grid=(grid,), grid_names=("blk",), kernel_name="taco_decompress_mosaic",
        scratch_types=[plgpu.SMEM((FACTOR, FACTOR), jnp.float16, transforms=SMEM_TRANSFORMS),
                       plgpu.Barrier()],
        compiler_params=plgpu.CompilerParams(lowering_semantics=LANE))
    return kernel(w.reshape(_lines(n_rows, row), 256), hadamard_operand("decode"))


def _check(kind, codec, shape, dtype):
    why = unsupported(kind, codec, shape, dtype)
    if why is not None:
        raise ValueError(f"Mosaic GPU {kind}: {why}")


@functools.partial(jax.jit, static_argnames=("codec", "cfg", "skip_rows"))
def compress(x, codec, cfg: MosaicConfig | None = None, skip_start=0, skip_rows: int = 0):
    """(n_blocks, 256) bf16/f16 → (n_blocks, row_bytes) uint8 wire rows; the same wire as
    `triton.compress.compress` and the codec's reference (up to rounding ties). Tiles
    wholly inside rows [skip_start, skip_start + skip_rows) (skip_start may be traced) are
    not computed and their rows are left unwritten, as `triton.compress.compress` does."""
    if x.ndim != 2 or x.shape[1] != codec.block_size:
        raise ValueError(f"Mosaic GPU compress: got {x.shape=} for {codec}")
    _check("compress", codec, x.shape, x.dtype)
    hole = None
    if skip_rows >= ROWS:
        start = jnp.asarray(skip_start, jnp.int32)
        first = (start + ROWS - 1) // ROWS
        last = (start + skip_rows) // ROWS
        hole = jnp.stack([first, jnp.maximum(last - first, 0)]).astype(jnp.int32)
    return _compress_kernel(x, hole, codec, cfg or MosaicConfig())


@functools.partial(jax.jit, static_argnames=("codec", "out_dtype", "cfg"))
def decompress(w, codec, out_dtype=jnp.float32, cfg: MosaicConfig | None = None):
    """(n_blocks, row_bytes) uint8 → (n_blocks, 256) out_dtype, as the codec's
    `decompress_reference`."""
    if w.ndim != 2 or w.shape[1] != codec.row_bytes:
        raise ValueError(f"Mosaic GPU decompress: got {w.shape=} for {codec}")
    _check("decompress", codec, w.shape, out_dtype)
    return _decompress_kernel(w, codec, jnp.dtype(out_dtype).type, cfg or MosaicConfig())
