"""Kernel plumbing shared by the compress, decompress and reduce kernels: tiling config,
the tensor-core Hadamard, row-tile loads and the pallas_call launcher."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from taco_jax import hadamard


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tiling of one program. Defaults measured on H200 (see docs/design.md)."""
    blocks_per_program: int = 8     # rows of B elements per tile (power of two)
    # 2 warps, below one warpgroup: Triton's dots are mma.sync instead of wgmma. Measured
    # A B A B at 256 MiB against 16 blocks × 4 warps (session 6, docs/results.md):
    # decompress 0.87 vs 0.77 of the roofline, reduce 0.88 vs 0.72, compress 0.75 vs 0.75.
    num_warps: int = 2
    num_stages: int = 3
    # bf16 hi+lo split of the Hadamard intermediate (≈16 mantissa bits). None: only where
    # the data is wider than bf16; for bf16 data the single rounding (2^-9) adds ~0.1% to
    # the FP8 error of ~2.6% and costs ~15% of compress time (measured, docs/design.md).
    precise: bool | None = None
    tiles_per_program: int = 1      # >1: a loop over tiles per program (lets Triton pipeline)
    # >0: at most this many programs, each looping over every max_programs-th tile. Leaves
    # SMs free for NCCL's kernels when compression overlaps communication (chunked psum).
    max_programs: int = 0
    # Per-block scalar math (α, the code multiplier, decode's s/α) with the GPU's
    # approximate rsqrt / reciprocal (one MUFU instruction each, ≤ 2 ulp) instead of IEEE
    # sqrt and division, whose range checks and slow paths are ~30% of compress's SASS
    # (Nsight Compute source view, docs/results.md). The scales are still exact functions
    # of what is sent: decode uses the s and α on the wire. On by default since session 6:
    # compress 3–6% and reduce 2–4% faster on the H200, A B A B (docs/results.md).
    fast_rowmath: bool = True
    interpret: bool = False         # set by resolve(): no inline PTX in the interpreter

    @staticmethod
    def default(block_size: int, kernel: str | None = None) -> "KernelConfig":
        """2048 elements per tile (1024 per warp), at least 4 blocks: measured at B = 256
        (8 blocks); other block sizes keep the elements per warp. kernel="compress": a loop
        of 4 tiles per program, which lets Triton pipeline the next tile's loads (session 7,
        256 MiB, 3 interleaved rounds: 0.854–0.865 of the roofline vs 0.785–0.814 with one
        tile; decompress lost with it, 0.83–0.85 vs 0.87–0.94, and the reduce tied)."""
        if kernel not in (None, "compress", "decompress", "reduce"):
            raise ValueError(f"KernelConfig.default: unknown kernel {kernel!r}")
        return KernelConfig(blocks_per_program=max(4, 2048 // block_size),
                            tiles_per_program=4 if kernel == "compress" else 1)

    def resolve(self, wide: bool, interpret: bool = False) -> "KernelConfig":
        """Fix `precise` for data that is (wide=True) or is not wider than bf16, and note
        whether the kernel runs in the Pallas interpreter."""
        precise = wide if self.precise is None else self.precise
        return dataclasses.replace(self, precise=precise, interpret=interpret)


def _ptx_unary(instr: str, x):
    return plgpu.elementwise_inline_asm(
        f"{instr} $0, $1;", args=[x], constraints="=f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, x.dtype)])[0]


def div(a, b, cfg: KernelConfig):
    """a / b of f32 (kernel code): IEEE division, or with cfg.fast_rowmath a times the
    approximate reciprocal of b (rcp.approx.ftz.f32: ≤ 1 ulp; inf → 0, 0 → inf, NaN → NaN;
    the interpreter divides)."""
    if cfg.fast_rowmath and not cfg.interpret:
        return a * _ptx_unary("rcp.approx.ftz.f32", b)
    return a / b


def rsqrt_approx(x, cfg: KernelConfig):
    """1/sqrt(x) of f32 ≥ 0 for fast_rowmath: rsqrt.approx.ftz.f32 (≤ 2 ulp; inf → 0); the
    interpreter uses lax.rsqrt."""
    if cfg.interpret:
        return jax.lax.rsqrt(x)
    return _ptx_unary("rsqrt.approx.ftz.f32", x)


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
                  cfg: KernelConfig, bf16_transpose: bool = False):
    """Unnormalised wire-order Hadamard of a (tm, B) f32 tile (times sqrt(B) vs `hadamard`).

    Kronecker path: view (tm, a, b), multiply by H_b on the right, transpose each block,
    multiply by H_a: 2·(a + b) FLOP/element instead of 2·B for the dense matrix.
    bf16_transpose (when not `precise`): round the intermediate to bf16 before the
    transpose instead of after it; bit-identical, half the bytes through shared memory
    (part of a measured 12% gain in compress; in decompress it measured no better)."""
    tm, precise = v.shape[0], cfg.precise
    if not kron_ok(block_size):
        m = h2 if inverse else h1
        return _dot(v, m, exact_input, precise)
    r, c = hadamard.factors(block_size)
    (a, ha), (b, hb) = ((c, h2), (r, h1)) if inverse else ((r, h1), (c, h2))
    y = _dot(v.reshape(tm * a, b), hb, exact_input, precise)            # (tm·a, b)
    early = bf16_transpose and not precise
    if early:
        y = y.astype(jnp.bfloat16)
    y = jnp.transpose(y.reshape(tm, a, b), (0, 2, 1)).reshape(tm * b, a)  # (tm·b, a)
    return _dot(y, ha, early, precise).reshape(tm, block_size)


def row_tile(ref, tile, tm: int, col0: int, width: int, n_rows: int, lead=(), row0=0):
    """Index + mask for rows row0 + [tile·tm, tile·tm + tm) (masked to < row0 + n_rows) and
    columns [col0, col0 + width). row0 lets a kernel work on a window of a larger array
    (a chunk of a pipelined collective) without slicing copies."""
    local = tile * tm + jnp.arange(tm)
    cols = col0 + jnp.arange(width)
    mask = (local < n_rows)[:, None]
    rows = row0 + local
    return ref.at[(*lead, rows[:, None], cols[None, :])], mask


def load_rows(ref, tile, tm, col0, width, n_rows, lead=(), row0=0):
    view, mask = row_tile(ref, tile, tm, col0, width, n_rows, lead, row0)
    return plgpu.load(view, mask=mask, other=0)


def store_rows(ref, tile, value, tm, col0, n_rows, row0=0):
    view, mask = row_tile(ref, tile, tm, col0, value.shape[1], n_rows, row0=row0)
    plgpu.store(view, value, mask=mask)


def n_programs(cfg: KernelConfig, n_rows: int) -> int:
    tiles = pl.cdiv(n_rows, cfg.blocks_per_program)
    if cfg.max_programs:
        return max(1, min(tiles, cfg.max_programs))
    return pl.cdiv(tiles, cfg.tiles_per_program)


def for_each_tile(cfg: KernelConfig, n_rows: int, body) -> None:
    """Run body(tile) for this program's tiles: one; a contiguous run of tiles_per_program
    (a loop Triton can pipeline); or, with max_programs, every n_programs-th tile."""
    pid = pl.program_id(0)
    if cfg.max_programs:
        grid = n_programs(cfg, n_rows)
        trips = pl.cdiv(pl.cdiv(n_rows, cfg.blocks_per_program), grid)
        # tiles past the end are fully masked (rows ≥ n_rows): loads give 0, stores skip

        def strided(k, carry):
            body(pid + k * grid)
            return carry
        jax.lax.fori_loop(0, trips, strided, 0)
        return
    t = cfg.tiles_per_program
    if t == 1:
        body(pid)
        return

    def step(k, carry):
        body(pid * t + k)
        return carry
    jax.lax.fori_loop(0, t, step, 0)


def launch(kernel, out_shape, n_rows: int, cfg: KernelConfig, interpret: bool, name: str,
           *args, aliases=None):
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
        input_output_aliases=aliases or {},
    )(*args)


def out_struct(shape, dtype, like):
    """ShapeDtypeStruct that carries `like`'s manual axes (needed under shard_map with
    check_vma=True, where pallas_call outputs must say which axes they vary over)."""
    mat = getattr(jax.typeof(like), "manual_axis_type", None)
    if mat is None:
        return jax.ShapeDtypeStruct(shape, dtype)
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)
