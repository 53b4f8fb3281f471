"""A bf16 GEMM as a Pallas Mosaic GPU kernel (Hopper: TMA, wgmma), and the pipeline it
shares with the GEMM whose epilogue encodes (`encode_epilogue`).

    y = x @ w,  x (M, K), w (K, N) bf16 or f16, accumulated in f32, y in x's dtype.

Modelled on jax's `pallas/ops/gpu/hopper_matmul_mgpu.py` (warp-specialized, one memory
warpgroup feeding compute warpgroups through shared-memory slots), written for Lane
lowering semantics, where the codecs' register tile math runs (`mosaic.taco_tiles`,
`mosaic.echo4`). Its tiles have the codecs' shape: a compute warpgroup accumulates 64 rows
× 256 columns, one block of 256 values per tile row, so an epilogue hands its accumulator
to a tile codec unchanged. Program tiles are (64·wgs, 256), or (64, 256) in ping-pong
(`GemmConfig`); each program takes tiles b, b + n, … in row-major order of the tile grid.

Per program, `mainloop`:
  memory warpgroup: for every step s (tile s // k_steps, K slice s % k_steps), wait until
      slot s % steps is consumed, load x's (64·wgs, tile_k) and w's (tile_k, 256) slices
      into it by TMA (one barrier a slot, two arrivals);
  compute warpgroup g: per tile, a (64, 256) f32 accumulator; per step wait for the slot,
      wgmma its 64 rows, release the previous step's slot once that wgmma is done (one
      wgmma in flight); then the epilogue on the accumulator while the memory warpgroup
      fills the slots with the next tile's first slices (ping-pong: while the other
      compute warpgroup runs its mainloop).
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
from taco_jax.kernels.mosaic import registers


def operand_transforms(tile_k: int, dtype) -> tuple:
    """SMEM transforms of the wgmma operands' slots: 8-row tiles as wide as the swizzle of
    one tile_k row (jax's hopper matmul does the same)."""
    swizzle = plgpu.find_swizzle(tile_k * jnp.dtype(dtype).itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(swizzle))


def pipeline_scratch(cfg: GemmConfig, dtype) -> list:
    """The mainloop's scratch: operand slots of x and w (per ring), their "full" and
    "consumed" barriers, the ping-pong's turn barriers (one per compute warpgroup)."""
    t = operand_transforms(cfg.tile_k, dtype)
    slots = cfg.rings * cfg.steps
    return [plgpu.SMEM((cfg.rings, cfg.steps, cfg.tile_m, cfg.tile_k), dtype, transforms=t),
            plgpu.SMEM((cfg.rings, cfg.steps, cfg.tile_k, TILE_N), dtype, transforms=t),
            plgpu.Barrier(num_arrivals=2, num_barriers=slots),
            plgpu.Barrier(num_arrivals=1 if cfg.pingpong else cfg.wgs, num_barriers=slots),
            plgpu.Barrier(num_barriers=cfg.wgs)]


def tile_grid(m: int, n: int, cfg: GemmConfig) -> tuple[int, int]:
    """(program tiles along M, along N)."""
    return m // cfg.tile_m, n // TILE_N


def program_tiles(n_tiles: int, nprog: int, b):
    """Program b's tiles: (count, step i → tile index b + i·nprog)."""
    return (n_tiles - b + nprog - 1) // nprog, lambda i: b + i * nprog


def mainloop(x_gmem, w_gmem, a_smem, b_smem, full, consumed, turn, *, cfg: GemmConfig,
             count, tile, n_cols: int, epilogue, after=None, before=None, load_a=None,
             k_steps: int | None = None):
    """The warp-specialized GEMM of one program over its `count` tiles (step i → program
    tile index `tile(i)`, row-major over (M / tile_m, n_cols) tiles); x_gmem (M, K),
    w_gmem (K, N) this device's operands. Warpgroups 0 … wgs − 1 compute, wgs loads.
    epilogue(i, (r, tn), g, acc) runs in compute warpgroup g (traced index) with its (64,
    256) f32 accumulator (WGMMA layout) of output rows 64r …, columns 256·tn …; after(g),
    if given, in compute warpgroup g once its tiles are done; before(g) before its first.

    load_a (the producer hook; None: the memory warpgroup copies x's slices by TMA) fills
    the x slots in a warpgroup of its own, wgs + 1 (launch `wgs + 2` warpgroups), at the
    compute warpgroups' registers: a producer that computes its operand (decodes it) needs
    more than the memory warpgroup's 40. For every step s it is called, once the slot is
    free, as load_a(s, (row tile, column tile), k, slot_ref, full_barrier), k the step's K
    slice; it must arrive on full_barrier once slot_ref (tile_m, tile_k) holds the
    slice (plgpu.commit_smem() first: the wgmma reads through the async proxy). x_gmem is
    then unused, and k_steps (K / tile_k) must be given.

    Cooperative: every step's slot holds (64·wgs, tile_k) of x, each warpgroup its 64 rows.
    Ping-pong: tile i is warpgroup i % 2's, its steps in that warpgroup's ring (local step
    u = (i // 2)·k_steps + k); the memory warpgroup loads in tile order, which is the order
    the turns take, so no ring waits on the other."""
    wg = lax.axis_index("wg")
    tk, tm, slots, wgs = cfg.tile_k, cfg.tile_m, cfg.steps, cfg.wgs
    k_steps = x_gmem.shape[-1] // tk if k_steps is None else k_steps

    def where(i):
        t = tile(i)
        return t // n_cols, t % n_cols

    def ring_step(s):
        """Global step s → (ring, local step in it)."""
        if not cfg.pingpong:
            return 0, s
        i = s // k_steps
        return i % wgs, (i // wgs) * k_steps + s % k_steps

    def ring_tiles(r):
        return (count - r + wgs - 1) // wgs if cfg.pingpong else count

    def slot_of(r, u):
        return r * slots + u % slots               # the barrier index of a ring's slot

    def producer_loop(load):
        """load(s, r, u, (row, col), k) for every step s once its slot is free, then the
        last slots' releases: every phase of a barrier is observed before the program
        ends (the interpreter checks it), and no producer outlives the compute."""
        @pl.loop(0, count * k_steps)
        def _(s):
            r, u = ring_step(s)

            @pl.when(u >= slots)
            def _():
                plgpu.barrier_wait(consumed.at[slot_of(r, u)])   # its step u − steps is done
            load(s, r, u, where(s // k_steps), s % k_steps)

        for r in range(cfg.rings):
            steps = ring_tiles(r) * k_steps

            @pl.loop(jnp.maximum(steps - slots, 0), steps)
            def _(u):
                plgpu.barrier_wait(consumed.at[slot_of(r, u)])

    @pl.when(wg == wgs)
    def _memory():
        plgpu.set_max_registers(MEMORY_REGS, action="decrease")

        def copy(s, r, u, at, k):
            row, col = at
            ks = pl.ds(k * tk, tk)
            if load_a is None:
                plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(row * tm, tm), ks],
                                        a_smem.at[r, u % slots], full.at[slot_of(r, u)])
            plgpu.copy_gmem_to_smem(w_gmem.at[ks, pl.ds(col * TILE_N, TILE_N)],
                                    b_smem.at[r, u % slots], full.at[slot_of(r, u)])
        producer_loop(copy)

    if load_a is not None:
        @pl.when(wg == wgs + 1)
        def _producer():
            plgpu.set_max_registers(COMPUTE_REGS, action="increase")
            producer_loop(lambda s, r, u, at, k: load_a(s, at, k, a_smem.at[r, u % slots],
                                                        full.at[slot_of(r, u)]))

    @pl.when(wg < wgs)
    def _compute():
        plgpu.set_max_registers(COMPUTE_REGS, action="increase")
        r = wg if cfg.pingpong else 0
        rows = pl.ds(0, ROWS) if cfg.pingpong else pl.ds(wg * ROWS, ROWS)
        if before is not None:
            before(wg)

        @pl.loop(wg if cfg.pingpong else 0, count, step=wgs if cfg.pingpong else 1)
        def _(i):
            u0 = (i // wgs if cfg.pingpong else i) * k_steps
            if cfg.pingpong:
                @pl.when(i > 0)
                def _():
                    plgpu.barrier_wait(turn.at[wg])      # the other's mainloop is issued

            def run(acc):
                @pl.loop(0, k_steps)
                def _(k):
                    u = u0 + k
                    plgpu.barrier_wait(full.at[slot_of(r, u)])
                    plgpu.wgmma(acc, a_smem.at[r, u % slots].at[rows],
                                b_smem.at[r, u % slots])
                    plgpu.wgmma_wait(1)                 # step u − 1's wgmma is done

                    @pl.when(k > 0)
                    def _():
                        plgpu.barrier_arrive(consumed.at[slot_of(r, u - 1)])
                if cfg.pingpong:
                    @pl.when(i + 1 < count)
                    def _():
                        plgpu.barrier_arrive(turn.at[(wg + 1) % wgs])
                plgpu.wgmma_wait(0)
                plgpu.barrier_arrive(consumed.at[slot_of(r, u0 + k_steps - 1)])
                return acc[...]
            acc = pl.run_scoped(run, plgpu.ACC((ROWS, TILE_N), jnp.float32))
            tm_, tn = where(i)
            epilogue(i, (tm_ if cfg.pingpong else tm_ * wgs + wg, tn), wg, acc)
        if after is not None:
            after(wg)


def launch(body, operands, *, out_type, scratch, cfg: GemmConfig, nprog: int,
           groups: int, name: str, producer: bool = False):
    """plgpu.kernel over groups × nprog programs of wgs + 1 warpgroups each (wgs + 2 with
    a producer warpgroup: `mainloop`'s load_a)."""
    kernel = plgpu.kernel(
        body, out_type=out_type, scratch_types=scratch, grid=(groups * nprog,),
        grid_names=("prog",), num_threads=cfg.wgs + 1 + int(producer), thread_name="wg",
        kernel_name=name,
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

    def body(x_gmem, w_gmem, y_gmem, a_smem, b_smem, full, consumed, turn, o_smem):
        g = lax.axis_index("prog")
        d, b = g // nprog, g % nprog
        x_mine, w_mine, y_mine = ((x_gmem, w_gmem, y_gmem) if not lead else
                                  (x_gmem.at[d], w_gmem.at[d], y_gmem.at[d]))
        count, tile = program_tiles(tiles_m * tiles_n, nprog, b)

        def epilogue(i, at, wg, acc):
            r, tn = at
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)     # the last tile's store
            o_smem.at[wg][...] = acc.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[wg], y_mine.at[
                pl.ds(r * ROWS, ROWS), pl.ds(tn * TILE_N, TILE_N)])

        @pl.when(count > 0)
        def _():
            mainloop(x_mine, w_mine, a_smem, b_smem, full, consumed, turn, cfg=cfg,
                     count=count, tile=tile, n_cols=tiles_n, epilogue=epilogue)
        plgpu.wait_smem_to_gmem(0)

    scratch = pipeline_scratch(cfg, dtype) + [
        plgpu.SMEM((cfg.wgs, ROWS, TILE_N), dtype, transforms=registers.swizzled(dtype))]
    return launch(body, (x, w), out_type=jax.ShapeDtypeStruct((*lead, m, n), dtype),
                  scratch=scratch, cfg=cfg, nprog=nprog, groups=groups, name="taco_gemm")


def matmul_reference(x, w):
    """Plain jnp: x @ w accumulated in f32 (`preferred_element_type`), rounded to x's
    dtype; any leading dimensions batch."""
    y = jnp.matmul(x, w, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)
