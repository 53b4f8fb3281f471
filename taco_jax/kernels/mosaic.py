"""Compress and decompress as Pallas Mosaic GPU kernels (Hopper: TMA, wgmma), B = 256.

The Triton kernels (`compress`, `decompress`) stay the general path; these cover the
Hadamard codecs with FP8 codes at B = 256 — taco, taco-e5m2, taco-1scale — with bf16 or f16
input to compress and bf16, f16 or f32 output from decompress, for row counts that are a
multiple of `ROWS`. `unsupported` says why a call is not covered; `dispatch` then uses
Triton. Mosaic GPU kernels do not run in Pallas' interpreter: on CPU they only lower (the
tests check that), the numerics are tested on a GPU.

Transform. A block is a 16×16 matrix X (row r, column c: element 16r + c) and its wire
codes are Zᵀ for Z = H X H (`numerics.hadamard`). Per tile of 64 blocks:

  1. one wgmma per 16-column slice (tensor cores, exact for bf16/f16 data):
     Y_r = x[:, 16r:16r+16] @ H/256, for r = 0..15;
  2. a 16-point Walsh–Hadamard butterfly across the 16 slices, in registers (4 adds per
     element): Z[r', c] = Σ_r H[r', r] Y_r[c].

After step 2 each thread holds, for each of its (block, c) positions, all 16 coefficients
r' — exactly the 16 consecutive wire bytes 16c .. 16c+15. The codes are therefore written
in a register layout of their own (`wire_layout`), as 8-byte vectors; no transpose goes
through shared memory. Decompress is the same with the roles of r and c exchanged: one
wgmma per 16-code slice (codes converted to f16: exact), the butterfly across slices, and
each thread then holds 16 consecutive output elements.

The per-block math is the Triton kernel's (`compress._encode_tile`): with z0 = H·x/256,
Σz0² = mean(x²) (Parseval) gives α; s = α·16·max|z0|/Qmax; codes = cvt(z0 · α·16/s)
(satfinite: the cast saturates where the multiplier overshoots Qmax by an ulp); a block
whose Σz0² is NaN or whose max|z0| is not finite gets s = α = NaN, so it decodes to NaN.
rsqrt and the reciprocal are the GPU's approximate instructions (≤ 2 ulp), as in the
Triton kernels' default `fast_rowmath`.

Tile API — for kernels that move wire rows themselves (a fused all-reduce), all inside a
`plgpu.kernel` with `compiler_params=plgpu.CompilerParams(lowering_semantics=LANE)`, one
warpgroup per block of 64 rows:

  ROWS = 64, BLOCK = 256, SMEM_TRANSFORMS = (tiling (8, 16), 32-byte swizzle).

  hadamard_operand(kind, dtype) -> (16, 16) array
      the second factor of the transform; copy it once into an SMEM ref with
      SMEM_TRANSFORMS (`plgpu.SMEM((16, 16), dtype, transforms=SMEM_TRANSFORMS)`).
      kind="encode": H/256 in the input's dtype; kind="decode": H (±1) in f16.

  encode_tile(x_smem, h_smem, codec) -> (codes, scales)
      x_smem: (64, 256) bf16 or f16 SMEM ref with SMEM_TRANSFORMS (what a TMA copy or an
      emit_pipeline BlockSpec with those transforms gives), one block per row.
      codes: (64, 256) uint8 register array in `wire_layout(codec)`, the wire row bytes
      [0, 256); scales: (64, 4·n_scales) uint8 in `scale_layout(codec)`, bytes
      [256, row_bytes). Rows at 8-byte (4-byte for one scale) alignment.

  store_wire_tile(ref, codes, scales)
      ref: a (64, row_bytes) uint8 view (GMEM or SMEM) of 64 wire rows.

  load_wire_tile(ref, codec) -> (codes, scales)
      codes (64, 256) uint8 in the WGMMA layout, scales as above, from such a view.

  decode_tile(codes, scales, h_smem, codec, out_dtype=jnp.float32) -> values
      values: (64, 256) out_dtype in `value_layout()`, block per row in natural order;
      store with `ref[...] = values`, or add tiles of the same layout elementwise.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, vector
from jaxlib.mlir.dialects import math as mlir_math

from taco_jax.numerics import hadamard, quant

ROWS = 64                  # blocks per tile: one warpgroup, the wgmma M
BLOCK = 256
FACTOR = 16                # H_256 = H_16 ⊗ H_16
LANE = plgpu.LoweringSemantics.Lane
SMEM_TRANSFORMS = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))
CODE_FORMATS = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
IN_DTYPES = (jnp.bfloat16, jnp.float16)
OUT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """Launch shape: `ctas_per_sm` blocks of one warpgroup per multiprocessor (each loops
    over tiles of ROWS rows), `steps` tiles of input in flight per block (TMA pipeline)."""
    ctas_per_sm: int = 2
    steps: int = 2

    def grid(self, n_tiles: int) -> int:
        return max(1, min(n_tiles, _sm_count() * self.ctas_per_sm))


def _sm_count() -> int:
    try:
        dev = jax.devices("gpu")[0]
        return int(getattr(dev, "core_count", 0)) or 132
    except RuntimeError:      # no GPU here (lowering on CPU): an H200's count
        return 132


# -- register layouts -----------------------------------------------------------------------
def _wire_tiled(vec: int) -> fa.TiledLayout:
    """(64, 256): rows as in the WGMMA layout (warp w: rows 16w..16w+15; lane l: rows
    l//4 and l//4 + 8); columns 16c .. 16c+15 for the four c = 8j + 2(l%4) + e (j, e ∈
    {0, 1}) of lane l, as 16/vec vectors of vec consecutive elements."""
    return fa.TiledLayout(
        fa.Tiling(((64, 256), (16, 256), (8, 256), (128,), (32,), (16,), (vec,))),
        warp_dims=(-10,), lane_dims=(-6, -4), vector_dim=-1)


def _scale_tiled(width: int) -> fa.TiledLayout:
    """(64, width): one vector per row, rows as in the WGMMA layout, the four lanes of a
    row holding the same bytes."""
    return fa.TiledLayout(
        fa.Tiling(((64, width), (16, width), (8, width), (width,))), warp_dims=(-7,),
        lane_dims=(-3, fa.Replicated(4)), vector_dim=-1, _check_canonical=False
    ).canonicalize()


def _pallas_layout(t: fa.TiledLayout):
    return plgpu.Layout.TILED(t.tiling, warp_dims=t.warp_dims, lane_dims=t.lane_dims,
                              vector_dim=t.vector_dim)


def _code_vec(codec) -> int:
    return 8 if codec.row_bytes % 8 == 0 else 4


def wire_layout(codec):
    """Pallas layout of encode_tile's codes (see `_wire_tiled`)."""
    return _pallas_layout(_wire_tiled(_code_vec(codec)))


def scale_layout(codec):
    return _pallas_layout(_scale_tiled(4 * codec.n_scales))


def value_layout():
    """Pallas layout of decode_tile's values (16-byte vectors of bf16)."""
    return _pallas_layout(_wire_tiled(8))


# -- what is covered ------------------------------------------------------------------------
def unsupported(kind: str, codec, shape, dtype) -> str | None:
    """Why the Mosaic kernel does not cover this call, or None if it does. kind:
    "compress" (dtype: the input's) or "decompress" (dtype: the output's)."""
    if kind not in ("compress", "decompress"):
        return f"no Mosaic GPU {kind} kernel"
    if getattr(codec, "scale_mode", None) != "block" or not codec.has_kernel:
        return f"{codec.name}: no per-block kernel"
    if codec.block_size != BLOCK:
        return f"block size {codec.block_size} (the Mosaic kernels have B = {BLOCK})"
    transform, fmt = getattr(codec, "transform", None), getattr(codec, "fmt", None)
    if transform not in ("ash", "hadamard") or fmt not in CODE_FORMATS:
        return f"{codec.name}: transform {transform}, codes {fmt} (covered: Hadamard " \
               f"transforms with FP8 codes)"
    dtypes = IN_DTYPES if kind == "compress" else OUT_DTYPES
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in dtypes]:
        return f"{kind} with {jnp.dtype(dtype).name} data (covered: " \
               f"{', '.join(jnp.dtype(d).name for d in dtypes)})"
    rows = shape[0] if len(shape) else 0
    if len(shape) != 2 or rows == 0 or rows % ROWS:
        return f"shape {tuple(shape)}: rows must be a positive multiple of {ROWS}"
    return None


def hadamard_operand(kind: str, dtype=jnp.bfloat16) -> jax.Array:
    """H_16 for the wgmma: kind "encode" H/256 in the input dtype (powers of two: exact;
    z0 = H·x/256 cannot overflow for finite x), kind "decode" H in f16 (codes are exact
    in f16)."""
    h = hadamard.sylvester(FACTOR)
    if kind == "encode":
        return jnp.asarray(h / BLOCK, dtype)
    if kind == "decode":
        return jnp.asarray(h, jnp.float16)
    raise ValueError(f"hadamard_operand: kind {kind!r} is not 'encode' or 'decode'")


# -- register-level pieces (Mosaic GPU IR, run inside plgpu.inline_mgpu) ------------------
def _f32(v):
    return arith.constant(ir.F32Type.get(), float(v))


def _ptx_f32(instr: str, x):
    return mgpu_utils.inline_ptx(f"{instr} $0, $1;", x, result_types=ir.F32Type.get())


def _elem(v, k: int):
    return vector.extract(v, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([k]))


def _butterfly(vs: list) -> list:
    """Unnormalised Walsh–Hadamard transform (Sylvester order) across a list of values."""
    vs = list(vs)
    h = 1
    while h < len(vs):
        for a in range(len(vs)):
            if not a & h:
                x, y = vs[a], vs[a + h]
                vs[a], vs[a + h] = arith.addf(x, y), arith.subf(x, y)
        h *= 2
    return vs


def _slices(arr) -> np.ndarray:
    """(64, 256) WGMMA-layout array → registers [slice, half, row half]: slice k holds
    columns 16k .. 16k+15, half j its columns 8j .. 8j+7 (vector<2> per register)."""
    return arr.registers.reshape(BLOCK // 8, 2).reshape(FACTOR, 2, 2)


def _assemble(parts, vec: int, dtype) -> fa.FragmentedArray:
    """parts[k][i][j]: vector<2> holding, for this thread's row half i and slice half j,
    the value at minor index k (the element 16c + k of the wire / value layout). Builds
    the `_wire_tiled(vec)` array; only register names move."""
    layout = _wire_tiled(vec)
    regs = np.empty(layout.registers_shape((ROWS, BLOCK)), dtype=object)
    view = regs.reshape(2, 2, 2, FACTOR // vec)          # (i, j, e, h)
    vty = ir.VectorType.get((vec,), dtype)
    for i, j, e, h in np.ndindex(view.shape):
        vals = [_elem(parts[h * vec + m][i][j], e) for m in range(vec)]
        view[i, j, e, h] = vector.from_elements(vty, vals)
    return fa.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None)


def _row_stats(vals):
    """Σv² and max|v| over this thread's vectors, then over the 4 lanes of the row."""
    ss = m = None
    for v in vals:
        sq, av = arith.mulf(v, v), mlir_math.absf(v)
        ss = sq if ss is None else arith.addf(ss, sq)
        m = av if m is None else arith.maximumf(m, av)   # NaN-propagating
    ss = arith.addf(_elem(ss, 0), _elem(ss, 1))
    m = arith.maximumf(_elem(m, 0), _elem(m, 1))
    for d in (1, 2):
        ss = arith.addf(ss, mgpu_utils.shfl_bfly(ss, d))
        m = arith.maximumf(m, mgpu_utils.shfl_bfly(m, d))
    return ss, m


def _encode_regs(y, codec):
    """y: (64, 256) f32 WGMMA array, y[:, 16r + c] = (X H/256)[r, c] per block row.
    → codes (wire layout, uint8), scale bytes (scale layout)."""
    f32 = ir.F32Type.get()
    sl = _slices(y)
    parts = [[[None, None] for _ in range(2)] for _ in range(FACTOR)]
    row_scales = []
    for i in range(2):
        z = {j: _butterfly([sl[r, j, i] for r in range(FACTOR)]) for j in range(2)}
        ss, m = _row_stats([v for j in z for v in z[j]])          # Σz0² = mean(x²)
        nan = _f32(np.nan)
        bad = arith.ori(arith.cmpf(arith.CmpFPredicate.UNO, ss, ss),
                        arith.cmpf(arith.CmpFPredicate.UGE, m, _f32(np.inf)))
        if codec.transform == "ash":                               # eqs. 6–7
            a = arith.mulf(_ptx_f32("rsqrt.approx.ftz.f32", arith.addf(ss, _f32(quant.EPS))),
                           _f32(quant.TAU))
            a = arith.minimumf(arith.maximumf(a, _f32(quant.ALPHA_MIN)), _f32(quant.ALPHA_MAX))
            gain = arith.select(bad, nan, a)
            g = arith.mulf(gain, _f32(np.sqrt(BLOCK)))
        else:
            gain, g = None, _f32(np.sqrt(BLOCK))
        s = arith.maximumf(arith.mulf(arith.mulf(m, g), _f32(1.0 / codec.qmax)),
                           _f32(quant.SCALE_MIN))                  # eq. 9
        s = arith.select(bad, nan, s)
        mult = vector.broadcast(ir.VectorType.get((2,), f32),
                                arith.mulf(g, _ptx_f32("rcp.approx.ftz.f32", s)))
        for j in range(2):
            for k in range(FACTOR):
                parts[k][i][j] = arith.mulf(z[j][k], mult)         # eqs. 8, 10
        row_scales.append([s] if gain is None else [s, gain])
    zq = _assemble(parts, _code_vec(codec), f32)
    code_ty = mgpu_utils.dtype_to_ir_type(CODE_FORMATS[codec.fmt])
    codes = zq.astype(code_ty).bitcast(ir.IntegerType.get_signless(8), output_is_signed=False)
    width = 4 * codec.n_scales
    slay = _scale_tiled(width)
    sregs = np.empty(slay.registers_shape((ROWS, width)), dtype=object)
    for i, vals in enumerate(row_scales):
        v = vector.from_elements(ir.VectorType.get((len(vals),), f32), vals)
        sregs.reshape(2)[i] = vector.bitcast(
            ir.VectorType.get((width,), ir.IntegerType.get_signless(8)), v)
    return codes, fa.FragmentedArray(_registers=sregs, _layout=slay, _is_signed=False)


def _decode_regs(acc, sbytes, codec, out_dtype):
    """acc: (64, 256) f32 WGMMA array, acc[:, 16c + r] = Σ_r' q[16c + r'] H[r', r] per
    row; sbytes: scale bytes. → values (value layout)."""
    f32 = ir.F32Type.get()
    sl = _slices(acc)
    parts = [[[None, None] for _ in range(2)] for _ in range(FACTOR)]
    for i in range(2):
        sv = vector.bitcast(ir.VectorType.get((codec.n_scales,), f32),
                            sbytes.registers.reshape(2)[i])
        gain = _elem(sv, 0)                                        # eq. 11
        if codec.transform == "ash":                               # eq. 13
            gain = arith.mulf(gain, _ptx_f32("rcp.approx.ftz.f32", _elem(sv, 1)))
        gain = vector.broadcast(ir.VectorType.get((2,), f32),
                                arith.mulf(gain, _f32(1 / np.sqrt(BLOCK))))
        for j in range(2):
            v = _butterfly([sl[c, j, i] for c in range(FACTOR)])    # eq. 12
            for k in range(FACTOR):
                parts[k][i][j] = arith.mulf(v[k], gain)
    vals = _assemble(parts, 8, f32)
    return vals.astype(mgpu_utils.dtype_to_ir_type(jnp.dtype(out_dtype)))


# -- Pallas-level tile functions ---------------------------------------------------------
@functools.cache
def _encode_epilogue(codec):
    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA,),
        return_type=(plgpu.ShapeDtypeStruct((ROWS, BLOCK), jnp.uint8, wire_layout(codec)),
                     plgpu.ShapeDtypeStruct((ROWS, 4 * codec.n_scales), jnp.uint8,
                                            scale_layout(codec))))
    def epilogue(ctx, y):
        del ctx
        return _encode_regs(y, codec)
    return epilogue


@functools.cache
def _decode_epilogue(codec, out_dtype):
    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA, scale_layout(codec)),
        return_type=plgpu.ShapeDtypeStruct((ROWS, BLOCK), out_dtype, value_layout()))
    def epilogue(ctx, acc, sbytes):
        del ctx
        return _decode_regs(acc, sbytes, codec, out_dtype)
    return epilogue


def encode_tile(x_smem, h_smem, codec):
    """(64, 256) bf16/f16 SMEM tile → (codes, scales) register arrays (module docstring)."""
    def transform(acc):
        for r in range(FACTOR):
            cols = pl.ds(FACTOR * r, FACTOR)
            plgpu.wgmma(acc.at[:, cols], x_smem.at[:, cols], h_smem)
        plgpu.wgmma_wait(0)
        return acc[...]
    y = pl.run_scoped(transform, plgpu.ACC((ROWS, BLOCK), jnp.float32))
    return _encode_epilogue(codec)(y)


def store_wire_tile(ref, codes, scales):
    ref.at[:, pl.ds(0, BLOCK)][...] = codes
    ref.at[:, pl.ds(BLOCK, scales.shape[1])][...] = scales


def load_wire_tile(ref, codec):
    """Wire rows (a (64, row_bytes) uint8 view) → codes (WGMMA layout), scale bytes."""
    codes = plgpu.load(ref.at[:, pl.ds(0, BLOCK)], layout=plgpu.Layout.WGMMA, optimized=False)
    scales = plgpu.load(ref.at[:, pl.ds(BLOCK, 4 * codec.n_scales)], layout=scale_layout(codec),
                        optimized=False)
    return codes, scales


def decode_tile(codes, scales, h_smem, codec, out_dtype=jnp.float32):
    """(codes, scales) of 64 wire rows → (64, 256) values in `value_layout()`."""
    def transform(acc):
        for c in range(FACTOR):
            cols = pl.ds(FACTOR * c, FACTOR)
            q = lax.bitcast_convert_type(codes[:, FACTOR * c:FACTOR * (c + 1)],
                                         CODE_FORMATS[codec.fmt]).astype(jnp.float16)
            plgpu.wgmma(acc.at[:, cols], q, h_smem)
        plgpu.wgmma_wait(0)
        return acc[...]
    acc = pl.run_scoped(transform, plgpu.ACC((ROWS, BLOCK), jnp.float32))
    return _decode_epilogue(codec, jnp.dtype(out_dtype).type)(acc, scales)


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


def _compress_kernel(x, hole, codec, cfg):
    n_rows = x.shape[0]
    n_tiles = n_rows // ROWS
    grid = cfg.grid(n_tiles)

    def body(x_gmem, h_gmem, hole_gmem, w_gmem, h_smem, barrier):
        _load_operand(h_gmem, h_smem, barrier)
        count, tile = _tiles_of_this_block(n_tiles, grid,
                                           None if hole is None else hole_gmem)

        def step(idx, x_smem):
            codes, scales = encode_tile(x_smem, h_smem, codec)
            store_wire_tile(w_gmem.at[pl.ds(tile(idx[0]) * ROWS, ROWS)], codes, scales)

        @pl.when(count > 0)
        def _():
            plgpu.emit_pipeline(
                step, grid=(count,), max_concurrent_steps=cfg.steps,
                in_specs=[plgpu.BlockSpec((ROWS, BLOCK), lambda i: (tile(i), 0),
                                          transforms=SMEM_TRANSFORMS)])(x_gmem)

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((n_rows, codec.row_bytes), jnp.uint8),
        grid=(grid,), grid_names=("blk",), kernel_name="taco_compress_mosaic",
        scratch_types=[plgpu.SMEM((FACTOR, FACTOR), x.dtype, transforms=SMEM_TRANSFORMS),
                       plgpu.Barrier()],
        compiler_params=plgpu.CompilerParams(lowering_semantics=LANE))
    return kernel(x, hadamard_operand("encode", x.dtype),
                  jnp.zeros(2, jnp.int32) if hole is None else hole)


def _decompress_kernel(w, codec, out_dtype, cfg):
    n_rows, row = w.shape
    n_tiles = n_rows // ROWS
    grid = cfg.grid(n_tiles)
    # A tile of wire rows is one contiguous run of ROWS·row bytes; rows of 264 bytes are not
    # a TMA stride (a multiple of 16), runs of 256-byte lines are.
    lines = ROWS * row // 256

    def body(w_gmem, h_gmem, o_gmem, h_smem, barrier):
        _load_operand(h_gmem, h_smem, barrier)
        count, tile = _tiles_of_this_block(n_tiles, grid)

        def step(idx, w_smem):
            codes, scales = load_wire_tile(w_smem.reshape(ROWS, row), codec)
            values = decode_tile(codes, scales, h_smem, codec, out_dtype)
            o_gmem.at[pl.ds(tile(idx[0]) * ROWS, ROWS)][...] = values
        plgpu.emit_pipeline(
            step, grid=(count,), max_concurrent_steps=cfg.steps,
            in_specs=[plgpu.BlockSpec((lines, 256), lambda i: (tile(i), 0))])(w_gmem)

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((n_rows, BLOCK), out_dtype),
        grid=(grid,), grid_names=("blk",), kernel_name="taco_decompress_mosaic",
        scratch_types=[plgpu.SMEM((FACTOR, FACTOR), jnp.float16, transforms=SMEM_TRANSFORMS),
                       plgpu.Barrier()],
        compiler_params=plgpu.CompilerParams(lowering_semantics=LANE))
    return kernel(w.reshape(n_rows * row // 256, 256), hadamard_operand("decode"))


def _check(kind, codec, shape, dtype):
    why = unsupported(kind, codec, shape, dtype)
    if why is not None:
        raise ValueError(f"Mosaic GPU {kind}: {why}")


@functools.partial(jax.jit, static_argnames=("codec", "cfg", "skip_rows"))
def compress(x, codec, cfg: MosaicConfig | None = None, skip_start=0, skip_rows: int = 0):
    """(n_blocks, 256) bf16/f16 → (n_blocks, row_bytes) uint8 wire rows; the same wire as
    `compress.compress` and `compress.compress_reference` (up to rounding ties). Tiles
    wholly inside rows [skip_start, skip_start + skip_rows) (skip_start may be traced) are
    not computed and their rows are left unwritten, as `compress.compress` does."""
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
    """(n_blocks, row_bytes) uint8 → (n_blocks, 256) out_dtype, as
    `decompress.decompress_reference`."""
    if w.ndim != 2 or w.shape[1] != codec.row_bytes:
        raise ValueError(f"Mosaic GPU decompress: got {w.shape=} for {codec}")
    _check("decompress", codec, w.shape, out_dtype)
    return _decompress_kernel(w, codec, jnp.dtype(out_dtype).type, cfg or MosaicConfig())
