"""echo4's tile math as Pallas Mosaic GPU register code (Hopper), for kernels that move wire
rows themselves, which take it as echo4's tile codec (`Echo4Tiles`, the
`kernels.tile_codec.TileCodec` protocol). Mosaic GPU kernels do not run in Pallas'
interpreter: on CPU they only lower (the tests check that); the bytes are checked on a GPU.

Tile. 64 rows of 256 values, one warpgroup; each tile row holds two of echo4's groups of
B = 128 (columns [0, 128) and [128, 256)), and its wire row is their two codec rows:
2 × 72 = 144 bytes, [codes g0 (64) | s0, z0 (f32) | codes g1 (64) | s1, z1]. The 64 wire
rows of a tile are therefore the codec's wire rows of its 128 groups, byte for byte
(`codecs.get("echo4").compress_reference` of the values as (128, 128) groups), and a tile
is 64·144 = 9216 bytes, 36 lines of 256.

Registers. Values are held in the value layout (`registers.value_layout`): rows as in
the WGMMA layout (lane l: rows l//4 and l//4 + 8 of its warp's 16), and of each row the
columns 16c .. 16c + 15 for c = 8j + 2(l%4) + e (e ∈ {0, 1}, j < 2). So a thread holds 32
values of group j of each of its two rows, the 4 lanes of a row the whole group: a group's
min and max are 32 in-thread steps and two butterfly shuffles. A run of 16 consecutive
values is 8 consecutive code bytes (element 2i the low nibble of byte i): one 8-byte
store, no shuffle of codes between lanes (`code_layout`).

Math (the codec's `asym_params`, `quantize4`, `dequantize4`; the Triton kernels'
`encode_tile`, which match them bit for bit on the H200):
  lo, hi = min(min x, 0), max(max x, 0) over the group;
  s = max((hi/2 − lo/2)·(2/15), FLT_MIN), its reciprocal by `rcp.approx.f32` (what XLA
      emits for 1/s on the GPU, and what the Triton kernels use);
  z = clip(rint(−lo·(1/s)), 0, 15), q = clip(rint(x·(1/s)) + z, 0, 15), rint rounding
      half to even (z by `cvt.rni`; the codes by an added 1.5·2^23, off the conversion
      unit: `_code_bytes`), each product rounded before anything is added to it;
  a group holding NaN or ±Inf: codes 0, s = NaN, z = 0 (it decodes to NaN).
  decode: (q − z)·s, q − z from the code's bits under 2^23's (`_decode_run`), the product
      rounded by `mul.rn` (never fused into the sum it joins).

Tile API, inside a `plgpu.kernel` with Lane lowering semantics:

  ROWS = 64, WIDTH = 256, row_bytes(codec) = 144 (a tile row's wire bytes).

  encode_tile(x_ref) -> wire
      x_ref: a (64, 256) bf16, f16 or f32 ref (SMEM without transforms, or GMEM).
  encode_values(x) -> wire
      x: (64, 256) f32 in registers, value layout of 4-element vectors.
  store_wire_tile(ref, wire)
      ref: a (64, 144) uint8 view of 64 wire rows (SMEM or GMEM; rows 8-byte aligned).
  load_wire_tile(ref, part=0, parts=1) -> wire
      the groups of column part `part` of `parts` (1: both groups, 2: group `part`).
  decode_add(wire, vec, total=None) -> (64, 256/parts) f32
      in `registers.wire_tiled(vec, 256/parts)` (the value layout of vec-element vectors),
      plus `total` (an array of that layout) if given.

  Echo4Tiles(codec): the same as a tile codec (`kernels.tile_codec`).
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
from taco_jax.kernels.mosaic import registers
from taco_jax.numerics import int4, quant

ROWS = registers.ROWS          # 64: one warpgroup
WIDTH = registers.BLOCK        # 256 values per tile row
GROUP = 128                 # echo4's group
GROUPS = WIDTH // GROUP     # groups per tile row
CODE_BYTES = GROUP // 2     # 64: two codes per byte
SCALE_BYTES = 8             # s, z as f32
GROUP_BYTES = CODE_BYTES + SCALE_BYTES
IN_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
OUT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def unsupported(codec) -> str | None:
    """Why this tile math does not implement `codec`'s wire (None: it does): echo4 with
    B = 128 only (int4-sym and tah4 have other grids)."""
    # the 4-bit codecs with kernels (echo4, int4-sym; not tah4) name this provider, and
    # echo4 is the one without the symmetric grid (`codecs.Echo.symmetric`)
    if family(codec) != "echo4" or codec.symmetric:
        return f"{codec.name}: not echo4 (the 4-bit tile math is echo4's)"
    if codec.block_size != GROUP:
        return f"echo4 with block size {codec.block_size} (the tile math has B = {GROUP})"
    return None


def row_bytes(codec) -> int:
    """Wire bytes of one tile row (two groups)."""
    return GROUPS * codec.row_bytes


# -- register layouts -----------------------------------------------------------------------
def _code_tiled() -> fa.TiledLayout:
    """(64, 64) uint8, one group's code bytes: rows as in the WGMMA layout; lane l holds
    bytes 16(l%4) .. 16(l%4) + 15 of its rows as 2 vectors of 8 (registers [row half, e]),
    the codes of the value layout's runs c = 2(l%4) + e."""
    return fa.TiledLayout(
        fa.Tiling(((ROWS, CODE_BYTES), (16, CODE_BYTES), (8, CODE_BYTES), (16,), (8,))),
        warp_dims=(-8,), lane_dims=(-4, -3), vector_dim=-1)


def code_layout():
    return registers.pallas_layout(_code_tiled())


def scale_layout():
    """(64, 8) uint8, one group's (s, z) per row, the 4 lanes of a row holding the same."""
    return registers.pallas_layout(registers.scale_tiled(SCALE_BYTES))


def _value_tiled(vec: int, width: int) -> fa.TiledLayout:
    return registers.wire_tiled(vec, width)


# -- register-level pieces (Mosaic GPU IR, run inside plgpu.inline_mgpu) ------------------
def _f32(v):
    return arith.constant(ir.F32Type.get(), float(np.float32(v)))


def _i32(v):
    return arith.constant(ir.IntegerType.get_signless(32), int(v))


def _splat(x, n: int):
    return vector.broadcast(ir.VectorType.get((n,), x.type), x)


def _to_f32(v):
    """A vector of bf16 / f16 / f32 → f32 (exact)."""
    ty = ir.VectorType(v.type)
    if ty.element_type == ir.F32Type.get():
        return v
    return arith.extf(ir.VectorType.get(ty.shape, ir.F32Type.get()), v)


def _group_range(vals):
    """min and max (NaN-propagating) over this thread's vectors, then the row's 4 lanes."""
    lo = hi = None
    for v in vals:
        lo = v if lo is None else arith.minimumf(lo, v)
        hi = v if hi is None else arith.maximumf(hi, v)
    n = ir.VectorType(lo.type).shape[0]
    lo_s, hi_s = registers.elem(lo, 0), registers.elem(hi, 0)
    for k in range(1, n):
        lo_s = arith.minimumf(lo_s, registers.elem(lo, k))
        hi_s = arith.maximumf(hi_s, registers.elem(hi, k))
    for d in (1, 2):
        lo_s = arith.minimumf(lo_s, mgpu_utils.shfl_bfly(lo_s, d))
        hi_s = arith.maximumf(hi_s, mgpu_utils.shfl_bfly(hi_s, d))
    return lo_s, hi_s


def _params(lo, hi):
    """asym_params: (s as sent, z as sent and for the codes, 1/s); a bad group (NaN or
    ±Inf) sends s = NaN, z = 0."""
    bad = arith.ori(arith.cmpf(arith.CmpFPredicate.UGE, hi, _f32(np.inf)),   # NaN, +Inf
                    arith.cmpf(arith.CmpFPredicate.ULE, lo, _f32(-np.inf)))  # NaN, −Inf
    lo = arith.minimumf(lo, _f32(0.0))
    hi = arith.maximumf(hi, _f32(0.0))
    half = _f32(0.5)
    # the halvings are exact, so a multiply fused into the subtraction changes nothing
    span = arith.subf(arith.mulf(hi, half), arith.mulf(lo, half))
    s = arith.maximumf(arith.mulf(span, _f32(2 / int4.LEVELS)), _f32(int4.SCALE_MIN))
    inv = registers.ptx_f32("rcp.approx.f32", s)
    zr = mlir_math.roundeven(arith.mulf(arith.negf(lo), inv))
    zr = arith.minimumf(arith.maximumf(zr, _f32(0.0)), _f32(int4.LEVELS))
    # through int32, as the codec: z's bytes are canonical (+0, never −0)
    z = arith.sitofp(ir.F32Type.get(), arith.fptosi(ir.IntegerType.get_signless(32), zr))
    z = arith.select(bad, _f32(0.0), z)
    return arith.select(bad, _f32(np.nan), s), z, inv


# rint(y) for |y| < 2^22 is the integer in the low bits of y + 1.5·2^23 (one add rounded to
# the nearest, ties to even as rint: the constant is even); and 2^23 + q for q < 16 is the
# float whose low bits are q. Both keep the conversion unit (a quarter of the FP32 rate on
# Hopper) out of the per-value math.
_RINT = 1.5 * 2.0 ** 23
_RINT_BITS = 0x4B400000
_Q_BITS = 0x4B000000


def _code_bytes(run, inv, z):
    """16 consecutive f32 values (a list of vectors) → vector<8 x i8> of their codes:
    clip(rint(x·(1/s)) + z, 0, 15) as clip(rint(clip(y, −z, 15 − z))) + z (rint is
    monotone and the bounds are integers). A NaN product (a bad group: s NaN, or ±Inf
    times 1/s = 0) clips to −z by maxnum, so its code is 0; z is 0 there."""
    i32 = ir.IntegerType.get_signless(32)
    lo_q, hi_q = arith.negf(z), arith.subf(_f32(int4.LEVELS), z)
    off = arith.subi(arith.fptosi(i32, z), _i32(_RINT_BITS))
    ints = []
    for v in run:
        n = ir.VectorType(v.type).shape[0]
        y = arith.mulf(v, _splat(inv, n))
        y = arith.minnumf(arith.maxnumf(y, _splat(lo_q, n)), _splat(hi_q, n))
        q = arith.bitcast(ir.VectorType.get((n,), i32),
                          arith.addf(y, _splat(_f32(_RINT), n)))
        q = arith.addi(q, _splat(off, n))
        ints += [registers.elem(q, k) for k in range(n)]
    words = []
    for w in range(len(ints) // 8):
        word = ints[8 * w]
        for k in range(1, 8):
            word = arith.ori(word, arith.shli(ints[8 * w + k], _i32(4 * k)))
        words.append(word)
    packed = vector.from_elements(ir.VectorType.get((len(words),), i32), words)
    return vector.bitcast(ir.VectorType.get((4 * len(words),), ir.IntegerType.get_signless(8)),
                          packed)


def _encode_regs(x):
    """x: (64, 256) array in the value layout → (codes g0, codes g1, scales g0, scales g1)."""
    vec = ir.VectorType(x.registers.flat[0].type).shape[0]
    xr = x.registers.reshape(2, GROUPS, 2, 16 // vec)                # (i, j, e, h)
    clay, slay = _code_tiled(), registers.scale_tiled(SCALE_BYTES)
    codes = [np.empty(clay.registers_shape((ROWS, CODE_BYTES)), dtype=object)
             for _ in range(GROUPS)]
    scales = [np.empty(slay.registers_shape((ROWS, SCALE_BYTES)), dtype=object)
              for _ in range(GROUPS)]
    f32 = ir.F32Type.get()
    for i, j in np.ndindex(2, GROUPS):
        runs = [[_to_f32(xr[i, j, e, h]) for h in range(16 // vec)] for e in range(2)]
        lo, hi = _group_range([v for r in runs for v in r])
        s, z, inv = _params(lo, hi)
        for e in range(2):
            codes[j].reshape(2, 2)[i, e] = _code_bytes(runs[e], inv, z)
        sz = vector.from_elements(ir.VectorType.get((2,), f32), [s, z])
        scales[j].reshape(2)[i] = vector.bitcast(
            ir.VectorType.get((SCALE_BYTES,), ir.IntegerType.get_signless(8)), sz)
    return (tuple(_jax_private.fragmented_array(c, clay, is_signed=False) for c in codes)
            + tuple(_jax_private.fragmented_array(s, slay, is_signed=False) for s in scales))


def _mul_rn(a, b):
    """a·b rounded to f32 on its own: PTX mul.rn is never contracted into a following add."""
    return mgpu_utils.inline_ptx("mul.rn.f32 $0, $1, $2;", a, b,
                                 result_types=ir.F32Type.get())


def _decode_run(code_vec, s, z):
    """vector<8 x i8> of codes → 16 f32 values (q − z)·s, in element order: q − z is
    (2^23 + q) − (2^23 + z), exact, the first term the code's bits under 2^23's."""
    i32 = ir.IntegerType.get_signless(32)
    f32 = ir.F32Type.get()
    zq = arith.addf(z, _f32(2.0 ** 23))
    words = vector.bitcast(ir.VectorType.get((2,), i32), code_vec)
    vals = []
    for w in range(2):
        word = registers.elem(words, w)
        for k in range(8):                   # element 2i the low nibble of byte i
            q = arith.shrui(word, _i32(4 * k)) if k else word
            if k < 7:
                q = arith.andi(q, _i32(0xF))
            q = arith.bitcast(f32, arith.ori(q, _i32(_Q_BITS)))
            vals.append(_mul_rn(arith.subf(q, zq), s))
    return vals


def _decode_regs(codes, scales, vec: int):
    """Per group of this part: codes (64, 64) uint8, scales (64, 8) uint8 → (64, 128·n)
    f32 in the value layout of vec-element vectors."""
    f32 = ir.F32Type.get()
    nj = len(codes)
    layout = _value_tiled(vec, GROUP * nj)
    regs = np.empty(layout.registers_shape((ROWS, GROUP * nj)), dtype=object)
    view = regs.reshape(2, nj, 2, 16 // vec)                       # (i, j, e, h)
    vty = ir.VectorType.get((vec,), f32)
    for i, j in np.ndindex(2, nj):
        sz = vector.bitcast(ir.VectorType.get((2,), f32), scales[j].registers.reshape(2)[i])
        s, z = registers.elem(sz, 0), registers.elem(sz, 1)
        for e in range(2):
            vals = _decode_run(codes[j].registers.reshape(2, 2)[i, e], s, z)
            for h in range(16 // vec):
                view[i, j, e, h] = vector.from_elements(vty, vals[h * vec:(h + 1) * vec])
    return _jax_private.fragmented_array(regs, layout, is_signed=None)


# -- Pallas-level tile functions ---------------------------------------------------------
def _code_struct():
    return plgpu.ShapeDtypeStruct((ROWS, CODE_BYTES), jnp.uint8, code_layout())


def _scale_struct():
    return plgpu.ShapeDtypeStruct((ROWS, SCALE_BYTES), jnp.uint8, scale_layout())


@functools.cache
def _encode_fn(dtype):
    @plgpu.inline_mgpu(arg_types=(registers.value_layout(dtype),),
                       return_type=(_code_struct(),) * GROUPS + (_scale_struct(),) * GROUPS)
    def encode(ctx, x):
        del ctx
        return _encode_regs(x)
    return encode


@functools.cache
def _decode_add_fn(n_groups: int, vec: int, with_total: bool):
    layout = registers.pallas_layout(_value_tiled(vec, GROUP * n_groups))
    args = ((code_layout(),) * n_groups + (scale_layout(),) * n_groups
            + ((layout,) if with_total else ()))

    @plgpu.inline_mgpu(arg_types=args, return_type=plgpu.ShapeDtypeStruct(
        (ROWS, GROUP * n_groups), jnp.float32, layout))
    def decode_add(ctx, *arrays):
        del ctx
        vals = _decode_regs(arrays[:n_groups], arrays[n_groups:2 * n_groups], vec)
        return vals + arrays[-1] if with_total else vals
    return decode_add


def encode_tile(x_ref):
    """(64, 256) values (bf16, f16 or f32 ref, untransformed) → the tile's wire in
    registers: (codes of group 0, of group 1, scale bytes of group 0, of group 1)."""
    dtype = jnp.dtype(x_ref.dtype).type
    x = plgpu.load(x_ref, layout=registers.value_layout(dtype), optimized=False)
    return _encode_fn(dtype)(x)


def encode_values(x):
    """(64, 256) f32 values in registers (`registers.value_layout(jnp.float32)`) → the
    tile's wire, as `encode_tile` returns it (a sum encoded where it was made)."""
    return _encode_fn(jnp.float32)(x)


def store_wire_tile(ref, wire):
    """The wire of `encode_tile` → a (64, 144) uint8 view of 64 wire rows."""
    codes, scales = wire[:GROUPS], wire[GROUPS:]
    for g in range(GROUPS):
        _jax_private.mgpu_store(ref.at[:, pl.ds(GROUP_BYTES * g, CODE_BYTES)], codes[g])
        _jax_private.mgpu_store(ref.at[:, pl.ds(GROUP_BYTES * g + CODE_BYTES, SCALE_BYTES)],
                                scales[g])


def _part_groups(part: int, parts: int) -> range:
    if parts not in (1, 2) or not 0 <= part < parts:
        raise ValueError(f"echo4 tile: {part=} of {parts=} (parts is 1 or 2)")
    n = GROUPS // parts
    return range(n * part, n * (part + 1))


def load_wire_tile(ref, part: int = 0, parts: int = 1):
    """A (64, 144) uint8 view of wire rows → (codes, scales) of column part `part`'s groups."""
    groups = _part_groups(part, parts)
    codes = tuple(plgpu.load(ref.at[:, pl.ds(GROUP_BYTES * g, CODE_BYTES)],
                             layout=code_layout(), optimized=False) for g in groups)
    scales = tuple(plgpu.load(ref.at[:, pl.ds(GROUP_BYTES * g + CODE_BYTES, SCALE_BYTES)],
                              layout=scale_layout(), optimized=False) for g in groups)
    return codes, scales


def decode_add(wire, vec: int, total=None):
    """(codes, scales) of `load_wire_tile` → their values, f32 (64, 128·groups) in the value
    layout of vec-element vectors (`registers.wire_tiled(vec, …)`), plus `total` if given."""
    codes, scales = wire
    fn = _decode_add_fn(len(codes), vec, total is not None)
    return fn(*codes, *scales, *(() if total is None else (total,)))


# -- the tile codec (`kernels.tile_codec.TileCodec`) ------------------------------------------
@dataclasses.dataclass(frozen=True)
class Echo4Tiles:
    """echo4 as a tile codec: two groups per tile row, a tile row's wire their two codec
    rows (144 bytes); no constant operands, input of any covered dtype encoded as it is (f32
    too, as the codec does); the owner's sum in values (f32, the value layout of 4-element
    vectors), encoded from f32 as the codec does."""
    codec: object

    options = frozenset()

    @property
    def row_bytes(self) -> int:
        return row_bytes(self.codec)

    def unsupported(self, dtype) -> str | None:
        why = unsupported(self.codec)
        if why is None and jnp.dtype(dtype) not in map(jnp.dtype, IN_DTYPES):
            why = f"{jnp.dtype(dtype).name} data (covered: bfloat16, float16, float32)"
        return why

    def x_transforms(self, in_dtype) -> tuple:
        return ()                          # read into registers by plain loads

    def x_slots(self, in_dtype) -> int:
        return 2

    def staging(self, in_dtype):
        return None

    def operands(self, in_dtype) -> tuple:
        return ()

    def encode(self, x_smem, consts):
        return encode_tile(x_smem)

    def store(self, view, wire):
        store_wire_tile(view, wire)

    def load(self, view, part: int, parts: int):
        return load_wire_tile(view, part, parts)

    def decode_add(self, wire, consts, vec: int, part: int, parts: int, total=None):
        return decode_add(wire, vec, total)

    def finish(self, total, vec: int, parts: int):
        return total

    def decode(self, view, consts, out_dtype, parts: int):
        vec = registers.value_vec(out_dtype)
        return [decode_add(load_wire_tile(view, part, parts), vec).astype(out_dtype)
                for part in range(parts)]

    def own_scratch(self, in_dtype) -> tuple:
        return (plgpu.SMEM((ROWS, WIDTH), in_dtype),)

    def sum_init(self, own, consts):
        del consts
        return plgpu.load(own[0], layout=registers.value_layout(jnp.float32),
                          optimized=False).astype(jnp.float32)

    def sum_load(self, view):
        return load_wire_tile(view)

    def sum_add(self, total, wire, consts):
        del consts
        return decode_add(wire, registers.value_vec(jnp.float32), total)

    def sum_encode(self, total):
        return encode_values(total)

    def encoded(self, v):
        return v

    def code_step(self, wire):
        """One step of the 4-bit grid is its scale s."""
        return quant.unpack_scales(wire[:, self.codec.block_size // 2:], 2)[0]


# -- kernels (the tile math alone, for its checks) ----------------------------------------
def _tiles_loop(n_tiles: int, grid: int, body):
    @pl.loop(lax.axis_index("blk"), n_tiles, step=grid)
    def _(t):
        body(t)


def _compress_kernel(x, codec):
    n_tiles = x.shape[0] // ROWS
    grid = min(n_tiles, registers.sm_count())
    row = row_bytes(codec)

    def body(x_gmem, w_gmem):
        def tile(t):
            rows = pl.ds(t * ROWS, ROWS)
            store_wire_tile(w_gmem.at[rows], encode_tile(x_gmem.at[rows]))
        _tiles_loop(n_tiles, grid, tile)

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((x.shape[0], row), jnp.uint8), grid=(grid,),
        grid_names=("blk",), kernel_name="taco_echo4_compress_mosaic",
        compiler_params=plgpu.CompilerParams(lowering_semantics=registers.LANE))
    return kernel(x)


def _decompress_kernel(w, out_dtype):
    n_tiles = w.shape[0] // ROWS
    grid = min(n_tiles, registers.sm_count())
    vec = registers.value_vec(out_dtype)

    def body(w_gmem, o_gmem):
        def tile(t):
            rows = pl.ds(t * ROWS, ROWS)
            for part in range(GROUPS):
                vals = decode_add(load_wire_tile(w_gmem.at[rows], part, GROUPS), vec)
                _jax_private.mgpu_store(o_gmem.at[rows, pl.ds(GROUP * part, GROUP)],
                                        vals.astype(out_dtype))
        _tiles_loop(n_tiles, grid, tile)

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((w.shape[0], WIDTH), out_dtype), grid=(grid,),
        grid_names=("blk",), kernel_name="taco_echo4_decompress_mosaic",
        compiler_params=plgpu.CompilerParams(lowering_semantics=registers.LANE))
    return kernel(w)


def _check(codec, what, n_groups):
    why = unsupported(codec)
    if why is None and (n_groups <= 0 or n_groups % (ROWS * GROUPS)):
        why = f"{n_groups} groups (a positive multiple of {ROWS * GROUPS}: whole tiles)"
    if why is not None:
        raise ValueError(f"Mosaic GPU echo4 {what}: {why}")


@functools.partial(jax.jit, static_argnames=("codec",))
def compress(x, codec):
    """(n_groups, 128) bf16/f16/f32 → (n_groups, 72) uint8, the codec's wire rows
    (`codec.compress_reference`'s bytes); n_groups a multiple of 128. Runs on Hopper GPUs;
    elsewhere it only lowers.

    Raises: ValueError naming the codec, shape or dtype that is not covered."""
    _check(codec, "compress", x.shape[0] if x.ndim == 2 else 0)
    if x.ndim != 2 or x.shape[1] != GROUP or jnp.dtype(x.dtype) not in map(jnp.dtype,
                                                                            IN_DTYPES):
        raise ValueError(f"Mosaic GPU echo4 compress: {x.shape=} {x.dtype=}; want "
                         f"(n_groups, {GROUP}) bf16, f16 or f32")
    w = _compress_kernel(x.reshape(-1, WIDTH), codec)                # (n/2, 144)
    return w.reshape(x.shape[0], codec.row_bytes)


@functools.partial(jax.jit, static_argnames=("codec", "out_dtype"))
def decompress(w, codec, out_dtype=jnp.float32):
    """(n_groups, 72) uint8 → (n_groups, 128) out_dtype, as `codec.decompress_reference`
    (its products rounded alone); n_groups a multiple of 128.

    Raises: ValueError as `compress`."""
    _check(codec, "decompress", w.shape[0] if w.ndim == 2 else 0)
    if w.ndim != 2 or w.shape[1] != codec.row_bytes or w.dtype != jnp.uint8:
        raise ValueError(f"Mosaic GPU echo4 decompress: {w.shape=} {w.dtype=}; want uint8 "
                         f"rows of {codec.row_bytes} bytes")
    if jnp.dtype(out_dtype) not in map(jnp.dtype, OUT_DTYPES):
        raise ValueError(f"Mosaic GPU echo4 decompress: {out_dtype=} (bf16, f16 or f32)")
    y = _decompress_kernel(w.reshape(-1, row_bytes(codec)), jnp.dtype(out_dtype).type)
    return y.reshape(w.shape[0], GROUP)
