"""Echo's 4-bit codecs ("echo4", "int4-sym") as fused Pallas-Triton kernels: compress (and
compress with error feedback: z = x − r in, codes and the new residual out, one pass),
decompress, the two-shot owner's reduce and the one-shot's decode_sum. Their plain-jnp
references are the codec's own (`taco_jax.codecs.echo`, on `numerics.int4`) and
`kernels.references`' for every codec.

The kernels write the references' wire bytes: the tile math is the codec's element-wise ops
and row reductions (codes round(x·(1/s)) + z, one reciprocal per group), with substitutes
for what Triton lacks that give the same bits:

* a (tm, B) tile is viewed as (tm, B/2, 2) and unstacked into its even and odd elements,
  the low and high nibbles of the code bytes, so packing and unpacking are element-wise;
  a row's min / max is the min / max over both halves (exact in any order);
* round half to even (`jnp.round`, which Triton does not lower): for |y| < 2^22 the f32 sum
  y + 1.5·2^23 rounds y to an integer (the add rounds to nearest even) and holds it in its
  low mantissa bits, read as int32 straight from the bits (no float→int conversion, a
  quarter-rate instruction on the GPU). |x·(1/s)| ≤ 15 (+ rounding) for every finite
  group. The product y is made by PTX `mul.rn`, which no compiler fuses into the add
  (`_mul_rn`), and 1/s as the reference's compiler makes it (`_recip`);
* integer codes to floats by the inverse: bits (q | 0x4B000000) are the float 2^23 + q.

A group with NaN or ±Inf is found by Σ x·0 (0 for finite x, NaN otherwise, and it cannot
overflow), by the row sum of x·(1/s) (`EchoConfig.lean`), or from the range's integer maxima,
in which NaN and ±Inf sort above every finite value (`EchoConfig.int_stats`, compress's
default); it gets codes 0, scale NaN and zero point 0, as the reference, and decodes to
NaN. tah4 (a Hadamard rotation before the grid) has no kernel: its reference rotates in
f32, which the tensor-core dots of the TACO kernels would not reproduce byte for byte.

`EchoConfig` selects variants of the tile math that write the same bytes with fewer
instructions: 16-bit data as uint32 pairs instead of the even/odd split and join, a leaner
encode and decode, scales read as words or written as byte columns, the encode's row
reductions merged, the wire written as words, a row's range from integer maxima, the next
tile loaded before the current one's math. `default_config` runs each kernel with the
ones measured fastest for it (`MEASURED_VARIANTS`; the sweep: `python -m bench.kernels
--codecs echo4 --tune`).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import triton as plgpu

from taco_jax.codec_registry import family
from taco_jax.kernels.triton import tiling
from taco_jax.numerics import int4, quant
from taco_jax.numerics.blocks import check_float

LEVELS, SYM_ZERO = int4.LEVELS, int4.SYM_QMAX + 1
_ROUND = np.float32(1.5 * 2 ** 23)       # y + _ROUND: round(y) in the low mantissa bits
_ROUND_BITS = 0x4B400000                 # the bits of 1.5·2^23
_FLOAT_BITS = 0x4B000000                 # the bits of 2^23
MID_ELEMENTS = tiling.MID_ELEMENTS     # 64 MiB of bf16: above it, the large-input tilings
SMALL_ELEMENTS = tiling.SMALL_ELEMENTS  # 16 MiB of bf16: up to it, looped one-warp tiles


def covers(codec) -> bool:
    """Do these kernels implement `codec`'s wire format? (echo4 and int4-sym, any B: the
    codecs whose kernel family is "echo4", `providers.ECHO4`; tah4 has none.)"""
    return family(codec) == "echo4"


def default_tiling(block_size: int, kernel: str, n_rows: int | None = None
                   ) -> tiling.KernelConfig:
    """The tiling of each kernel, from device time on one H200 (B = 128, bf16, with the
    EchoConfig variants each kernel runs; fraction of the roofline, chosen against the
    previous tiling, bench/results/kernels_echo4_tilings.json):

    * up to SMALL_ELEMENTS (16 MiB of bf16) compress loops one warp over 4 tiles of 512
      elements (0.586 at 16 MiB against 0.540 for one 2048-element tile of 4 warps), reduce
      over 2 (0.666 against 0.573);
    * otherwise up to MID_ELEMENTS elements (n_rows groups; or n_rows None): one tile of
      2048 elements per program, 4 warps (without the variants: compress 0.45 at 16 MiB
      against 0.36 for looped one-warp tiles, decompress 0.66 against 0.46,
      bench/results/kernels_echo4_tune.json);
    * above: compress takes 2 tiles of 2048 elements with 4 warps (with int_stats 0.900 at
      256 MiB against 0.889 for the one-warp loop over 8 tiles of 1024,
      bench/results/kernels_echo4_tune_compress.json); reduce loops one warp over 8 tiles
      of 1024 elements (Triton pipelines the next tile's loads; 0.85 at 256 MiB);
      decode_sum takes 2 tiles of 2048 elements with 4 warps (0.922 against 0.874 for the
      one-warp loop); decompress tiles of 8192 elements, 8 warps (0.935).
    """
    if kernel not in ("compress", "decompress", "reduce", "decode_sum"):
        raise ValueError(f"echo4 default_tiling: unknown kernel {kernel!r}")
    n = None if n_rows is None else n_rows * block_size
    if n is not None and n <= SMALL_ELEMENTS and kernel in ("compress", "reduce"):
        return tiling.KernelConfig(blocks_per_program=max(1, 512 // block_size), num_warps=1,
                                   num_stages=3,
                                   tiles_per_program=4 if kernel == "compress" else 2)
    if n is None or n <= MID_ELEMENTS:
        return tiling.KernelConfig(blocks_per_program=max(4, 2048 // block_size),
                                   num_warps=4, num_stages=2)
    if kernel == "decompress":
        return tiling.KernelConfig(blocks_per_program=max(4, 8192 // block_size),
                                   num_warps=8, num_stages=2)
    if kernel in ("decode_sum", "compress"):
        return tiling.KernelConfig(blocks_per_program=max(1, 2048 // block_size), num_warps=4,
                                   num_stages=3, tiles_per_program=2)
    return tiling.KernelConfig(blocks_per_program=max(1, 1024 // block_size), num_warps=1,
                               num_stages=3, tiles_per_program=8)


# The tile-math variants each kernel runs with (EchoConfig), from device time on one H200
# (bf16, B = 128, the default tilings; bench/results/kernels_echo4_variants.json; fraction
# of the roofline at 16 / 256 MiB, without → with):
#   compress    pairs, lean                        0.42 / 0.67 → 0.54 / 0.84 (scale_columns
#                                                  costs it: 0.44 / 0.81 with)
#   decompress  pairs, lean, scale_words           0.66 / 0.89 → 0.74 / 0.93
#   reduce      pairs, lean, scale_words, columns  0.54 / 0.69 → 0.58 / 0.86
#   decode_sum  pairs, lean, scale_words           0.51 / 0.69 → 0.68 / 0.88
# compress_feedback runs compress's (memory-bound at 0.93 before; not timed with them).
# Then the encoders' merged_rows and word_stores over those (bench/results/
# kernels_echo4_tune_encoders.json, same tilings, 16 / 256 MiB):
#   compress    + merged_rows                      0.585 / 0.840 → 0.606 / 0.847 (word_stores
#                                                  costs it: 0.535 / 0.787 with both)
#   reduce      + merged_rows, word_stores         0.669 / 0.854 → 0.720 / 0.991
# Then compress's int_stats, and prefetch over it (bench/results/
# kernels_echo4_tune_compress.json, same tilings, 16 / 256 MiB):
#   compress    + int_stats                        0.593 / 0.845 → 0.629 / 0.889
#               + int_stats, prefetch              0.650 / 0.854: prefetch only for the
#                                                  looped small-input tiling (SMALL_VARIANTS)
MEASURED_VARIANTS = {
    "compress": {"pairs": True, "lean": True, "merged_rows": True, "int_stats": True},
    "decompress": {"pairs": True, "lean": True, "scale_words": True},
    "reduce": {"pairs": True, "lean": True, "scale_words": True, "scale_columns": True,
               "merged_rows": True, "word_stores": True},
    "decode_sum": {"pairs": True, "lean": True, "scale_words": True},
}


# the variants added up to SMALL_ELEMENTS (the looped one-warp tilings), where they measured
# faster and above not
SMALL_VARIANTS = {"compress": {"prefetch": True}}


def default_config(block_size: int, kernel: str, n_rows: int | None = None
                   ) -> "EchoConfig":
    """Each kernel's launch configuration: its tiling (`default_tiling`) and the tile-math
    variants measured fastest for it (`MEASURED_VARIANTS`, plus `SMALL_VARIANTS` up to
    SMALL_ELEMENTS)."""
    small = n_rows is not None and n_rows * block_size <= SMALL_ELEMENTS
    return with_options(default_tiling(block_size, kernel, n_rows),
                        **MEASURED_VARIANTS[kernel],
                        **(SMALL_VARIANTS.get(kernel, {}) if small else {}))


@dataclasses.dataclass(frozen=True)
class EchoConfig(tiling.KernelConfig):
    """A tiling plus the tile-math variants of these kernels (all off: the plain tile
    math; `default_config` turns on the ones measured fastest per kernel). Every variant
    writes the same bytes; they differ in instructions.

    * pairs: bf16 and f16 data cross the kernel boundary as 32-bit pairs (element 2i in
      the low half, 2i+1 in the high half; a free bitcast in XLA), so a tile needs no
      even/odd split or join: even = f32 bits u << 16, odd = u & 0xFFFF0000 (bf16; f16
      through its 16-bit halves), and decoded pairs go out as one conversion of both
      halves (PTX cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32, the rounding of astype). Inputs
      x of compress / compress_feedback and the reduce's own rows; outputs of decompress
      and decode_sum. f32 data keeps the split and join.
    * lean: fewer instructions per element in the encode and decode (`encode_tile`,
      `decode_codes`): the NaN/Inf test from the row sum of the products x·(1/s), which
      the codes need anyway, instead of Σ x·0; codes of such a group zeroed by the clip's
      upper bound (0 there, 15 elsewhere) instead of a select per byte; decode's q − z as
      the float 2^23 + q less 2^23 + z, one subtraction.
    * scale_words: the decoders (decompress, reduce, decode_sum) read s (and z) as f32
      words from a uint32 view of the wire (again a free bitcast) rather than assembling
      them from four bytes with a row reduction each.
    * scale_columns: the encoders (compress, compress_feedback, reduce) write each scale
      byte as its own (tm, 1) column instead of one (tm, 4·n) tile of bytes.
    * merged_rows: the encoders take a row's min and max over the element-wise min / max
      of its two halves (one cross-thread reduction each instead of two; min and max are
      exact in any order), and fold the zero point into the rounding's integer offset
      (codes bits(y + 1.5·2^23) − (bits(1.5·2^23) − z), one subtraction instead of two).
      A group with NaN or ±Inf is still found by the NaN test (its codes and scales do not
      depend on the min / max there).
    * word_stores: the encoders write the wire as 32-bit words (a uint32 output, bitcast
      to the wire's bytes in XLA for free): each 4 code bytes packed into a word in
      registers, s (and z) stored as f32 words, instead of byte stores. Blocks of a
      multiple of 8 elements (every wire row a whole number of words); others keep bytes.
    * prefetch: compress and compress_feedback, looping over tiles, load tile t + 1 before
      tile t's math (carried to the next step in registers), so a warp's loads fly while it
      computes instead of stalling at the top of every tile. Tilings of one tile per
      program, and a compress that skips rows, keep the plain loop.
    * pack_mad: the encoders pack a code byte as qe + 16·qo (one integer multiply-add;
      the same byte as qe | qo << 4, since qe < 16) instead of a shift and an or.
    * int_stats: the encoders take a row's range from its elements' bits as integers, a
      signed and an unsigned max (`_int_range`), in which NaN and ±Inf sort above every
      finite value: the same lo and hi, and the non-finite groups found without the NaN
      test's row sum (one integer max per pair and two row reductions instead of a min, a
      max and an add per pair and three).
    """
    pairs: bool = False
    lean: bool = False
    scale_words: bool = False
    scale_columns: bool = False
    merged_rows: bool = False
    word_stores: bool = False
    prefetch: bool = False
    pack_mad: bool = False
    int_stats: bool = False


def with_options(cfg: tiling.KernelConfig, **options) -> EchoConfig:
    """cfg as an EchoConfig with the given variants (pairs, lean, scale_words,
    scale_columns, merged_rows, word_stores, prefetch, pack_mad, int_stats) set."""
    if isinstance(cfg, EchoConfig):
        return dataclasses.replace(cfg, **options)
    base = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(tiling.KernelConfig)}
    return EchoConfig(**base, **options)


def _opt(cfg, name: str) -> bool:
    return bool(getattr(cfg, name, False))


PAIR_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _pair_dtype(cfg, dtype):
    """The 16-bit dtype whose elements travel as uint32 pairs under cfg, or None."""
    dtype = jnp.dtype(dtype)
    return dtype if _opt(cfg, "pairs") and dtype in PAIR_DTYPES else None


def to_pairs(x):
    """(n, B) bf16 / f16 → (n, B/2) uint32: element 2i in the low half (a bitcast)."""
    n, b = x.shape
    return lax.bitcast_convert_type(x.reshape(n, b // 2, 2), jnp.uint32)


def from_pairs(u, dtype):
    """`to_pairs`' inverse: (n, B/2) uint32 or int32 → (n, B) dtype."""
    n, h = u.shape
    return lax.bitcast_convert_type(u, dtype).reshape(n, 2 * h)


def to_words(w):
    """(..., row_bytes) uint8 wire → (..., row_bytes/4) uint32 (a bitcast; little-endian)."""
    return lax.bitcast_convert_type(w.reshape(*w.shape[:-1], w.shape[-1] // 4, 4), jnp.uint32)


def from_words(u):
    """`to_words`' inverse: (..., row_bytes/4) uint32 → (..., row_bytes) uint8."""
    return lax.bitcast_convert_type(u, jnp.uint8).reshape(*u.shape[:-1], 4 * u.shape[-1])


def _word_stores(cfg, codec) -> bool:
    """Do the encoders write words under cfg (see EchoConfig.word_stores)?"""
    return _opt(cfg, "word_stores") and codec.block_size % 8 == 0


def _wire_out(n_rows, codec, cfg, like):
    """The encoders' output: wire rows of bytes, or of words under word_stores."""
    if _word_stores(cfg, codec):
        return tiling.out_struct((n_rows, codec.row_bytes // 4), jnp.uint32, like)
    return tiling.out_struct((n_rows, codec.row_bytes), jnp.uint8, like)


def _wire_bytes(w, codec, cfg):
    """An encoder's output as the wire's bytes."""
    return from_words(w) if _word_stores(cfg, codec) else w


# -- tile math ((tm, B/2) halves: even and odd elements) ------------------------------------
def _halves(v):
    """(tm, B) → even, odd: (tm, B/2) each, the low and high nibbles' elements."""
    tm, b = v.shape
    return lax.unstack(v.reshape(tm, b // 2, 2), axis=2)          # (tm, B/2, 2) → 2 ×


def _interleave(even, odd):
    """even, odd (tm, B/2) → (tm, B)."""
    tm, h = even.shape
    return lax.stack([even, odd], axis=2).reshape(tm, 2 * h)


def _unpair(u, dtype):
    """(tm, B/2) uint32 pairs of `dtype` (bf16 / f16) → even, odd (tm, B/2) f32, exactly."""
    if dtype == jnp.bfloat16:
        return (lax.bitcast_convert_type(lax.shift_left(u, np.uint32(16)), jnp.float32),
                lax.bitcast_convert_type(u & np.uint32(0xFFFF0000), jnp.float32))
    halves = (u & np.uint32(0xFFFF), lax.shift_right_logical(u, np.uint32(16)))
    return tuple(lax.bitcast_convert_type(h.astype(jnp.uint16), dtype).astype(jnp.float32)
                 for h in halves)


def _pair(even, odd, dtype, cfg):
    """even, odd (tm, B/2) f32 → (tm, B/2) int32 pairs of `dtype` (bf16 / f16; int32, not
    uint32: Triton's inline asm yields signless integers), each rounded as astype(dtype)
    rounds: on the GPU one cvt.rn.{bf16,f16}x2.f32 per pair (its first operand goes to the
    high half)."""
    if cfg.interpret:
        e, o = (lax.bitcast_convert_type(v.astype(dtype), jnp.uint16).astype(jnp.uint32)
                for v in (even, odd))
        return lax.bitcast_convert_type(e | lax.shift_left(o, np.uint32(16)), jnp.int32)
    kind = "bf16x2" if dtype == jnp.bfloat16 else "f16x2"
    return plgpu.elementwise_inline_asm(
        f"cvt.rn.{kind}.f32 $0, $1, $2;", args=[odd, even], constraints="=r,f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(even.shape, jnp.int32)])[0]


def _rint(y, less=_ROUND_BITS):
    """round half to even of f32 |y| < 2^22, as int32 (see the module doc); with `less`
    = _ROUND_BITS − z, round(y) + z in the same one subtraction. y must be a rounded value
    (`_mul_rn`), not a product the compiler may fuse into this add."""
    return lax.bitcast_convert_type(y + _ROUND, jnp.int32) - less


def _mul_rn(a, b, cfg):
    """a·b rounded to f32 and kept apart from the add in `_rint`: fused into it (an FMA, as
    XLA and Triton contract a multiply and an add) the sum would round once, differently
    from the reference's round(x·(1/s)). PTX `mul.rn` is never contracted; the interpreter
    (XLA on CPU) gets an optimization barrier."""
    b = jnp.broadcast_to(b, a.shape)
    if cfg.interpret:
        return lax.optimization_barrier(a * b)
    return tiling.ptx("mul.rn.f32", a, b)


def _recip(s, cfg):
    """1/s of a (tm, 1) scale, rounded as the reference's 1/s is where it runs. XLA compiles
    f32 division for NVIDIA GPUs with LLVM's -nvptx-prec-divf32=1 (div.full, not IEEE), and
    LLVM emits 1/x there as rcp.approx.f32 (the same result as div.full(1, x)): measured on
    the H200, XLA's 1/s differs from the IEEE quotient in 495 of 4096 groups, enough to move
    codes that sit at a rounding tie (bf16 data). On CPU (the interpreter) XLA divides
    IEEE."""
    if cfg.interpret:
        return 1 / s
    return tiling.ptx("rcp.approx.f32", s)


def _float_bits(q):
    """int32 0 ≤ q < 2^23 → the f32 2^23 + q."""
    return lax.bitcast_convert_type(q | _FLOAT_BITS, jnp.float32)


def _to_float(q):
    """int32 0 ≤ q < 2^23 → f32, exactly."""
    return _float_bits(q) - np.float32(2 ** 23)


def _row_min(even, odd, merged=False):
    if merged:
        return jnp.min(jnp.minimum(even, odd), axis=1, keepdims=True)
    return jnp.minimum(jnp.min(even, axis=1, keepdims=True), jnp.min(odd, axis=1, keepdims=True))


def _row_max(even, odd, merged=False):
    if merged:
        return jnp.max(jnp.maximum(even, odd), axis=1, keepdims=True)
    return jnp.maximum(jnp.max(even, axis=1, keepdims=True), jnp.max(odd, axis=1, keepdims=True))


def _int_range(xe, xo):
    """A row's lo = min(min x, 0) and hi = max(max x, 0) (tm, 1) from the elements' f32 bits
    as integers, and whether the row holds a NaN or ±Inf. As signed int32 the bits of the
    floats ≥ +0 sort as the floats do and every negative float is below them, so the signed
    max is hi's bits (0 when no element is positive); as uint32 every negative float is above
    every positive one and sorts by magnitude, so the unsigned max is lo's bits when the row
    has a negative element (else below 2^31: lo = 0). +NaN is above +Inf in the first order,
    −NaN above −Inf in the second: a non-finite element shows in hi or lo, with no row sum
    and no NaN-ignoring float min / max in between. −0 gives lo = −0 where the reference may
    keep +0: s, z and the codes come out the same."""
    be, bo = (lax.bitcast_convert_type(v, jnp.int32) for v in (xe, xo))
    ue, uo = (lax.bitcast_convert_type(v, jnp.uint32) for v in (xe, xo))
    hi_bits = jnp.max(jnp.maximum(be, bo), axis=1, keepdims=True)
    lo_bits = jnp.max(jnp.maximum(ue, uo), axis=1, keepdims=True)
    hi = lax.bitcast_convert_type(jnp.maximum(hi_bits, 0), jnp.float32)
    lo = jnp.where(lo_bits >= np.uint32(0x80000000),
                   lax.bitcast_convert_type(lo_bits, jnp.float32), np.float32(0))
    bad = jnp.logical_not((hi < np.inf) & (lo > -np.inf))      # False for NaN too
    return lo, hi, bad


def encode_tile(xe, xo, codec, cfg):
    """even, odd (tm, B/2) f32 → (code bytes (tm, B/2) uint8 — int32 under word_stores —,
    scale bytes (tm, 4·n) uint8 (None under scale_columns or word_stores: the caller stores
    `scale_byte_columns` or the words), codes (qe, qo) int32, s, z (tm, 1) f32 as sent). `asym_params` / `sym_params`, `quantize4` and
    `pack_nibbles` of the codec.

    Under cfg.lean the group is non-finite exactly where Σ x·(1/s) is: a finite group has
    |x·(1/s)| ≤ 15 (+ rounding) element by element; an Inf makes s Inf (min / max keep it,
    even Triton's NaN-ignoring ones), so 1/s = 0 and Inf·0 = NaN; a NaN stays NaN."""
    lean, merged = _opt(cfg, "lean"), _opt(cfg, "merged_rows")
    int_stats = _opt(cfg, "int_stats")
    pack = ((lambda qe, qo: qe + qo * 16) if _opt(cfg, "pack_mad")       # noqa: E731
            else (lambda qe, qo: qe | lax.shift_left(qo, 4)))
    if int_stats:
        lo, hi, bad = _int_range(xe, xo)
    elif not lean:
        bad = jnp.logical_not(jnp.sum(xe * 0.0 + xo * 0.0, axis=1, keepdims=True) == 0)
    if codec.symmetric:
        m = (jnp.maximum(hi, -lo) if int_stats
             else _row_max(jnp.abs(xe), jnp.abs(xo), merged))
        s = jnp.maximum(m * np.float32(1 / int4.SYM_QMAX), int4.SCALE_MIN)
        zi = SYM_ZERO
    else:
        if not int_stats:
            lo = jnp.minimum(_row_min(xe, xo, merged), 0.0)
            hi = jnp.maximum(_row_max(xe, xo, merged), 0.0)
        s = jnp.maximum((hi * np.float32(0.5) - lo * np.float32(0.5))
                        * np.float32(2 / LEVELS), int4.SCALE_MIN)
    inv = _recip(s, cfg)
    if not codec.symmetric:
        zi = jnp.clip(_rint(_mul_rn(-lo, inv, cfg)), 0, LEVELS)
    ye, yo = _mul_rn(xe, inv, cfg), _mul_rn(xo, inv, cfg)
    if merged:                     # round(y) + z in one subtraction
        less = _ROUND_BITS - zi
        code = lambda y: _rint(y, less)           # noqa: E731
    else:
        code = lambda y: _rint(y) + zi            # noqa: E731
    if lean:
        if not int_stats:
            bad = jnp.logical_not(jnp.abs(jnp.sum(ye + yo, axis=1, keepdims=True)) < np.inf)
        top = jnp.where(bad, 0, LEVELS)           # the group's codes clip to 0
        qe = jnp.clip(code(ye), 0, top)
        qo = jnp.clip(code(yo), 0, top)
        code_bytes = pack(qe, qo)
    else:
        qe = jnp.clip(code(ye), 0, LEVELS)
        qo = jnp.clip(code(yo), 0, LEVELS)
        code_bytes = jnp.where(bad, 0, pack(qe, qo))
    words = _word_stores(cfg, codec)
    if not words:                  # under word_stores the int32 bytes are packed by 4
        code_bytes = code_bytes.astype(jnp.uint8)
    s = jnp.where(bad, jnp.float32(np.nan), s)                 # the group decodes NaN
    if codec.symmetric:
        z = jnp.full_like(s, SYM_ZERO)
        scales = [s]
    else:
        z = jnp.where(bad, 0.0, _to_float(zi))
        scales = [s, z]
    scale_bytes = (None if words or _opt(cfg, "scale_columns")
                   else quant.pack_scales(scales))
    return code_bytes, scale_bytes, (qe, qo), s, z


def scale_byte_columns(s, z, codec):
    """The 4·n scale bytes of a row as (tm, 1) uint8 columns, little-endian (s, then z)."""
    out = []
    for v in [s] if codec.symmetric else [s, z]:
        bits = lax.bitcast_convert_type(v, jnp.uint32)
        out += [(lax.shift_right_logical(bits, np.uint32(8 * k)) & np.uint32(0xFF)
                 ).astype(jnp.uint8) for k in range(4)]
    return out


def decode_codes(qe, qo, s, z, cfg=None):
    """`dequantize4`: (q − z)·s of the even and odd codes. Under cfg.lean q − z is the
    float 2^23 + q less 2^23 + z: both exact for the integer z in [0, 15] that compress
    writes, so the difference is the same exact q − z, in one subtraction."""
    if _opt(cfg, "lean"):
        zb = z + np.float32(2 ** 23)
        return ((_float_bits(qe) - zb) * s, (_float_bits(qo) - zb) * s)
    return (_to_float(qe) - z) * s, (_to_float(qo) - z) * s


def decode_tile(code_bytes, scale_bytes, codec, cfg=None):
    """(tm, B/2) uint8 codes + the row's scales → even, odd (tm, B/2) f32. scale_bytes:
    (tm, 4·n) uint8, or under scale_words the list of (tm, 1) f32 scales."""
    c = code_bytes.astype(jnp.int32)
    scales = (scale_bytes if _opt(cfg, "scale_words")
              else quant.unpack_scales(scale_bytes, codec.n_scales))
    z = jnp.float32(SYM_ZERO) if codec.symmetric else scales[1]
    return decode_codes(c & 0xF, lax.shift_right_logical(c, 4), scales[0], z, cfg)


# -- kernels -----------------------------------------------------------------------------------
def _load_raw(ref, t, tm, b, rows, pairs, row0=0):
    """A (tm, B) tile of float data as loaded: itself, or its (tm, B/2) uint32 pairs of
    `pairs` (bf16 / f16; None: the data's own dtype)."""
    return tiling.load_rows(ref, t, tm, 0, b if pairs is None else b // 2, rows, row0=row0)


def _split_raw(raw, pairs):
    """`_load_raw`'s tile → its even and odd f32 elements."""
    return _halves(raw.astype(jnp.float32)) if pairs is None else _unpair(raw, pairs)


def _load_halves(ref, t, tm, b, rows, pairs, row0=0):
    """Even and odd f32 elements of a (tm, B) float tile (`_load_raw`, `_split_raw`)."""
    return _split_raw(_load_raw(ref, t, tm, b, rows, pairs, row0), pairs)


def _store_decoded(o_ref, t, ve, vo, tm, rows, pairs, cfg):
    """Decoded even, odd (tm, B/2) f32 → o_ref's rows: int32 pairs of `pairs`, or the
    interleaved tile in o_ref's dtype."""
    if pairs is None:
        tiling.store_rows(o_ref, t, _interleave(ve, vo).astype(o_ref.dtype), tm, 0, rows)
    else:
        tiling.store_rows(o_ref, t, _pair(ve, vo, pairs, cfg), tm, 0, rows)


def _store_encoded(o_ref, t, enc, tm, half, rows, codec, cfg):
    """encode_tile's code and scale bytes → the wire rows (bytes, or words under
    word_stores: little-endian, as `to_words` reads them)."""
    code_bytes, scale_bytes, _, s, z = enc
    if _word_stores(cfg, codec):
        shift = 8 * lax.broadcasted_iota(jnp.int32, (tm, half // 4, 4), 2)
        packed = jnp.sum(lax.shift_left(code_bytes.reshape(tm, half // 4, 4), shift), axis=2)
        tiling.store_rows(o_ref, t, lax.bitcast_convert_type(packed, jnp.uint32), tm, 0, rows)
        for k, v in enumerate([s] if codec.symmetric else [s, z]):
            tiling.store_rows(o_ref, t, lax.bitcast_convert_type(v, jnp.uint32), tm,
                              half // 4 + k, rows)
        return
    tiling.store_rows(o_ref, t, code_bytes, tm, 0, rows)
    if scale_bytes is not None:
        tiling.store_rows(o_ref, t, scale_bytes, tm, half, rows)
        return
    for k, col in enumerate(scale_byte_columns(s, z, codec)):
        tiling.store_rows(o_ref, t, col, tm, half + k, rows)


def compress_kernel(*refs, codec, cfg, n_rows, skip_rows, feedback, pairs=None):
    if feedback:
        x_ref, r_ref, skip_ref, o_ref, e_ref = refs
    else:
        (x_ref, skip_ref, o_ref), r_ref, e_ref = refs, None, None
    tm, b = cfg.blocks_per_program, codec.block_size
    rows = tiling.mask_rows(cfg, n_rows)
    skip0 = skip_ref[0]

    def load(t):              # tile t's raw input (and residual): what the loop carries
        raw = [_load_raw(x_ref, t, tm, b, rows, pairs)]
        if feedback:
            raw.append(tiling.load_rows(r_ref, t, tm, 0, b, rows))
        return raw

    def work(t, raw=None):
        raw = load(t) if raw is None else raw
        xe, xo = _split_raw(raw[0], pairs)
        if feedback:          # the site's input less this device's share of the last error
            re, ro = _halves(raw[1])
            xe, xo = xe - re, xo - ro
        enc = encode_tile(xe, xo, codec, cfg)
        _store_encoded(o_ref, t, enc, tm, b // 2, rows, codec, cfg)
        if feedback:          # new residual: decode(encode(x − r)) − (x − r)
            _, _, (qe, qo), s, z = enc
            de, do = decode_codes(qe, qo, s, z, cfg)
            tiling.store_rows(e_ref, t, _interleave(de - xe, do - xo), tm, 0, rows)

    if _opt(cfg, "prefetch") and cfg.tiles_per_program > 1 and not skip_rows:
        tiling.for_each_tile_prefetched(cfg, load, work)
    else:
        tiling.for_each_tile_outside(cfg, n_rows, work, skip0, skip_rows)


def _decode_rows(r_ref, r32_ref, t, tm, half, rows, codec, cfg, lead=()):
    """Decode wire rows (of peer lead, where given): even, odd (tm, B/2) f32. r32_ref: the
    wire as uint32 words (scale_words), else None."""
    code_bytes = tiling.load_rows(r_ref, t, tm, 0, half, rows, lead=lead)
    if r32_ref is None:
        scales = tiling.load_rows(r_ref, t, tm, half, 4 * codec.n_scales, rows, lead=lead)
    else:
        scales = [lax.bitcast_convert_type(
            tiling.load_rows(r32_ref, t, tm, half // 4 + k, 1, rows, lead=lead), jnp.float32)
            for k in range(codec.n_scales)]
    return decode_tile(code_bytes, scales, codec, cfg)


def _split_refs(refs, cfg):
    """(wire ref, its uint32 view or None, the other refs) of a decoding kernel."""
    if _opt(cfg, "scale_words"):
        return refs[0], refs[1], refs[2:]
    return refs[0], None, refs[1:]


def decompress_kernel(*refs, codec, cfg, n_rows, pairs=None):
    w_ref, w32_ref, (o_ref,) = _split_refs(refs, cfg)
    tm, half = cfg.blocks_per_program, codec.block_size // 2
    rows = tiling.mask_rows(cfg, n_rows)

    def tile(t):
        ve, vo = _decode_rows(w_ref, w32_ref, t, tm, half, rows, codec, cfg)
        _store_decoded(o_ref, t, ve, vo, tm, rows, pairs, cfg)
    tiling.for_each_tile(cfg, n_rows, tile)


def reduce_kernel(*refs, codec, cfg, n_rows, n_peers, pairs=None):
    r_ref, r32_ref, (x_ref, idx_ref, o_ref) = _split_refs(refs, cfg)
    tm, b = cfg.blocks_per_program, codec.block_size
    me, own_row0 = idx_ref[0], idx_ref[1]
    rows = tiling.mask_rows(cfg, n_rows)

    def tile(t):
        acc = _load_halves(x_ref, t, tm, b, rows, pairs, row0=own_row0)
        for p in range(n_peers):   # P is small (the TP degree): unrolled, in device order
            def add(a, p=p):
                de, do = _decode_rows(r_ref, r32_ref, t, tm, b // 2, rows, codec, cfg,
                                      lead=(p,))
                return a[0] + de, a[1] + do
            # The own copy is skipped (never read: the sender may not have written it);
            # the exact input stands in for it.
            acc = lax.cond(me == p, lambda a: a, add, acc)
        _store_encoded(o_ref, t, encode_tile(*acc, codec, cfg), tm, b // 2, rows, codec,
                       cfg)
    tiling.for_each_tile(cfg, n_rows, tile)


def decode_sum_kernel(*refs, codec, cfg, n_rows, n_parts, pairs=None):
    r_ref, r32_ref, (o_ref,) = _split_refs(refs, cfg)
    tm, half = cfg.blocks_per_program, codec.block_size // 2
    rows = tiling.mask_rows(cfg, n_rows)

    def tile(t):
        acc = None
        for p in range(n_parts):      # P is small: unrolled, in device order
            de, do = _decode_rows(r_ref, r32_ref, t, tm, half, rows, codec, cfg, lead=(p,))
            acc = (de, do) if acc is None else (acc[0] + de, acc[1] + do)
        _store_decoded(o_ref, t, *acc, tm, rows, pairs, cfg)
    tiling.for_each_tile(cfg, n_rows, tile)


# -- wrappers ----------------------------------------------------------------------------------
def _check_codec(codec, what):
    if not covers(codec):
        raise ValueError(f"echo4 {what} kernel: {codec!r} is not echo4 or int4-sym "
                         f"(tah4 and the TACO codecs have other kernels or none)")


def _config(cfg, codec, kernel, interpret, n_rows):
    return (cfg or default_config(codec.block_size, kernel, n_rows)).resolve(False, interpret)


@functools.partial(jax.jit, static_argnames=("codec", "cfg", "interpret", "skip_rows"))
def compress(x, codec, cfg=None, interpret=False, skip_start=0, skip_rows: int = 0):
    """(n_blocks, B) float → (n_blocks, row_bytes) uint8, the codec's wire rows. Output rows
    [skip_start, skip_start + skip_rows) (skip_start may be traced) may be left unwritten
    (the two-shot all-reduce never reads the segment a device would send to itself)."""
    _check_codec(codec, "compress")
    check_float(x, "echo4 compress kernel: x")
    if x.ndim != 2 or x.shape[1] != codec.block_size:
        raise ValueError(f"echo4 compress kernel: {x.shape=} is not (n_blocks, "
                         f"{codec.block_size}) for {codec.name}")
    return _compress(x, None, codec, _config(cfg, codec, "compress", interpret, x.shape[0]),
                     skip_start, skip_rows)


@functools.partial(jax.jit, static_argnames=("codec", "cfg", "interpret", "skip_rows"))
def compress_feedback(x, r, codec, cfg=None, interpret=False, skip_start=0,
                      skip_rows: int = 0):
    """Compress with error feedback in one pass: x (n_blocks, B) float and the residual r
    (n_blocks, B) float32 → (wire of z = x − r, new residual decode(wire) − z (n_blocks, B)
    float32). Rows in the skipped window (see `compress`) are left unwritten in both."""
    _check_codec(codec, "compress_feedback")
    check_float(x, "echo4 compress_feedback kernel: x")
    if x.ndim != 2 or x.shape[1] != codec.block_size or r.shape != x.shape:
        raise ValueError(f"echo4 compress_feedback kernel: {x.shape=} and {r.shape=} must "
                         f"both be (n_blocks, {codec.block_size}) for {codec.name}")
    if r.dtype != jnp.float32:
        raise TypeError(f"echo4 compress_feedback kernel: the residual is float32, got "
                        f"{r.dtype=}")
    # the small-input tiling at every size: 0.93 of the roofline at 256 MiB and 1 GiB on
    # the H200 (it moves 4× compress's bytes, so it is not latency-bound like compress)
    return _compress(x, r, codec, _config(cfg, codec, "compress", interpret, None),
                     skip_start, skip_rows)


def _compress(x, r, codec, cfg, skip_start, skip_rows):
    if skip_rows < 0:
        raise ValueError(f"echo4 compress kernel: {skip_rows=} must be ≥ 0")
    n_rows = x.shape[0]
    feedback = r is not None
    pairs = _pair_dtype(cfg, x.dtype)
    kernel = functools.partial(compress_kernel, codec=codec, cfg=cfg, n_rows=n_rows,
                               skip_rows=skip_rows, feedback=feedback, pairs=pairs)
    skip = jnp.asarray(skip_start, jnp.int32).reshape(1)
    wire = _wire_out(n_rows, codec, cfg, x)
    xin = x if pairs is None else to_pairs(x)
    if not feedback:
        return _wire_bytes(tiling.launch(kernel, wire, n_rows, cfg, cfg.interpret,
                                         "echo4_compress", xin, skip), codec, cfg)
    err = tiling.out_struct(x.shape, jnp.float32, x)
    w, e = tiling.launch(kernel, (wire, err), n_rows, cfg, cfg.interpret,
                         "echo4_compress_feedback", xin, r, skip)
    return _wire_bytes(w, codec, cfg), e


@functools.partial(jax.jit, static_argnames=("codec", "out_dtype", "cfg", "interpret"))
def decompress(w, codec, out_dtype=jnp.float32, cfg=None, interpret=False):
    """(n_blocks, row_bytes) uint8 → (n_blocks, B) out_dtype."""
    _check_codec(codec, "decompress")
    if w.ndim != 2 or w.shape[1] != codec.row_bytes or w.dtype != jnp.uint8:
        raise ValueError(f"echo4 decompress kernel: got {w.shape=} {w.dtype=}; want uint8 "
                         f"rows of {codec.row_bytes} bytes for {codec.name}")
    n_rows = w.shape[0]
    cfg = _config(cfg, codec, "decompress", interpret, n_rows)
    pairs = _pair_dtype(cfg, out_dtype)
    kernel = functools.partial(decompress_kernel, codec=codec, cfg=cfg, n_rows=n_rows,
                               pairs=pairs)
    out = _decoded_struct(n_rows, codec, out_dtype, pairs, w)
    y = tiling.launch(kernel, out, n_rows, cfg, interpret, "echo4_decompress",
                      *_wire_args(w, cfg))
    return y if pairs is None else from_pairs(y, pairs)


def _decoded_struct(n_rows, codec, out_dtype, pairs, like):
    if pairs is None:
        return tiling.out_struct((n_rows, codec.block_size), out_dtype, like)
    return tiling.out_struct((n_rows, codec.block_size // 2), jnp.int32, like)


def _wire_args(w, cfg):
    """The wire, and under scale_words its uint32 view too."""
    return (w, to_words(w)) if _opt(cfg, "scale_words") else (w,)


@functools.partial(jax.jit, static_argnames=("codec", "cfg", "interpret"))
def reduce(recv, own, me, codec, cfg=None, interpret=False, own_row0=0):
    """The owner's step: recv (P, n_blocks, row_bytes) uint8, own (≥ own_row0 + n_blocks, B)
    float, me int32 → (n_blocks, row_bytes) uint8, compress(own[own_row0:][:n_blocks] +
    Σ_{p ≠ me} decompress(recv[p])), summed in f32 in that order (recv[me] is never read)."""
    _check_codec(codec, "reduce")
    check_float(own, "echo4 reduce kernel: own")
    if (recv.ndim != 3 or recv.shape[2] != codec.row_bytes or own.ndim != 2
            or own.shape[1] != codec.block_size or own.shape[0] < recv.shape[1]):
        raise ValueError(f"echo4 reduce kernel: got {recv.shape=}, {own.shape=} for "
                         f"{codec.name} (rows of {codec.row_bytes} bytes, blocks of "
                         f"{codec.block_size})")
    n_peers, n_rows, row = recv.shape
    cfg = _config(cfg, codec, "reduce", interpret, n_rows)
    pairs = _pair_dtype(cfg, own.dtype)
    idx = jnp.stack([jnp.asarray(me, jnp.int32), jnp.asarray(own_row0, jnp.int32)])
    kernel = functools.partial(reduce_kernel, codec=codec, cfg=cfg, n_rows=n_rows,
                               n_peers=n_peers, pairs=pairs)
    out = _wire_out(n_rows, codec, cfg, own)
    return _wire_bytes(tiling.launch(kernel, out, n_rows, cfg, interpret, "echo4_reduce",
                                     *_wire_args(recv, cfg),
                                     own if pairs is None else to_pairs(own), idx), codec, cfg)


@functools.partial(jax.jit, static_argnames=("codec", "out_dtype", "cfg", "interpret"))
def decode_sum(recv, codec, out_dtype=jnp.float32, cfg=None, interpret=False):
    """recv (P, n_blocks, row_bytes) uint8 → (n_blocks, B) out_dtype: Σ_p decode(recv[p]),
    summed in f32 in the order p = 0, 1, …, P − 1."""
    _check_codec(codec, "decode_sum")
    if recv.ndim != 3 or recv.shape[2] != codec.row_bytes:
        raise ValueError(f"echo4 decode_sum kernel: got {recv.shape=} for {codec.name} "
                         f"(rows of {codec.row_bytes} bytes)")
    n_parts, n_rows, _ = recv.shape
    cfg = _config(cfg, codec, "decode_sum", interpret, n_rows)
    pairs = _pair_dtype(cfg, out_dtype)
    kernel = functools.partial(decode_sum_kernel, codec=codec, cfg=cfg, n_rows=n_rows,
                               n_parts=n_parts, pairs=pairs)
    out = _decoded_struct(n_rows, codec, out_dtype, pairs, recv)
    y = tiling.launch(kernel, out, n_rows, cfg, interpret, "echo4_decode_sum",
                      *_wire_args(recv, cfg))
    return y if pairs is None else from_pairs(y, pairs)
