"""Plumbing shared by the compress, decompress and reduce kernels: the tiling config,
the tensor-core Hadamard, row-tile loads and stores, and the pallas_call launcher."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from taco_jax.numerics import hadamard


MID_ELEMENTS = 32 << 20          # 64 MiB of bf16: up to it, compress runs smaller programs
SMALL_ELEMENTS = 8 << 20         # 16 MiB of bf16: up to it, those programs loop over 4 tiles


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tiling of one program (defaults: `KernelConfig.default`, measured on the H200)."""
    blocks_per_program: int = 8     # rows of B elements per tile (power of two)
    # Below one warpgroup, Triton's dots are mma.sync instead of wgmma, which suits these
    # small per-block matmuls (docs/design.md, "Kernels").
    num_warps: int = 2
    num_stages: int = 3
    # bf16 hi+lo split of the Hadamard intermediate (≈16 mantissa bits). None: only where
    # the data is wider than bf16; for bf16 data the single rounding (2^-9) adds ~0.1% to
    # the FP8 error of ~2.6% and would cost ~15% of compress time.
    precise: bool | None = None
    tiles_per_program: int = 1      # >1: a loop over tiles per program (lets Triton pipeline)
    # Per-block scalar math (α, the code multiplier, decode's s/α) with the GPU's
    # approximate rsqrt / reciprocal (one MUFU instruction each, ≤ 2 ulp) instead of IEEE
    # sqrt and division, whose range checks and slow paths are ~30% of compress's
    # instructions. The scales stay exact functions of what is sent: decode uses the s and
    # α on the wire.
    fast_rowmath: bool = True
    # Row masks on loads and stores. None: only where the programs' tiles overrun the rows
    # (n_rows not a multiple of blocks_per_program · tiles_per_program); True: always.
    row_masks: bool | None = None
    # Kronecker factors built in registers from iota (H[i, j] = (-1)^popcount(i & j))
    # instead of loaded from the operands: no global loads before the first dot and no
    # shared-memory reads of the factors per tile. Compress device time on the H200: 9.5 vs
    # 10.1 µs at 16 MiB, 101.2 vs 101.6 µs at 256 MiB (bench/results/kernels_tilings_small.json).
    hadamard_iota: bool = True
    interpret: bool = False         # set by resolve(): no inline PTX in the interpreter

    @staticmethod
    def default(block_size: int, kernel: str | None = None,
                n_rows: int | None = None) -> "KernelConfig":
        """decompress, reduce: 2048 elements per tile (1024 per warp, 2 warps), at least 4
        blocks, one tile per program. compress: one warp per program looping over 8 tiles
        (Triton pipelines the next tile's loads under this one's transform) of 1024 elements,
        512 for inputs up to MID_ELEMENTS (n_rows blocks), where more, smaller programs fill
        the GPU, and 4 tiles of 512 up to SMALL_ELEMENTS, where shorter loops finish sooner.
        Device time on the H200, fraction of the roofline, against 8 blocks × 2 warps
        × 4 tiles: 0.56 vs 0.48 at 16 MiB, 0.77 vs 0.72 at 64 MiB, 0.90 vs 0.87 at 256 MiB,
        0.82 vs 0.79 at 1 GiB (bench/results/kernels_tilings.json); 4 tiles of 512 against 8:
        0.58 vs 0.56 at 16 MiB, 0.75 vs 0.76 at 64 MiB; more warps per program lose at 16 MiB
        (CHANGELOG.md, bench/results/kernels_alternatives.json)."""
        if kernel not in (None, "compress", "decompress", "reduce"):
            raise ValueError(f"KernelConfig.default: unknown kernel {kernel!r}")
        if kernel == "compress":
            n = None if n_rows is None else n_rows * block_size
            small = n is not None and n <= MID_ELEMENTS
            return KernelConfig(blocks_per_program=max(1, (512 if small else 1024) // block_size),
                                num_warps=1,
                                tiles_per_program=4 if small and n <= SMALL_ELEMENTS else 8)
        return KernelConfig(blocks_per_program=max(4, 2048 // block_size))

    def resolve(self, wide: bool, interpret: bool = False) -> "KernelConfig":
        """Fix `precise` for data that is (wide=True) or is not wider than bf16, and note
        whether the kernel runs in the Pallas interpreter."""
        precise = wide if self.precise is None else self.precise
        return dataclasses.replace(self, precise=precise, interpret=interpret)


def ptx(instr: str, *args):
    """One PTX f32 instruction applied element-wise (Pallas-Triton kernels)."""
    operands = ", ".join(f"${k + 1}" for k in range(len(args)))
    return plgpu.elementwise_inline_asm(
        f"{instr} $0, {operands};", args=list(args),
        constraints="=f," + ",".join("f" * len(args)), pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, args[0].dtype)])[0]


def div(a, b, cfg: KernelConfig):
    """a / b of f32 (kernel code): IEEE division, or with cfg.fast_rowmath a times the
    approximate reciprocal of b (rcp.approx.ftz.f32: ≤ 1 ulp; inf → 0, 0 → inf, NaN → NaN;
    the interpreter divides)."""
    if cfg.fast_rowmath and not cfg.interpret:
        return a * ptx("rcp.approx.ftz.f32", b)
    return a / b


def rsqrt_approx(x, cfg: KernelConfig):
    """1/sqrt(x) of f32 ≥ 0 for fast_rowmath: rsqrt.approx.ftz.f32 (≤ 2 ulp; inf → 0); the
    interpreter uses lax.rsqrt."""
    if cfg.interpret:
        return jax.lax.rsqrt(x)
    return ptx("rsqrt.approx.ftz.f32", x)


def kron_ok(block_size: int) -> bool:
    """Tensor-core dots need every dimension ≥ 16: the Kronecker path needs r, c ≥ 16."""
    return min(hadamard.factors(block_size)) >= 16


def hadamard_operands(block_size: int, scaled: bool = False) -> tuple[jax.Array, jax.Array]:
    """The ±1 matrices a kernel needs (kernels cannot capture array constants). scaled:
    each factor divided by its size (±1/r, ±1/c; powers of two, exact in bf16), so the
    forward transform yields H·x/B, whose partial sums cannot overflow for finite x."""
    if kron_ok(block_size):
        r, c = hadamard.factors(block_size)
        h1, h2 = hadamard.sylvester(r), hadamard.sylvester(c)
        if scaled:
            h1, h2 = h1 / r, h2 / c
    else:
        m = hadamard.wire_matrix(block_size)
        h1, h2 = (m / block_size, m.T / block_size) if scaled else (m, m.T.copy())
    return jnp.asarray(h1, jnp.bfloat16), jnp.asarray(h2, jnp.bfloat16)


def factor_values(ref, block_size: int, which: int, scaled: bool, cfg: KernelConfig):
    """The Hadamard factor `which` (0: rows, 1: columns) inside a kernel: `ref` loaded, or
    with cfg.hadamard_iota on the Kronecker path the Sylvester matrix built from iota
    (divided by its size where `scaled`, as `hadamard_operands`)."""
    if not (cfg.hadamard_iota and kron_ok(block_size)):
        return ref[...]
    n = hadamard.factors(block_size)[which]
    i = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)
    odd = (jax.lax.population_count(i & j) & 1) == 1
    one = np.float32(1.0 / n if scaled else 1.0)
    return jnp.where(odd, -one, one).astype(jnp.bfloat16)


def _dot(v, h, exact_input: bool, precise: bool):
    """v (f32) @ h (±1, bf16) with f32 accumulation. v is rounded to bf16 for the tensor
    cores; `precise` adds the bf16 residual in a second dot (hi + lo ≈ 16 mantissa bits)."""
    hi = v.astype(jnp.bfloat16)
    out = jnp.dot(hi, h, preferred_element_type=jnp.float32)
    if precise and not exact_input:
        lo = (v - hi.astype(jnp.float32)).astype(jnp.bfloat16)
        out = out + jnp.dot(lo, h, preferred_element_type=jnp.float32)
    return out


def hadamard_tile(v, h1, h2, *, block_size: int, inverse: bool, exact_input: bool,
                  cfg: KernelConfig):
    """Unnormalised wire-order Hadamard of a (tm, B) f32 tile (times sqrt(B) vs `hadamard`).

    Kronecker path: view (tm, a, b), multiply by H_b on the right, transpose each block,
    multiply by H_a: 2·(a + b) FLOP/element instead of 2·B for the dense matrix. Unless
    `precise`, the intermediate is rounded to bf16 before the transpose rather than by the
    second dot: bit-identical, and half the bytes through shared memory."""
    tm, precise = v.shape[0], cfg.precise
    if not kron_ok(block_size):
        m = h2 if inverse else h1
        return _dot(v, m, exact_input, precise)
    r, c = hadamard.factors(block_size)
    (a, ha), (b, hb) = ((c, h2), (r, h1)) if inverse else ((r, h1), (c, h2))
    y = _dot(v.reshape(tm * a, b), hb, exact_input, precise)            # (tm·a, b)
    if not precise:
        y = y.astype(jnp.bfloat16)
    y = jnp.transpose(y.reshape(tm, a, b), (0, 2, 1)).reshape(tm * b, a)  # (tm·b, a)
    return _dot(y, ha, not precise, precise).reshape(tm, block_size)


def mask_rows(cfg: KernelConfig, n_rows: int) -> int | None:
    """The n_rows that loads and stores mask to, or None where no program's tile reaches
    past the last row (the masks' compares and selects are per element)."""
    if cfg.row_masks or n_rows % (cfg.blocks_per_program * cfg.tiles_per_program):
        return n_rows
    return None


def row_tile(ref, tile, tm: int, col0: int, width: int, n_rows: int | None, lead=(),
             row0=0):
    """Index + mask for rows row0 + [tile·tm, tile·tm + tm) (masked to < row0 + n_rows;
    n_rows None: no mask, see `mask_rows`) and columns [col0, col0 + width). row0 (may be
    traced) lets the reduce read its own segment of the whole input without a slicing copy."""
    local = tile * tm + jnp.arange(tm)
    cols = col0 + jnp.arange(width)
    mask = None if n_rows is None else (local < n_rows)[:, None]
    rows = row0 + local
    return ref.at[(*lead, rows[:, None], cols[None, :])], mask


def load_rows(ref, tile, tm, col0, width, n_rows, lead=(), row0=0):
    view, mask = row_tile(ref, tile, tm, col0, width, n_rows, lead, row0)
    return plgpu.load(view) if mask is None else plgpu.load(view, mask=mask, other=0)


def store_rows(ref, tile, value, tm, col0, n_rows):
    view, mask = row_tile(ref, tile, tm, col0, value.shape[1], n_rows)
    plgpu.store(view, value, mask=mask)


def n_programs(cfg: KernelConfig, n_rows: int) -> int:
    return pl.cdiv(pl.cdiv(n_rows, cfg.blocks_per_program), cfg.tiles_per_program)


def for_each_tile(cfg: KernelConfig, n_rows: int, body) -> None:
    """Run body(tile) for this program's tiles: one, or a contiguous run of
    tiles_per_program (a loop Triton can pipeline; tiles past the end are fully masked)."""
    pid = pl.program_id(0)
    t = cfg.tiles_per_program
    if t == 1:
        body(pid)
        return

    def step(k, carry):
        body(pid * t + k)
        return carry
    jax.lax.fori_loop(0, t, step, 0)


def for_each_tile_prefetched(cfg: KernelConfig, load, body) -> None:
    """`for_each_tile` over this program's tiles_per_program tiles, software-pipelined:
    load(tile) returns what body(tile, loaded) computes on, and step k loads tile k + 1
    before body runs on tile k (the loads carried in registers to the next step), so the
    loads' latency overlaps the math. Only this program's tiles are loaded (the last one in
    the epilogue, outside the loop); tiles past the end are masked as `load` masks them."""
    pid = pl.program_id(0)
    t = cfg.tiles_per_program
    first = pid * t

    def step(k, cur):
        nxt = load(first + k + 1)
        body(first + k, cur)
        return nxt
    last = jax.lax.fori_loop(0, t - 1, step, load(first))
    body(first + t - 1, last)


def for_each_tile_outside(cfg: KernelConfig, n_rows: int, body, skip0, skip_rows: int
                          ) -> None:
    """`for_each_tile`, leaving out the tiles wholly inside rows [skip0, skip0 + skip_rows)
    (skip0 may be traced): a compress whose caller never reads those rows leaves them
    unwritten."""
    if not skip_rows:
        for_each_tile(cfg, n_rows, body)
        return
    tm = cfg.blocks_per_program

    def tile(t):
        inside = (t * tm >= skip0) & (t * tm + tm <= skip0 + skip_rows)
        pl.when(jnp.logical_not(inside))(lambda: body(t))
    for_each_tile(cfg, n_rows, tile)


def launch(kernel, out_shape, n_rows: int, cfg: KernelConfig, interpret: bool, name: str,
           *args):
    """pallas_call over row tiles; refs are whole arrays (tiles are addressed by hand so
    payload and scales of one row can live in one uint8 buffer)."""
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(n_programs(cfg, n_rows),),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps,
                                             num_stages=cfg.num_stages),
        interpret=interpret,
        name=name,
    )(*args)


def out_struct(shape, dtype, like):
    """ShapeDtypeStruct that carries `like`'s manual axes (needed under shard_map with
    check_vma=True, where pallas_call outputs must say which axes they vary over)."""
    mat = getattr(jax.typeof(like), "manual_axis_type", None)
    if mat is None:
        return jax.ShapeDtypeStruct(shape, dtype)
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)
