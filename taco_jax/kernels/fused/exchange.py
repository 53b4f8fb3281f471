"""The fused transport's exchange in one Pallas Mosaic GPU kernel (Hopper): an all-gather
or all-to-all of raw bytes by TMA stores into the peers' receive buffers (remote refs,
addressed by mesh axis name) and one semaphore handshake, for the schedules that keep
their separate compress and decode kernels (`taco_jax.collectives.fused.exchange` calls
it). Only unicast stores, never NVLink multicast."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from taco_jax.kernels.fused.peers import signal_released
from taco_jax.kernels.mosaic import registers

LINE = 256                   # bytes per row of the byte view (TMA copies ≤ 256 per dim)
TILE_ROWS = 128              # rows per TMA copy: 32 KiB of shared memory per program
TILE_BYTES = TILE_ROWS * LINE


def _exchange_body(send_ref, recv_ref, smem, bar, sem, *, axis, p, gather, tiles, nprog):
    """Program b copies tiles b, b + nprog, … (TILE_ROWS rows of LINE bytes): for each peer,
    through shared memory into the peer's receive buffer (slot `me`), this device's own
    slot last, so the stores to peers start first; then signals each peer's program b and
    waits for all P − 1 peers' program b. When every program has passed its wait, recv is
    complete."""
    me = lax.axis_index(axis)
    b = lax.axis_index("prog")
    for k in range(1, p + 1):
        dst = (me + k) % p
        src = send_ref if gather else send_ref.at[dst]
        out = recv_ref if k == p else plgpu.remote_ref(recv_ref, {axis: dst})

        @pl.loop(b, tiles, step=nprog)
        def _(i):
            rows = pl.ds(pl.multiple_of(i * TILE_ROWS, TILE_ROWS), TILE_ROWS)
            plgpu.copy_gmem_to_smem(src.at[rows], smem, bar)
            plgpu.barrier_wait(bar)
            plgpu.copy_smem_to_gmem(smem, out.at[me, rows])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # smem reusable
    plgpu.wait_smem_to_gmem(0)            # every store has landed before the signals
    signal_released([(sem, {axis: (me + k) % p}) for k in range(1, p)])
    pl.semaphore_wait(sem, p - 1)


def exchange_kernel(send, axis, p: int, gather: bool, out_mat):
    """send (m,) or (P, m) uint8, m a positive multiple of TILE_BYTES → (P, m): with
    gather, row j is device j's send; without, row j is device j's send[me]. out_mat: the
    result's `manual_axis_type` under check_vma (None without)."""
    m = send.shape[-1]
    lines = send.reshape(*send.shape[:-1], m // LINE, LINE)         # (…, rows, LINE)
    tiles = m // TILE_BYTES
    nprog = min(registers.sm_count(), tiles)
    body = functools.partial(_exchange_body, axis=axis, p=p, gather=gather, tiles=tiles,
                             nprog=nprog)
    shape = (p, m // LINE, LINE)
    out = (jax.ShapeDtypeStruct(shape, jnp.uint8) if out_mat is None else
           jax.ShapeDtypeStruct(shape, jnp.uint8, manual_axis_type=out_mat))
    kernel = plgpu.kernel(
        body, out_type=out,
        scratch_types=[plgpu.SMEM((TILE_ROWS, LINE), jnp.uint8), plgpu.Barrier(),
                       plgpu.SemaphoreType.REGULAR],
        grid=(nprog,), grid_names=("prog",), kernel_name="taco_fused_exchange")
    return kernel(lines).reshape(p, m)
