"""The Hadamard FP8 codecs' tile math as Pallas Mosaic GPU register code (Hopper: wgmma),
B = 256: for their compress and decompress kernels (`taco`) and, as their tile codec
`TacoTiles` (the `kernels.tile_codec.TileCodec` protocol), for kernels that move wire rows
themselves (`kernels.fused`).

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

The per-block math is the Triton kernel's (`triton.compress.encode_tile`): with z0 =
H·x/256, Σz0² = mean(x²) (Parseval) gives α; s = α·16·max|z0|/Qmax; codes = cvt(z0 · α·16/s)
(satfinite: the cast saturates where the multiplier overshoots Qmax by an ulp); a block
whose Σz0² is NaN or whose max|z0| is not finite gets s = α = NaN, so it decodes to NaN.
rsqrt and the reciprocal are the GPU's approximate instructions (≤ 2 ulp), as in the Triton
kernels' default `fast_rowmath`. Unlike the Triton kernel on bf16 data, the transform's
intermediate stays f32 (the butterfly runs on the f32 accumulators).

Tile API — for kernels that move wire rows themselves (a fused all-reduce), inside a
`plgpu.kernel` with `compiler_params=plgpu.CompilerParams(lowering_semantics=LANE)`, one
warpgroup per 64 rows. `parts` (1 or 2) splits a tile's 256 columns into that many passes
(2 halves the registers a thread holds); each "part" below covers the columns
[p·256/parts, (p+1)·256/parts).

  ROWS = 64, BLOCK = 256, SMEM_TRANSFORMS = (tiling (8, 16), 32-byte swizzle).

  hadamard_operand(kind, dtype) -> (16, 16) array
      the transform's factor; copy it once into an SMEM ref with SMEM_TRANSFORMS
      (`plgpu.SMEM((16, 16), dtype, transforms=SMEM_TRANSFORMS)`).
      kind="encode": H/256 in the input's dtype; kind="decode": H (±1) in f16.

  encode_tile(x_smem, h_smem, codec, parts=1) -> (codes, scales)
      x_smem: (64, 256) bf16 or f16 SMEM ref with SMEM_TRANSFORMS (what a TMA copy or an
      emit_pipeline BlockSpec with those transforms gives), one block per row.
      codes: list of `parts` (64, 256/parts) uint8 register arrays in
      wire_layout(codec, parts), the wire row bytes [0, 256); scales: (64, 4·n_scales)
      uint8 in scale_layout(codec), the bytes [256, row_bytes).

  store_wire_tile(ref, codes, scales)
      ref: a (64, row_bytes) uint8 view of 64 wire rows: SMEM (e.g. a (64·row_bytes/256,
      256) TMA staging buffer reshaped to (64, row_bytes)) or GMEM; 8-byte stores (4 for
      one scale), so rows must be 8-byte aligned (4). Staging in SMEM and a TMA copy out is
      the fast path (see `taco.MosaicConfig.tma_store`).

  load_wire_tile(ref, codec) -> (codes, scales)
      codes (64, 256) uint8 in the WGMMA layout, scales as above, from such a view.

  decode_tile(codes, scales, h_smem, codec, out_dtype=jnp.float32, parts=1) -> values
      values: list of `parts` (64, 256/parts) out_dtype arrays in
      value_layout(out_dtype, parts), blocks in natural element order; add parts of the
      same layout elementwise, or write them with `registers.store_values(ref, values)`
      into a (64, 256) view (an SMEM tile with `registers.swizzled(out_dtype)`'s
      transforms for a TMA copy, or GMEM).

  TacoTiles(codec): the same math as a tile codec (`kernels.tile_codec`), with the
  fused kernels' options (`sum_first`, `encode_parts`) and the owner's sum of the
  two-shot all-reduce as transform coefficients (`coefficients`, `add_coefficients`,
  `encode_coefficients`).
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

from taco_jax import _jax_private
from taco_jax.codec_registry import family
from taco_jax.kernels.mosaic.registers import (BLOCK, FACTOR, ROWS, elem, f32_const,
                                               pallas_layout, ptx_f32, scale_tiled,
                                               value_layout, value_vec, wire_tiled)
from taco_jax.numerics import hadamard, quant

SMEM_TRANSFORMS = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))
CODE_FORMATS = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
IN_DTYPES = (jnp.bfloat16, jnp.float16)
OUT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def _code_vec(codec) -> int:
    return 8 if codec.row_bytes % 8 == 0 else 4


def wire_layout(codec, parts: int = 1):
    """Pallas layout of each of encode_tile's code parts (see `_wire_tiled`)."""
    return pallas_layout(wire_tiled(_code_vec(codec), BLOCK // parts))


def scale_layout(codec):
    return pallas_layout(scale_tiled(4 * codec.n_scales))


ROW_LAYOUT = plgpu.Layout.WGMMA.reduce(1)      # (64,) per-row values, as WGMMA rows


# -- what is covered ------------------------------------------------------------------------
def unsupported(kind: str, codec, shape, dtype) -> str | None:
    """Why the Mosaic kernel does not cover this call, or None if it does. kind:
    "compress" (dtype: the input's) or "decompress" (dtype: the output's)."""
    if kind not in ("compress", "decompress"):
        return f"no Mosaic GPU {kind} kernel"
    # the TACO codecs with per-block scales name this provider; the fields read below are
    # theirs (`codecs.BlockCodec`)
    if family(codec) != "taco":
        return f"{codec.name}: not a per-block TACO codec (no per-block kernel)"
    if codec.block_size != BLOCK:
        return f"block size {codec.block_size} (the Mosaic kernels have B = {BLOCK})"
    if codec.transform not in ("ash", "hadamard") or codec.fmt not in CODE_FORMATS:
        return f"{codec.name}: transform {codec.transform}, codes {codec.fmt} (covered: " \
               f"Hadamard transforms with FP8 codes)"
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
    """(64, 16·n) WGMMA-layout accumulator of 16 slices of n columns → registers
    [slice, j, row half] (vector<2> each; slice s holds columns n·s + 8j .. n·s + 8j + 7)."""
    n8 = arr.shape[1] // 8 // FACTOR
    return arr.registers.reshape(arr.shape[1] // 8, 2).reshape(FACTOR, n8, 2)


def transformed(acc) -> list:
    """Butterfly across the 16 slices: [row half][j] → 16 vectors (index: minor k)."""
    sl = _slices(acc)
    return [[_butterfly([sl[r, j, i] for r in range(FACTOR)]) for j in range(sl.shape[1])]
            for i in range(2)]


def assemble(z, vec: int, dtype, scale=None) -> fa.FragmentedArray:
    """z[i][j][k]: vector<2> of this thread's row half i, slice half j, minor index k
    (element 16c + k of the wire / value layout, c = 8j + 2(lane%4) + e), times scale[i]
    if given. Builds the `_wire_tiled` array: only register names move."""
    nj = len(z[0])
    layout = wire_tiled(vec, 128 * nj)
    regs = np.empty(layout.registers_shape((ROWS, 128 * nj)), dtype=object)
    view = regs.reshape(2, nj, 2, FACTOR // vec)          # (i, j, e, h)
    vty = ir.VectorType.get((vec,), dtype)
    for i, j in np.ndindex(2, nj):
        vals = z[i][j] if scale is None else [arith.mulf(v, scale[i]) for v in z[i][j]]
        for e, h in np.ndindex(2, FACTOR // vec):
            view[i, j, e, h] = vector.from_elements(
                vty, [elem(vals[h * vec + m], e) for m in range(vec)])
    return _jax_private.fragmented_array(regs, layout, is_signed=None)


def _row_stats(vals):
    """Σv² and max|v| over this thread's vectors (of any length), then over the 4 lanes of
    the row."""
    ss = m = None
    for v in vals:
        sq, av = arith.mulf(v, v), mlir_math.absf(v)
        ss = sq if ss is None else arith.addf(ss, sq)
        m = av if m is None else arith.maximumf(m, av)   # NaN-propagating
    n = ir.VectorType(ss.type).shape[0]
    ss_v, m_v = ss, m
    ss = elem(ss_v, 0)
    for k in range(1, n):
        ss = arith.addf(ss, elem(ss_v, k))
    m = elem(m_v, 0)
    for k in range(1, n):
        m = arith.maximumf(m, elem(m_v, k))
    for d in (1, 2):
        ss = arith.addf(ss, mgpu_utils.shfl_bfly(ss, d))
        m = arith.maximumf(m, mgpu_utils.shfl_bfly(m, d))
    return ss, m


def _row_array(vals) -> fa.FragmentedArray:
    """Two f32 scalars (row halves of this thread) → a (64,) array in the row layout."""
    layout = ROW_LAYOUT.to_mgpu()
    regs = np.empty(layout.registers_shape((ROWS,)), dtype=object)
    vty = ir.VectorType.get((1,), ir.F32Type.get())
    for i, v in enumerate(vals):
        regs.reshape(2)[i] = vector.from_elements(vty, [v])
    return _jax_private.fragmented_array(regs, layout, is_signed=None)


def _row_values(arr) -> list:
    return [elem(r, 0) for r in arr.registers.reshape(2)]


def _stats_regs(acc):
    z = transformed(acc)
    stats = [_row_stats([v for j in z[i] for v in j]) for i in range(2)]
    return _row_array([a for a, _ in stats]), _row_array([b for _, b in stats])


def _codes(z, mult, codec):
    zq = assemble(z, _code_vec(codec), ir.F32Type.get(), mult)
    code_ty = mgpu_utils.dtype_to_ir_type(CODE_FORMATS[codec.fmt])
    return zq.astype(code_ty).bitcast(ir.IntegerType.get_signless(8), output_is_signed=False)


def _row_scale(ss, m, codec):
    """A row's Σz0² and max|z0| → (its scale bytes as a vector<4·n_scales x i8>, the code
    multiplier α·16/s): eqs. 6–7 and 9; a row whose Σz0² is NaN or whose max is not finite
    gets s = α = NaN (it decodes to NaN)."""
    f32 = ir.F32Type.get()
    nan = f32_const(np.nan)
    bad = arith.ori(arith.cmpf(arith.CmpFPredicate.UNO, ss, ss),
                    arith.cmpf(arith.CmpFPredicate.UGE, m, f32_const(np.inf)))
    if codec.transform == "ash":                                   # eqs. 6–7
        a = arith.mulf(ptx_f32("rsqrt.approx.ftz.f32", arith.addf(ss, f32_const(quant.EPS))),
                       f32_const(quant.TAU))
        a = arith.minimumf(arith.maximumf(a, f32_const(quant.ALPHA_MIN)),
                           f32_const(quant.ALPHA_MAX))
        gain = arith.select(bad, nan, a)
        g = arith.mulf(gain, f32_const(np.sqrt(BLOCK)))
    else:
        gain, g = None, f32_const(np.sqrt(BLOCK))
    s = arith.maximumf(arith.mulf(arith.mulf(m, g), f32_const(1.0 / codec.qmax)),
                       f32_const(quant.SCALE_MIN))                 # eq. 9
    s = arith.select(bad, nan, s)
    mult = arith.mulf(g, ptx_f32("rcp.approx.ftz.f32", s))
    vals = [s] if gain is None else [s, gain]
    v = vector.from_elements(ir.VectorType.get((len(vals),), f32), vals)
    sbytes = vector.bitcast(ir.VectorType.get((4 * codec.n_scales,),
                                              ir.IntegerType.get_signless(8)), v)
    return sbytes, mult


def _scale_array(row_bytes, codec) -> fa.FragmentedArray:
    """Two rows' scale bytes (this thread's row halves) → a scale_layout array."""
    width = 4 * codec.n_scales
    slay = scale_tiled(width)
    sregs = np.empty(slay.registers_shape((ROWS, width)), dtype=object)
    for i, v in enumerate(row_bytes):
        sregs.reshape(2)[i] = v
    return _jax_private.fragmented_array(sregs, slay, is_signed=False)


def _quantize_regs(acc, ss0, m0, codec):
    """acc: a part's accumulator (z0 = H·x/256 in slices); ss0, m0: the row statistics of
    the other parts (None if none). → codes of this part, scale bytes, code multiplier."""
    f32 = ir.F32Type.get()
    z = transformed(acc)
    sbytes, mults = [], []
    for i in range(2):
        ss, m = _row_stats([v for j in z[i] for v in j])           # Σz0² = mean(x²)
        if ss0 is not None:
            ss = arith.addf(ss, _row_values(ss0)[i])
            m = arith.maximumf(m, _row_values(m0)[i])
        b, mult = _row_scale(ss, m, codec)
        sbytes.append(b)
        mults.append(mult)
    mult_v = [vector.broadcast(ir.VectorType.get((2,), f32), m) for m in mults]
    codes = _codes(z, mult_v, codec)                               # eqs. 8, 10
    return codes, _scale_array(sbytes, codec), _row_array(mults)


def _requantize_regs(acc, mult, codec):
    f32 = ir.F32Type.get()
    mult_v = [vector.broadcast(ir.VectorType.get((2,), f32), m) for m in _row_values(mult)]
    return _codes(transformed(acc), mult_v, codec)


def row_gains(codec, sbytes, vec: int | None = None) -> list:
    """The decode gain of this thread's two rows: s (eq. 11), over α for "ash" (eq. 13),
    times the transform's 1/√256: a code q of the row stands for the coefficient
    z0 = q · gain (and the value H·(q·gain)·H). f32 scalars, or vector<vec> broadcasts."""
    f32 = ir.F32Type.get()
    gains = []
    for i in range(2):
        sv = vector.bitcast(ir.VectorType.get((codec.n_scales,), f32),
                            sbytes.registers.reshape(2)[i])
        gain = elem(sv, 0)                                         # eq. 11
        if codec.transform == "ash":                               # eq. 13
            gain = arith.mulf(gain, ptx_f32("rcp.approx.ftz.f32", elem(sv, 1)))
        gain = arith.mulf(gain, f32_const(1 / np.sqrt(BLOCK)))
        gains.append(gain if vec is None else
                     vector.broadcast(ir.VectorType.get((vec,), f32), gain))
    return gains


def _decode_regs(acc, sbytes, codec, out_dtype):
    """acc: a part's accumulator, slice c holding Σ_r' q[16c + r'] H[r', r] for this
    part's r; sbytes: scale bytes → values of this part (value layout)."""
    f32 = ir.F32Type.get()
    gains = row_gains(codec, sbytes, 2)
    vals = assemble(transformed(acc), value_vec(out_dtype), f32, gains)      # eq. 12
    return vals.astype(mgpu_utils.dtype_to_ir_type(jnp.dtype(out_dtype)))


# -- the coefficients z0 of a tile, in the wire layout (sums of decoded tiles) --------------
# The transform is orthogonal: a wire tile decodes to the coefficients z0 = q·gain of its
# rows before the inverse transform, and H·(Σ values) = Σ H·values. So tiles are summed as
# coefficients, each element where its code sits on the wire (`wire_layout`), with neither a
# transform per tile nor one back before the sum is encoded again: the owner's sum in the
# two-shot all-reduce.
def _rows_of(arr) -> np.ndarray:
    """A wire-layout array's registers by this thread's row half: [i, …]."""
    return arr.registers.reshape(2, -1)


def coefficients_layout(codec):
    return wire_layout(codec)


def _coefficients_regs(acc, codec):
    return assemble(transformed(acc), _code_vec(codec), ir.F32Type.get())


def _add_coefficients_regs(total, codes, sbytes, codec):
    f32 = ir.F32Type.get()
    q = codes.bitcast(mgpu_utils.dtype_to_ir_type(CODE_FORMATS[codec.fmt])).astype(
        ir.F16Type.get()).astype(f32)
    gains = row_gains(codec, sbytes, _code_vec(codec))
    qr, out = _rows_of(q), np.empty_like(q.registers)
    view = None if total is None else _rows_of(total)
    res = out.reshape(2, -1)
    for i, k in np.ndindex(qr.shape):
        v = arith.mulf(qr[i, k], gains[i])
        res[i, k] = v if view is None else arith.addf(view[i, k], v)
    return _jax_private.fragmented_array(out, q.layout, is_signed=None)


def _quantize_coefficients_regs(z, codec):
    f32 = ir.F32Type.get()
    rows = _rows_of(z)
    sbytes, mults = [], []
    for i in range(2):
        ss, m = _row_stats(list(rows[i]))
        b, mult = _row_scale(ss, m, codec)
        sbytes.append(b)
        mults.append(vector.broadcast(ir.VectorType.get((_code_vec(codec),), f32), mult))
    regs = np.empty_like(z.registers)
    out = regs.reshape(2, -1)
    for i, k in np.ndindex(rows.shape):
        out[i, k] = arith.mulf(rows[i, k], mults[i])
    zq = _jax_private.fragmented_array(regs, z.layout, is_signed=None)
    code_ty = mgpu_utils.dtype_to_ir_type(CODE_FORMATS[codec.fmt])
    codes = zq.astype(code_ty).bitcast(ir.IntegerType.get_signless(8), output_is_signed=False)
    return codes, _scale_array(sbytes, codec)


# -- Pallas-level tile functions ---------------------------------------------------------
def _acc_layout():
    return plgpu.Layout.WGMMA


@functools.cache
def _stats_fn(parts):
    @plgpu.inline_mgpu(arg_types=(_acc_layout(),),
                       return_type=(plgpu.ShapeDtypeStruct((ROWS,), jnp.float32, ROW_LAYOUT),) * 2)
    def stats(ctx, acc):
        del ctx
        return _stats_regs(acc)
    return stats


@functools.cache
def quantize_fn(codec, parts):
    @plgpu.inline_mgpu(
        arg_types=(_acc_layout(),) + (ROW_LAYOUT, ROW_LAYOUT) * (parts > 1),
        return_type=(plgpu.ShapeDtypeStruct((ROWS, BLOCK // parts), jnp.uint8,
                                            wire_layout(codec, parts)),
                     plgpu.ShapeDtypeStruct((ROWS, 4 * codec.n_scales), jnp.uint8,
                                            scale_layout(codec)),
                     plgpu.ShapeDtypeStruct((ROWS,), jnp.float32, ROW_LAYOUT)))
    def quantize(ctx, acc, ss0=None, m0=None):
        del ctx
        return _quantize_regs(acc, ss0, m0, codec)
    return quantize


@functools.cache
def _requantize_fn(codec, parts):
    @plgpu.inline_mgpu(
        arg_types=(_acc_layout(), ROW_LAYOUT),
        return_type=plgpu.ShapeDtypeStruct((ROWS, BLOCK // parts), jnp.uint8,
                                           wire_layout(codec, parts)))
    def requantize(ctx, acc, mult):
        del ctx
        return _requantize_regs(acc, mult, codec)
    return requantize


@functools.cache
def _decode_fn(codec, out_dtype, parts):
    @plgpu.inline_mgpu(
        arg_types=(_acc_layout(), scale_layout(codec)),
        return_type=plgpu.ShapeDtypeStruct((ROWS, BLOCK // parts), out_dtype,
                                           value_layout(out_dtype, parts)))
    def decode(ctx, acc, sbytes):
        del ctx
        return _decode_regs(acc, sbytes, codec, out_dtype)
    return decode


def factor_cols(h_smem, part: int, parts: int):
    """Columns [n·part, n·part + n) of H (n = 16/parts) as a wgmma B operand: H is
    symmetric, so they are rows of the SMEM copy, read transposed (K-major)."""
    n = FACTOR // parts
    return h_smem.at[pl.ds(n * part, n)].transpose((1, 0))


def transform_part(lhs, h_smem, part: int, parts: int):
    """acc[:, n·s + m] = Σ_k lhs(s)[:, k] · H[k, n·part + m] for the 16 slices s: one
    wgmma (64 × n × 16) per slice; lhs(s) is an SMEM slice or a register array."""
    n = FACTOR // parts
    b = factor_cols(h_smem, part, parts)

    def run(acc):
        for sl in range(FACTOR):
            plgpu.wgmma(acc.at[:, pl.ds(n * sl, n)], lhs(sl), b)
        plgpu.wgmma_wait(0)
        return acc[...]
    return pl.run_scoped(run, plgpu.ACC((ROWS, n * FACTOR), jnp.float32))


@functools.cache
def _coefficients_fn(codec):
    coeff = plgpu.ShapeDtypeStruct((ROWS, BLOCK), jnp.float32, coefficients_layout(codec))

    @plgpu.inline_mgpu(arg_types=(_acc_layout(),), return_type=coeff)
    def coefficients(ctx, acc):
        del ctx
        return _coefficients_regs(acc, codec)
    return coefficients


@functools.cache
def _add_coefficients_fn(codec, first: bool):
    coeff = plgpu.ShapeDtypeStruct((ROWS, BLOCK), jnp.float32, coefficients_layout(codec))
    args = (wire_layout(codec), scale_layout(codec)) + (() if first else (coefficients_layout(codec),))

    @plgpu.inline_mgpu(arg_types=args, return_type=coeff)
    def add(ctx, codes, sbytes, total=None):
        del ctx
        return _add_coefficients_regs(total, codes, sbytes, codec)
    return add


@functools.cache
def _quantize_coefficients_fn(codec):
    @plgpu.inline_mgpu(
        arg_types=(coefficients_layout(codec),),
        return_type=(plgpu.ShapeDtypeStruct((ROWS, BLOCK), jnp.uint8, wire_layout(codec)),
                     plgpu.ShapeDtypeStruct((ROWS, 4 * codec.n_scales), jnp.uint8,
                                            scale_layout(codec))))
    def quantize(ctx, z):
        del ctx
        return _quantize_coefficients_regs(z, codec)
    return quantize


def coefficients(acc, codec):
    """A tile's transform accumulator (`transform_part`, one part) → its coefficients z0,
    (64, 256) f32 in coefficients_layout(codec): element [r, j] is the coefficient whose
    code is byte j of wire row r."""
    return _coefficients_fn(codec)(acc)


def load_wire_codes(ref, codec):
    """Wire rows (a (64, row_bytes) uint8 view) → codes in the wire layout (where
    `coefficients` holds their coefficients), scale bytes."""
    codes = plgpu.load(ref.at[:, pl.ds(0, BLOCK)], layout=wire_layout(codec), optimized=False)
    scales = plgpu.load(ref.at[:, pl.ds(BLOCK, 4 * codec.n_scales)], layout=scale_layout(codec),
                        optimized=False)
    return codes, scales


def add_coefficients(codes, scales, codec, total=None):
    """total + the coefficients of a wire tile (`load_wire_codes`), z0 = q · gain per row,
    in f32: no transform."""
    args = (codes, scales) + (() if total is None else (total,))
    return _add_coefficients_fn(codec, total is None)(*args)


def encode_coefficients(z, codec):
    """Coefficients (coefficients_layout) → (codes, scale bytes) of their wire tile: the
    encode's quantization (eqs. 6–10) without its transform (`encode_tile`'s wire, as
    `store_wire_tile` takes it with [codes])."""
    codes, scales = _quantize_coefficients_fn(codec)(z)
    return [codes], scales


def encode_tile(x_smem, h_smem, codec, parts: int = 1):
    """(64, 256) bf16/f16 SMEM tile → (code parts, scale bytes): `parts` register arrays
    of (64, 256/parts) uint8 in wire_layout(codec, parts) covering the row bytes
    [p·256/parts, (p+1)·256/parts), and (64, 4·n_scales) uint8 (module docstring)."""
    def lhs(sl):
        return x_smem.at[:, pl.ds(FACTOR * sl, FACTOR)]
    if parts == 1:
        codes, scales, _ = quantize_fn(codec, 1)(transform_part(lhs, h_smem, 0, 1))
        return [codes], scales
    ss0, m0 = _stats_fn(2)(transform_part(lhs, h_smem, 0, 2))
    codes1, scales, mult = quantize_fn(codec, 2)(transform_part(lhs, h_smem, 1, 2), ss0, m0)
    codes0 = _requantize_fn(codec, 2)(transform_part(lhs, h_smem, 0, 2), mult)
    return [codes0, codes1], scales


def store_wire_tile(ref, codes, scales):
    """Code parts and scale bytes → a (64, row_bytes) uint8 view of 64 wire rows."""
    width = BLOCK // len(codes)
    for p, part in enumerate(codes):
        _jax_private.mgpu_store(ref.at[:, pl.ds(width * p, width)], part)
    _jax_private.mgpu_store(ref.at[:, pl.ds(BLOCK, scales.shape[1])], scales)


def load_wire_tile(ref, codec):
    """Wire rows (a (64, row_bytes) uint8 view) → codes (WGMMA layout), scale bytes."""
    codes = plgpu.load(ref.at[:, pl.ds(0, BLOCK)], layout=plgpu.Layout.WGMMA, optimized=False)
    scales = plgpu.load(ref.at[:, pl.ds(BLOCK, 4 * codec.n_scales)], layout=scale_layout(codec),
                        optimized=False)
    return codes, scales


def decode_tile(codes, scales, h_smem, codec, out_dtype=jnp.float32, parts: int = 1):
    """(codes, scales) of 64 wire rows → value parts: `parts` (64, 256/parts) arrays in
    value_layout(parts) covering columns [p·256/parts, (p+1)·256/parts)."""
    fmt = CODE_FORMATS[codec.fmt]
    q = [lax.bitcast_convert_type(codes[:, FACTOR * c:FACTOR * (c + 1)], fmt)
         .astype(jnp.float16) for c in range(FACTOR)]
    decode = _decode_fn(codec, jnp.dtype(out_dtype).type, parts)
    return [decode(transform_part(lambda c: q[c], h_smem, p, parts), scales)
            for p in range(parts)]


# -- the tile codec (`kernels.tile_codec.TileCodec`) ------------------------------------------
@dataclasses.dataclass(frozen=True)
class TacoTiles:
    """The Hadamard FP8 codecs with B = 256 (taco, taco-e5m2, taco-1scale) as a tile codec: a
    block per tile row, the wgmma transform above; f32 input is encoded from bf16 (its
    staged copy: the wgmma's operand)."""
    codec: object
    # FusedConfig.decode == "sum_first": decode_add keeps the running sum before the
    # butterfly (the wgmma accumulators scaled by their gains) and `finish` completes it.
    sum_first: bool = False
    encode_parts: int = 1                  # FusedConfig.encode_parts: encode_tile's parts

    options = frozenset({"sum_first", "encode_parts", "warp_specialized"})

    @property
    def row_bytes(self) -> int:
        return self.codec.row_bytes

    def unsupported(self, dtype) -> str | None:
        enc = jnp.bfloat16 if jnp.dtype(dtype) == jnp.float32 else dtype
        return (unsupported("compress", self.codec, (ROWS, BLOCK), enc)
                or unsupported("decompress", self.codec, (ROWS, BLOCK), dtype))

    def _staged(self, in_dtype) -> bool:
        """f32 input goes through a bf16 copy in shared memory (the wgmma's operand)."""
        return jnp.dtype(in_dtype) == jnp.float32

    def x_transforms(self, in_dtype) -> tuple:
        return () if self._staged(in_dtype) else SMEM_TRANSFORMS

    def x_slots(self, in_dtype) -> int:
        return 1 if self._staged(in_dtype) else 2

    def staging(self, in_dtype):
        if not self._staged(in_dtype):
            return None
        return plgpu.SMEM((ROWS, BLOCK), jnp.bfloat16, transforms=SMEM_TRANSFORMS)

    def operands(self, in_dtype) -> tuple:
        """(encode factor, decode factor), each with its SMEM transforms."""
        enc = jnp.bfloat16 if self._staged(in_dtype) else in_dtype
        return ((hadamard_operand("encode", enc), SMEM_TRANSFORMS),
                (hadamard_operand("decode"), SMEM_TRANSFORMS))

    def encode(self, x_smem, consts):
        return encode_tile(x_smem, consts[0], self.codec, self.encode_parts)

    def store(self, view, wire):
        store_wire_tile(view, *wire)

    def load(self, view, part: int, parts: int):
        del part, parts                    # the whole tile: a part's wgmma reads every code
        return load_wire_tile(view, self.codec)

    def decode_add(self, wire, consts, vec: int, part: int, parts: int, total=None):
        codes, scales = wire
        fmt = CODE_FORMATS[self.codec.fmt]
        q = [lax.bitcast_convert_type(codes[:, 16 * c:16 * (c + 1)], fmt)
             .astype(jnp.float16) for c in range(FACTOR)]
        acc = transform_part(lambda c: q[c], consts[1], part, parts)
        rest = () if total is None else (total,)
        if self.sum_first:
            return _gain_add_fn(self.codec, parts, total is None)(acc, scales, *rest)
        return _decode_add_fn(self.codec, vec, parts, total is None)(acc, scales, *rest)

    def finish(self, total, vec: int, parts: int):
        """decode_add's running sum of a column part → its values (value layout)."""
        return _finish_fn(vec, parts)(total) if self.sum_first else total

    def decode(self, view, consts, out_dtype, parts: int):
        codes, scales = load_wire_tile(view, self.codec)
        return decode_tile(codes, scales, consts[1], self.codec, out_dtype, parts)

    # The owner's sum, summed as the transform's coefficients (`coefficients`): a wire tile
    # adds q·gain per code, with no transform, and the sum is quantized as it is (no
    # transform back and forth).
    def own_scratch(self, in_dtype) -> tuple:
        """The owner's exact tile (its TMA copy) and, for f32 input, its split into two bf16
        tiles (the transform's operands)."""
        own = plgpu.SMEM((ROWS, BLOCK), in_dtype, transforms=self.x_transforms(in_dtype))
        if not self._staged(in_dtype):
            return (own,)
        return (own, plgpu.SMEM((2, ROWS, BLOCK), jnp.bfloat16, transforms=SMEM_TRANSFORMS))

    def sum_init(self, own, consts):
        """The owner's exact tile → its coefficients (f32). For f32 input the tile is held
        as two bf16 tiles, its rounding and the remainder; the transform is linear, so both
        go through one wgmma accumulator (to ~2⁻¹⁶ of the value, far below FP8's step)."""
        x_smem = own[0]
        if len(own) == 1:
            acc = transform_part(lambda sl: x_smem.at[:, pl.ds(FACTOR * sl, FACTOR)],
                                 consts[0], 0, 1)
            return coefficients(acc, self.codec)
        hl = own[1]
        v = plgpu.load(x_smem, layout=plgpu.Layout.WGMMA, optimized=False)
        hi = v.astype(jnp.bfloat16)
        hl[0] = hi
        hl[1] = (v - hi.astype(jnp.float32)).astype(jnp.bfloat16)
        plgpu.commit_smem()
        b = factor_cols(consts[0], 0, 1)
        f = FACTOR

        def run(acc):
            for sl in range(f):
                for h in range(2):
                    plgpu.wgmma(acc.at[:, pl.ds(f * sl, f)], hl.at[h].at[:, pl.ds(f * sl, f)], b)
            plgpu.wgmma_wait(0)
            return acc[...]
        acc = pl.run_scoped(run, plgpu.ACC((ROWS, BLOCK), jnp.float32))
        return coefficients(acc, self.codec)

    def sum_load(self, view):
        return load_wire_codes(view, self.codec)

    def sum_add(self, total, wire, consts):
        del consts
        return add_coefficients(*wire, self.codec, total)

    def sum_encode(self, total):
        return encode_coefficients(total, self.codec)

    def encoded(self, v):
        return v.astype(jnp.bfloat16) if v.dtype == jnp.float32 else v

    def code_step(self, wire):
        """The code format's spacing at Qmax, times s, over α·√B where the row is
        transformed."""
        c = self.codec
        dtype = jnp.dtype(c.code_dtype)
        spacing = (1.0 if jnp.issubdtype(dtype, jnp.integer) else
                   2.0 ** (np.floor(np.log2(c.qmax)) - jnp.finfo(dtype).nmant))
        scales = quant.unpack_scales(wire[:, c.block_size:], c.n_scales)
        step = scales[0] * np.float32(spacing)
        if c.transform != "none":
            step = step * np.float32(1 / np.sqrt(c.block_size))
        return step / scales[1] if c.transform == "ash" else step


# decode and add, in registers: built from the register helpers above (`assemble`,
# `transformed`, `row_gains`), as `decode_tile`'s math without its final cast, so that P
# tiles sum in f32 in one register array (decode_tile returns every part of a tile at
# once, cast, which would hold two f32 tiles in registers while summing)
@functools.cache
def _decode_add_fn(codec, vec: int, parts: int, first: bool):
    """One column part of a decoded tile (f32, value layout of `vec`-element vectors), plus
    the running sum of the previous devices' (unless first)."""
    layout = pallas_layout(wire_tiled(vec, BLOCK // parts))
    out = plgpu.ShapeDtypeStruct((ROWS, BLOCK // parts), jnp.float32, layout)
    args = (plgpu.Layout.WGMMA, scale_layout(codec)) + (() if first else (layout,))

    @plgpu.inline_mgpu(arg_types=args, return_type=out)
    def decode_add(ctx, acc, sbytes, total=None):
        del ctx
        vals = assemble(transformed(acc), vec, ir.F32Type.get(),
                        row_gains(codec, sbytes, 2))                         # eq. 12
        return vals if total is None else total + vals
    return decode_add


@functools.cache
def _gain_add_fn(codec, parts: int, first: bool):
    """decode="sum_first": a tile's wgmma accumulator for one column part (WGMMA layout,
    before the butterfly), each row times its gain, plus the running sum (unless first)."""
    wgmma = plgpu.Layout.WGMMA
    out = plgpu.ShapeDtypeStruct((ROWS, BLOCK // parts), jnp.float32, wgmma)
    args = (wgmma, scale_layout(codec)) + (() if first else (wgmma,))

    @plgpu.inline_mgpu(arg_types=args, return_type=out)
    def gain_add(ctx, acc, sbytes, total=None):
        del ctx
        gains = row_gains(codec, sbytes, 2)
        regs = acc.registers.reshape(-1, 2)                  # [column group, row half]
        prev = None if total is None else total.registers.reshape(-1, 2)
        res = np.empty_like(regs)
        for c, i in np.ndindex(regs.shape):
            v = arith.mulf(regs[c, i], gains[i])
            res[c, i] = v if prev is None else arith.addf(prev[c, i], v)
        return _jax_private.fragmented_array(res.reshape(acc.registers.shape), acc.layout,
                                             is_signed=None)
    return gain_add


@functools.cache
def _finish_fn(vec: int, parts: int):
    """decode="sum_first": the gain-scaled sum of the P accumulators → the butterfly and
    assembly of `_decode_add_fn`, once (value layout of `vec`-element vectors)."""
    layout = pallas_layout(wire_tiled(vec, BLOCK // parts))
    out = plgpu.ShapeDtypeStruct((ROWS, BLOCK // parts), jnp.float32, layout)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,), return_type=out)
    def finish(ctx, total):
        del ctx
        return assemble(transformed(total), vec, ir.F32Type.get())
    return finish
