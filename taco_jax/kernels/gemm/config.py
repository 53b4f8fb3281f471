"""The GEMM kernels' launch configuration (`GemmConfig`, each field with its reason) and
their shared-memory budget."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from taco_jax.kernels.mosaic import registers

ROWS = registers.ROWS        # 64: a compute warpgroup's output rows (the wgmma M, a codec tile)
TILE_N = registers.BLOCK     # 256: output columns per tile, one codec block per tile row
IN_DTYPES = (jnp.bfloat16, jnp.float16)
SMEM_PER_SM = 228 * 1024     # Hopper: shared memory per multiprocessor …
SMEM_RESERVED = 1024         # … of which each resident program's runtime takes this
SMEM_ALIGN = 1024            # each buffer rounded up to this (what a swizzled TMA buffer needs)
MEMORY_REGS, COMPUTE_REGS = 40, 232   # setmaxnreg: a thread's registers, 2 × 232 + 40 ≤ 512


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """A launch of the GEMM kernels: one program per multiprocessor (each waits on nothing
    but its own loads, so any grid works; `programs` caps it), of `wgs` compute warpgroups
    and one memory warpgroup.

    Each compute warpgroup owns 64 output rows of a program's (64·wgs, 256) tile: its
    wgmma accumulator (64, 256) f32 is one codec tile (64 blocks of 256 values) for the
    epilogue. The memory warpgroup streams (64·wgs, tile_k) slices of x and (tile_k, 256)
    slices of w through `steps` shared-memory slots by TMA, across tile boundaries, so the
    next tile's first slices load while the compute warpgroups run the epilogue."""
    # K per pipeline step: 64 bf16 values are one 128-byte swizzled row of the wgmma
    # operands (the widest swizzle; 32 gives 64-byte rows, 128 halves the steps per tile).
    tile_k: int = 64
    # Shared-memory slots of the operand pipeline: loads in flight while the tensor cores
    # work. 3 × 48 KiB (wgs = 2, tile_k = 64) leaves room for the epilogue's staging.
    steps: int = 3
    # Compute warpgroups per program: 2 share each w slice (half the w traffic per output
    # row of 1) at 64 more registers a thread of accumulator per program.
    wgs: int = 2
    # False (cooperative): the compute warpgroups share each w slice, their tiles side by
    # side, their epilogues at the same time, the tensor cores idle meanwhile. True
    # (ping-pong, wgs = 2): each its own (64, 256) tiles and slot ring, their mainloops in
    # turn (a barrier hands the turn over once a mainloop's wgmmas are issued), so one's
    # epilogue runs beside the other's mainloop; w is loaded once per 64 rows.
    pingpong: bool = False
    programs: int | None = None

    def __post_init__(self):
        if self.tile_k not in (32, 64, 128):
            raise ValueError(f"GemmConfig.tile_k={self.tile_k} must be 32, 64 or 128")
        if not 2 <= self.steps <= 8:
            raise ValueError(f"GemmConfig.steps={self.steps} must be in 2..8")
        if self.wgs not in (1, 2):
            raise ValueError(f"GemmConfig.wgs={self.wgs} must be 1 or 2")
        if self.programs is not None and self.programs < 1:
            raise ValueError(f"GemmConfig.programs={self.programs} must be >= 1")
        if self.pingpong and self.wgs != 2:
            raise ValueError(f"GemmConfig(pingpong=True) takes wgs=2 (two warpgroups in "
                             f"turn), not wgs={self.wgs}")

    @property
    def tile_m(self) -> int:
        """Output rows per program tile (a compute warpgroup's in ping-pong)."""
        return ROWS if self.pingpong else ROWS * self.wgs

    @property
    def rings(self) -> int:
        """Slot rings: one shared, or one per compute warpgroup (ping-pong)."""
        return self.wgs if self.pingpong else 1

    def grid(self, n_tiles: int, devices_here: int = 1) -> int:
        """Programs per device: one per multiprocessor (of this device's share of the GPU
        where several virtual devices run on it), at most `programs` and the tiles."""
        cap = max(1, registers.sm_count() // devices_here)
        want = cap if self.programs is None else min(self.programs, cap)
        return max(1, min(n_tiles, want))

    def pipeline_bytes(self, dtype) -> int:
        """Shared memory of the operand slots."""
        item = jnp.dtype(dtype).itemsize
        return self.rings * self.steps * (_aligned(self.tile_m * self.tile_k * item)
                                          + _aligned(self.tile_k * TILE_N * item))


def _aligned(n: int) -> int:
    return -(-n // SMEM_ALIGN) * SMEM_ALIGN


def buffer_bytes(shapes) -> int:
    """Shared memory of (shape, dtype) buffers, each rounded up to SMEM_ALIGN."""
    total = 0
    for shape, dtype in shapes:
        n = 1
        for d in shape:
            n *= d
        total += _aligned(n * jnp.dtype(dtype).itemsize)
    return total
