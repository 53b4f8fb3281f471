"""A bf16 GEMM as a Pallas Mosaic GPU kernel (Hopper: TMA, wgmma), and the pipeline it
shares with the GEMM whose epilogue encodes (`encode_epilogue`).

    y = x @ w,  x (M, K), w (K, N) bf16 or f16, accumulated in f32, y in x's dtype.

Modelled on jax's `pallas/ops/gpu/hopper_matmul_mgpu.py` (warp-specialized, one memory
warpgroup feeding compute warpgroups through shared-memory slots), written for Lane
lowering semantics, where the codecs' register tile math runs (`mosaic.taco_tiles`,
`mosaic.echo4`). Its tiles have the codecs' shape: a compute warpgroup accumulates 64 rows
× 256 columns, one block of 256 values per tile row, so an epilogue hands its accumulator
to a tile codec unchanged. Program tiles are (64·wgs, 256) (`GemmConfig`); each program
takes tiles b, b + n, … in row-major order of the tile grid.

Per program, `mainloop`:
  memory warpgroup: for every step s (tile s // k_steps, K slice s % k_steps), wait until
      slot s % steps is consumed, load x's (64·wgs, tile_k) and w's (tile_k, 256) slices
      into it by TMA (one barrier a slot, two arrivals);
  compute warpgroup g: per tile, a (64, 256) f32 accumulator; per step wait for the slot,
      wgmma its 64 rows, release the previous step's slot once that wgmma is done (one
      wgmma in flight); then the epilogue on the accumulator while the memory warpgroup
      fills the slots with the next tile's first slices.
The plain epilogue (`matmul`) rounds to the input dtype, stages the tile in shared memory
and stores it by TMA; `matmul_reference` is the jnp reference. On CPU the kernels lower
for CUDA, and the Mosaic GPU interpreter (`plgpu.InterpretGPUParams`) runs this GEMM (it
has no inline_mgpu, of which the codecs' tile math is made).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from taco_jax.kernels.gemm.config import (COMPUTE_REGS, IN_DTYPES, MEMORY_REGS, ROWS,
                                          SMEM_PER_SM, SMEM_RESERVED, TILE_N, GemmConfig,
                                          buffer_bytes)
from taco_jax.kernels.mosaic import registers, taco_tiles


def operand_transforms(tile_k: int, dtype) -> tuple:
    """SMEM transforms of the wgmma operands' slots: 8-row tiles as wide as the swizzle of
    one tile_k row (jax's hopper matmul does the same)."""
    swizzle = plgpu.find_swizzle(tile_k * jnp.dtype(dtype).itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(swizzle))


def pipeline_scratch(cfg: GemmConfig, dtype) -> list:
    """The mainloop's scratch: operand slots of x and w, their "full" and "consumed"
    barriers."""
    t = operand_transforms(cfg.tile_k, dtype)
    return [plgpu.SMEM((cfg.steps, cfg.tile_m, cfg.tile_k), dtype, transforms=t),
            plgpu.SMEM((cfg.steps, cfg.tile_k, TILE_N), dtype, transforms=t),
            plgpu.Barrier(num_arrivals=2, num_barriers=cfg.steps),
            plgpu.Barrier(num_arrivals=cfg.wgs, num_barriers=cfg.steps)]


def tile_grid(m: int, n: int, cfg: GemmConfig) -> tuple[int, int]:
    """(program tiles along M, along N)."""
    return m // cfg.tile_m, n // TILE_N


def program_tiles(n_tiles: int, nprog: int, b):
    """Program b's tiles: (count, step i → tile index b + i·nprog)."""
    return (n_tiles - b + nprog - 1) // nprog, lambda i: b + i * nprog


def mainloop(x_gmem, w_gmem, a_smem, b_smem, full, consumed, *, cfg: GemmConfig, count,
             tile, n_cols: int, epilogue, after=None):
    """The warp-specialized GEMM of one program over its `count` tiles (step i → program
    tile index `tile(i)`, row-major over (M / tile_m, n_cols) tiles); x_gmem (M, K),
    w_gmem (K, N) this device's operands. Warpgroups 0 … wgs − 1 compute, wgs loads.
    epilogue(i, (tm, tn), g, acc) runs in compute warpgroup g (traced index) with tile i's
    (64, 256) f32 accumulator (WGMMA layout): rows tm·tile_m + 64·g …, columns tn·256 …;
    after(g), if given, in compute warpgroup g once its tiles are done."""
    wg = lax.axis_index("wg")
    tk, tm, slots = cfg.tile_k, cfg.tile_m, cfg.steps
    k_steps = x_gmem.shape[-1] // tk

    def where(i):
        t = tile(i)
        return t // n_cols, t % n_cols

    @pl.when(wg == cfg.wgs)
    def _memory():
        plgpu.set_max_registers(MEMORY_REGS, action="decrease")

        @pl.loop(0, count * k_steps)
        def _(s):
            slot = s % slots

            @pl.when(s >= slots)
            def _():
                plgpu.barrier_wait(consumed.at[slot])       # step s − steps is done
            row, col = where(s // k_steps)
            ks = pl.ds((s % k_steps) * tk, tk)
            plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(row * tm, tm), ks], a_smem.at[slot],
                                    full.at[slot])
            plgpu.copy_gmem_to_smem(w_gmem.at[ks, pl.ds(col * TILE_N, TILE_N)],
                                    b_smem.at[slot], full.at[slot])

        # the last slots' releases too: every phase of a barrier is observed before the
        # program ends (the interpreter checks it), and the memory warpgroup outlives none
        # of the compute
        @pl.loop(jnp.maximum(count * k_steps - slots, 0), count * k_steps)
        def _(s):
            plgpu.barrier_wait(consumed.at[s % slots])

    @pl.when(wg < cfg.wgs)
    def _compute():
        plgpu.set_max_registers(COMPUTE_REGS, action="increase")
        rows = pl.ds(wg * ROWS, ROWS)

        @pl.loop(0, count)
        def _(i):
            s0 = i * k_steps

            def run(acc):
                @pl.loop(0, k_steps)
                def _(k):
                    s = s0 + k
                    plgpu.barrier_wait(full.at[s % slots])
                    plgpu.wgmma(acc, a_smem.at[s % slots].at[rows], b_smem.at[s % slots])
                    plgpu.wgmma_wait(1)                 # step s − 1's wgmma is done

                    @pl.when(k > 0)
                    def _():
                        plgpu.barrier_arrive(consumed.at[(s - 1) % slots])
                plgpu.wgmma_wait(0)
                plgpu.barrier_arrive(consumed.at[(s0 + k_steps - 1) % slots])
                return acc[...]
            acc = pl.run_scoped(run, plgpu.ACC((ROWS, TILE_N), jnp.float32))
            epilogue(i, where(i), wg, acc)
        if after is not None:
            after(wg)


def launch(body, operands, *, out_type, scratch, cfg: GemmConfig, nprog: int,
           groups: int, name: str):
    """plgpu.kernel over groups × nprog programs of wgs + 1 warpgroups each."""
    kernel = plgpu.kernel(
        body, out_type=out_type, scratch_types=scratch, grid=(groups * nprog,),
        grid_names=("prog",), num_threads=cfg.wgs + 1, thread_name="wg", kernel_name=name,
        compiler_params=plgpu.CompilerParams(lowering_semantics=registers.LANE))
    return kernel(*operands)


def smem_bytes(cfg: GemmConfig, dtype) -> int:
    """Shared memory of one program of `matmul`: the operand slots and one (64, 256) staging
    tile per compute warpgroup, plus 1 KiB for the barriers."""
    return cfg.pipeline_bytes(dtype) + buffer_bytes([((cfg.wgs, ROWS, TILE_N), dtype)]) + 1024


# -- the plain GEMM ------------------------------------------------------------------------------
def unsupported(x_shape, w_shape, dtype, cfg: GemmConfig | None = None) -> str | None:
    """Why the GEMM kernels do not cover x (…, M, K) @ w (…, K, N) in `dtype` (None: they
    do): bf16 or f16, M a multiple of the program tile's rows (64·wgs), K of tile_k, N of
    256, the same leading dimensions on both."""
    cfg = cfg or GemmConfig()
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in IN_DTYPES]:
        return f"{jnp.dtype(dtype).name} operands (covered: bfloat16, float16)"
    if len(x_shape) < 2 or len(w_shape) != len(x_shape) or x_shape[:-2] != w_shape[:-2]:
        return f"shapes x {tuple(x_shape)}, w {tuple(w_shape)} (want (…, M, K), (…, K, N))"
    (m, k), (k2, n) = x_shape[-2:], w_shape[-2:]
    if k != k2:
        return f"x has K={k}, w has K={k2}"
    if m <= 0 or m % cfg.tile_m:
        return f"M={m} is not a positive multiple of {cfg.tile_m} (64 × wgs={cfg.wgs})"
    if k <= 0 or k % cfg.tile_k:
        return f"K={k} is not a positive multiple of tile_k={cfg.tile_k}"
    if n <= 0 or n % TILE_N:
        return f"N={n} is not a positive multiple of {TILE_N}"
    return None


def check_fits(what: str, need: int, cfg: GemmConfig):
    if need + SMEM_RESERVED > SMEM_PER_SM:
        raise ValueError(f"{what}: {cfg} needs {need // 1024} KiB of shared memory a "
                         f"program; a multiprocessor has {SMEM_PER_SM // 1024} KiB")


def default_config(m: int) -> GemmConfig:
    """Two compute warpgroups where M allows (a multiple of 128), else one."""
    return GemmConfig() if m % 128 == 0 else GemmConfig(wgs=1)


@functools.partial(jax.jit, static_argnames=("cfg",))
def matmul(x, w, cfg: GemmConfig | None = None):
    """x @ w with f32 accumulation, in x's dtype, by the warp-specialized Mosaic GPU GEMM.

    Args:
      x: (M, K) or (D, M, K) bf16 or f16; w: (K, N) or (D, K, N), the same dtype. A
        leading D runs D independent GEMMs in one launch, each on 1/D of the programs (as
        the loopback kernels run D virtual devices).
      cfg: `GemmConfig`; None: `default_config(M)`.
    Returns: (M, N) or (D, M, N) in x's dtype.
    Raises: ValueError naming what is not covered (`unsupported`) or a launch that does
      not fit shared memory."""
    cfg = cfg or default_config(x.shape[-2])
    why = unsupported(x.shape, w.shape, x.dtype, cfg) or (
        None if w.dtype == x.dtype else f"x is {x.dtype}, w is {w.dtype}")
    if why is not None:
        raise ValueError(f"gemm.matmul: {why}")
    check_fits("gemm.matmul", smem_bytes(cfg, x.dtype), cfg)
    lead = x.shape[:-2]
    groups = 1 if not lead else lead[0]
    if len(lead) > 1:
        raise ValueError(f"gemm.matmul: {x.shape=}: at most one leading dimension")
    m, n = x.shape[-2], w.shape[-1]
    tiles_m, tiles_n = tile_grid(m, n, cfg)
    nprog = cfg.grid(tiles_m * tiles_n, groups)
    dtype = x.dtype

    def body(x_gmem, w_gmem, y_gmem, a_smem, b_smem, full, consumed, o_smem):
        g = lax.axis_index("prog")
        d, b = g // nprog, g % nprog
        x_mine, w_mine, y_mine = ((x_gmem, w_gmem, y_gmem) if not lead else
                                  (x_gmem.at[d], w_gmem.at[d], y_gmem.at[d]))
        count, tile = program_tiles(tiles_m * tiles_n, nprog, b)

        def epilogue(i, at, wg, acc):
            tm, tn = at
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)     # the last tile's store
            o_smem.at[wg][...] = acc.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[wg], y_mine.at[
                pl.ds((tm * cfg.wgs + wg) * ROWS, ROWS), pl.ds(tn * TILE_N, TILE_N)])

        @pl.when(count > 0)
        def _():
            mainloop(x_mine, w_mine, a_smem, b_smem, full, consumed, cfg=cfg, count=count,
                     tile=tile, n_cols=tiles_n, epilogue=epilogue)
        plgpu.wait_smem_to_gmem(0)

    scratch = pipeline_scratch(cfg, dtype) + [
        plgpu.SMEM((cfg.wgs, ROWS, TILE_N), dtype, transforms=taco_tiles.swizzled(dtype))]
    return launch(body, (x, w), out_type=jax.ShapeDtypeStruct((*lead, m, n), dtype),
                  scratch=scratch, cfg=cfg, nprog=nprog, groups=groups, name="taco_gemm")


def matmul_reference(x, w):
    """Plain jnp: x @ w accumulated in f32 (`preferred_element_type`), rounded to x's
    dtype; any leading dimensions batch."""
    y = jnp.matmul(x, w, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)
