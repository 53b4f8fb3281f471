"""The one-shot kernel warp-specialized (`FusedConfig.warp_specialized`; P = 2, the FP8
codecs' 16-bit input, the default there): one program per multiprocessor of four
warpgroups, two tile streams; in each, a math warpgroup encodes, stages and decodes, and a
transport warpgroup stores the staged tile to the peer, waits for it to land, signals,
waits for the peer's signal and loads the peer's tile, the two handing tiles over through
shared-memory barriers. The system-scope fence of each signal, the semaphore spin and the
peer tile's load latency leave the math's path, and the peer's tile i − 1 is loaded while
tile i is encoded. Registers move to the math (setmaxnreg: 224 a thread there, 32 in
transport)."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from taco_jax.kernels.fused.config import SMEM_PER_SM, SMEM_RESERVED
from taco_jax.kernels.fused.launch import buffer_bytes, call
from taco_jax.kernels.fused.body import BLOCK, LINE, ROWS, own_or_peer, sum_tiles
from taco_jax.kernels.fused.peers import Loopback, Remote
from taco_jax.kernels.mosaic import registers


WS_MATH_REGS, WS_TRANSPORT_REGS = 224, 32   # a thread's registers: 2 × 224 + 2 × 32 = 4 × 128


def ws_unsupported(p: int, tiles, in_dtype) -> str | None:
    """Why FusedConfig(warp_specialized=True) does not cover this call (None: it does)."""
    if p != 2:
        return f"P={p} (it covers P = 2: this device's tile from its staging)"
    if "warp_specialized" not in tiles.options:
        return f"{tiles.codec.name} (it is built and measured for the FP8 codecs' tile math)"
    if jnp.dtype(in_dtype).itemsize != 2:
        return f"{jnp.dtype(in_dtype).name} input (it covers 16-bit input)"
    return None


def _ws_scratch(tiles, in_dtype, remote: bool):
    """`_ws_body`'s scratch (the same conventions as the one-shot body's): per stream one input slot
    and three wire slots (two staging, one for the peer's tile)."""
    lines = ROWS * tiles.row_bytes // LINE
    return [
        plgpu.SMEM((2, ROWS, BLOCK), in_dtype, transforms=tiles.x_transforms(in_dtype)),
        plgpu.SMEM((2, 3, lines, LINE), jnp.uint8),
        tuple(plgpu.SMEM(a.shape, a.dtype, transforms=t) for a, t in tiles.operands(in_dtype)),
        plgpu.Barrier(num_barriers=2),                       # x tile landed, per stream
        plgpu.Barrier(num_barriers=2),                       # the operands landed
        plgpu.Barrier(num_barriers=4),                       # staged [stream, slot]
        plgpu.Barrier(num_barriers=4),                       # staging read by its store
        plgpu.Barrier(num_barriers=2),                       # peer's tile landed
        plgpu.Barrier(num_barriers=2),                       # peer's slot decoded
        (plgpu.SemaphoreType.REGULAR((2 * 2,)) if remote else None),
    ]


def _ws_body(x_gmem, c_gmem, y_gmem, recv_gmem, x_smem, w_smem, c_smem, x_bar, h_bar, staged,
             freed, peer_full, peer_free, sem_scratch, *, peers, tiles, n_tiles, out_dtype,
             cfg):
    """Warpgroups 0, 1: the math of streams 0, 1; 2, 3: their transport. Stream c of program
    b takes tiles v, v + 2n, … (v = 2b + c, n programs a device); its peer is stream c of
    program b on the other device (semaphores (stream, sender)).

    math, step i:  wait x tile i; encode; load x tile i + 1 | wait until staging slot i % 2
                   is read (tile i − 2's store) | stage tile i; `staged` | wait for the
                   peer's tile i − 1; decode it and this device's (from its staging); store
                   the result; `peer_free`.
    transport, step i: for tile i − 1: wait until its store has landed; `freed` its staging;
                   signal the peer, wait for the peer's signal; wait `peer_free`; load the
                   peer's tile i − 1 (`peer_full`) | wait `staged` tile i; store it into the
                   peer's receive slot.
    The peer's tile i − 1 is loaded while tile i is encoded."""
    p, nprog, parts = peers.p, peers.nprog, cfg.parts
    me, b = peers.ids()
    wg = lax.axis_index("wg")
    sems = peers.semaphores(sem_scratch, me, b)
    x_mine, y_mine = peers.local(x_gmem, me), peers.local(y_gmem, me)
    recv_mine = peers.local(recv_gmem, me)
    row = tiles.row_bytes
    lines = ROWS * row // LINE
    vec = registers.value_vec(out_dtype)
    peer = 1 - me

    def stream(c):
        v = 2 * b + c
        count = (n_tiles - v + 2 * nprog - 1) // (2 * nprog)
        return count, (lambda i: v + i * 2 * nprog), w_smem.at[c]

    @pl.when(wg < 2)
    def _math():
        plgpu.set_max_registers(WS_MATH_REGS, action="increase")
        c = wg
        count, tile, ws = stream(c)
        xs = x_smem.at[c]

        @pl.when(wg == 0)
        def _():
            for k, (src, dst) in enumerate(zip(c_gmem, c_smem)):
                plgpu.copy_gmem_to_smem(src, dst, h_bar.at[k])
        for k in range(len(c_smem)):
            plgpu.barrier_wait(h_bar.at[k])

        def load_x(i):
            plgpu.copy_gmem_to_smem(x_mine.at[pl.ds(tile(i) * ROWS, ROWS)], xs, x_bar.at[c])

        def decode(i):
            out = y_mine.at[pl.ds(tile(i) * ROWS, ROWS)]

            where = own_or_peer(me, i, peer_full.at[c])

            def emit(part, value):
                registers.store_part(out, part, parts, value.astype(out_dtype))
            if cfg.store_parts:
                sum_tiles(None, ws, None, tiles, c_smem, p, vec, parts, emit=emit,
                           sources=where)
            else:
                totals = sum_tiles(None, ws, None, tiles, c_smem, p, vec, parts,
                                    sources=where)
                registers.store_values(out, [t.astype(out_dtype) for t in totals])
            # every warp has read the peer's slot (and this staging slot) before either is
            # rewritten: the transport's next load, step i + 2's staging
            plgpu.commit_smem()
            plgpu.barrier_arrive(peer_free.at[c])

        @pl.when(count > 0)
        def _():
            load_x(0)

            @pl.loop(0, count)
            def _(i):
                plgpu.barrier_wait(x_bar.at[c])
                wire = tiles.encode(xs, c_smem)

                @pl.when(i + 1 < count)
                def _():
                    load_x(i + 1)                       # the transform has read the tile

                @pl.when(i >= 2)
                def _():
                    plgpu.barrier_wait(freed.at[2 * c + i % 2])
                tiles.store(ws.at[i % 2].reshape(ROWS, row), wire)
                plgpu.commit_smem()
                plgpu.barrier_arrive(staged.at[2 * c + i % 2])

                @pl.when(i > 0)
                def _():
                    decode(i - 1)
            decode(count - 1)

    @pl.when(wg >= 2)
    def _transport():
        plgpu.set_max_registers(WS_TRANSPORT_REGS, action="decrease")
        c = wg - 2
        count, tile, ws = stream(c)

        def push(i):
            plgpu.barrier_wait(staged.at[2 * c + i % 2])
            rows = pl.ds(tile(i) * lines, lines)
            plgpu.copy_smem_to_gmem(ws.at[i % 2],
                                    peers.peer(recv_gmem, me, peer).at[me, rows])

        def pull(i):
            plgpu.wait_smem_to_gmem(0)                  # tile i's store has landed
            plgpu.barrier_arrive(freed.at[2 * c + i % 2])
            peers.signal(sems, me, b, [peer], phase=c)
            peers.wait(sems, me, b, peer, phase=c)

            @pl.when(i > 0)
            def _():
                plgpu.barrier_wait(peer_free.at[c])     # tile i − 1's decode read the slot
            plgpu.copy_gmem_to_smem(recv_mine.at[peer, pl.ds(tile(i) * lines, lines)],
                                    ws.at[2], peer_full.at[c])

        @pl.when(count > 0)
        def _():
            @pl.loop(0, count)
            def _(i):
                @pl.when(i > 0)
                def _():
                    pull(i - 1)
                push(i)
            pull(count - 1)


def launch_ws(blocks, tiles, out_dtype, peers, cfg, mat=None):
    """The one-shot launch for FusedConfig(warp_specialized=True): one program per multiprocessor
    (per device here), four warpgroups, two tile streams."""
    p = peers.p
    in_dtype = blocks.dtype
    why = ws_unsupported(p, tiles, in_dtype)
    if why is not None:
        raise ValueError(f"FusedConfig(warp_specialized=True): {why}")
    n_tiles = blocks.shape[-2] // ROWS
    remote = isinstance(peers, Remote)
    nprog = max(1, min(-(-n_tiles // 2), registers.sm_count() // peers.devices_here))
    if cfg.programs is not None:
        nprog = min(nprog, cfg.programs)
    peers = (dataclasses.replace(peers, nprog=nprog) if remote else
             Loopback(p, nprog, phases=2))
    scratch = _ws_scratch(tiles, in_dtype, remote)
    need = (buffer_bytes(_ws_scratch(tiles, in_dtype, False))
            + 2048 + SMEM_RESERVED)                             # + barriers, + the runtime's
    if need > SMEM_PER_SM:
        raise ValueError(f"FusedConfig(warp_specialized=True): {need // 1024} KiB of shared "
                         f"memory per program; a multiprocessor has {SMEM_PER_SM // 1024}")
    return call(_ws_body, blocks, tiles, out_dtype, peers, cfg, scratch, mat, num_threads=4,
                 thread_name="wg")
