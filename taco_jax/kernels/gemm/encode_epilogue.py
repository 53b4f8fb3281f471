"""A GEMM whose epilogue encodes (Pallas Mosaic GPU, Hopper): the row-parallel GEMM of
tensor parallelism that sends its partial compressed, so the partial never reaches HBM in
bf16 and compress never reads it back.

    wire = encode(round(x @ w)),  x (M, K), w (K, N) bf16 or f16, accumulated in f32,
    rounded to x's dtype (the partial the separate path would write) and encoded by the
    codec's tile codec (`kernels.tile_codec`: taco's transform and scales, echo4's groups).

The GEMM is `pipeline`'s warp-specialized one. Each compute warpgroup's accumulator is
64 rows × 256 columns of the output: 64 of the codec's blocks (a block is 256 consecutive
values of an output row, so N % 256 == 0), one codec tile. Its epilogue rounds it into a
shared-memory tile (the tile codec's input transforms), encodes it, stages the 64 wire rows
in the same shared memory and stores them by TMA, as whole 256-byte lines, into every
device's receive buffer (`fused.peers`: `Remote` peers over a mesh axis, or `Loopback`, P
virtual devices as P groups of programs of one launch), this device's own slot last, or
(exchange "owner") into the receive buffer of the device that owns the tile's rows only:
the reduce-scatter of sequence parallelism, one wire write per tile instead of P.
When a compute warpgroup's stores have all landed it signals the same warpgroup of the
same program on every peer and waits for theirs: once a device's kernel ends, its receive
buffer holds every device's wire.

Wire layout: tile-major. Codec tile t = i · (N / 256) + j covers output rows 64i … 64i + 63,
columns 256j … 256j + 255; its 64 wire rows (row r: block (64i + r, j)) are rows 64t …
64t + 63 of the wire, the codec's own rows for those blocks byte for byte, so any decoder
of the codec's rows reads them; `tile_blocks` orders a (M, N) array's blocks so,
`untile_blocks` back, `tile_order` gives the permutation. (A row-major block order would
put a tile's rows N/256 rows apart, 264 bytes each: not a TMA stride.)

`gemm_encode` (one device, no exchange), `loopback_gemm_encode`, `gemm_encode_exchange`
(inside `jax.shard_map`); `gemm_encode_reference` the jnp reference; `unsupported` says
why a call is not covered. The library selects these kernels (`row_parallel`, through
`collectives.gemm_fused`) only where their GPU checks passed (`kernels.fused.checked`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from taco_jax import _jax_private
from taco_jax.kernels import tile_codec as tile_codec_lib
from taco_jax.kernels.fused.peers import Loopback, Remote
from taco_jax.kernels.gemm import pipeline
from taco_jax.kernels.gemm.config import (ROWS, TILE_N, GemmConfig, buffer_bytes)

LINE = 256                   # bytes per TMA line of a wire tile
MAX_P = 8
# Where a tile's wire goes: "all", every device's receive buffer (the one-shot all-reduce:
# each device decodes all P wires of every tile); "owner", the device that owns the tile's
# rows (M split into P contiguous ranges: the reduce-scatter of sequence parallelism, a
# device writing its wire once instead of P times).
EXCHANGES = ("all", "owner")
STAGE_LINES = ROWS * TILE_N * 2 // LINE   # a (64, 256) 16-bit tile: 128 lines of staging


# -- the codec's tile math: the one place that asks for it ------------------------------------
def tile_codec(codec):
    """The codec's tile codec (`kernels.tile_codec.TileCodec`: row_bytes, x_transforms,
    operands, encode, store, load, decode_add, finish), with its default options."""
    return tile_codec_lib.for_codec(codec)


def tile_unsupported(codec, dtype) -> str | None:
    """Why the codec has no tile math for `dtype` input (None: it has)."""
    return tile_codec_lib.unsupported(codec, dtype)


# -- block order ------------------------------------------------------------------------------
def tile_order(m: int, n: int) -> np.ndarray:
    """Row-major block indices (block (r, c) = r·(N/256) + c) in the wire's tile-major
    order: wire row k holds block tile_order(m, n)[k]."""
    nb = n // TILE_N
    return np.arange(m * nb).reshape(m // ROWS, ROWS, nb).transpose(0, 2, 1).reshape(-1)


def tile_blocks(y):
    """(…, M, N) → (…, M·N/256, 256): the output's blocks in the wire's tile-major order
    (M % 64 == 0, N % 256 == 0)."""
    *lead, m, n = y.shape
    t = y.reshape(*lead, m // ROWS, ROWS, n // TILE_N, TILE_N)
    return jnp.swapaxes(t, -3, -2).reshape(*lead, m * n // TILE_N, TILE_N)


def untile_blocks(blocks, m: int, n: int):
    """tile_blocks' inverse: (…, M·N/256, 256) → (…, M, N)."""
    lead = blocks.shape[:-2]
    t = blocks.reshape(*lead, m // ROWS, n // TILE_N, ROWS, TILE_N)
    return jnp.swapaxes(t, -3, -2).reshape(*lead, m, n)


# -- what is covered --------------------------------------------------------------------------
def unsupported(codec, p: int, x_shape, w_shape, dtype, cfg: GemmConfig | None = None,
                exchange: str = "all") -> str | None:
    """Why the GEMM with the encode epilogue does not cover this call (None: it does):
    `pipeline.unsupported`'s shapes and dtypes (M a multiple of 64·wgs, K of tile_k, N of
    256; bf16 or f16), P = 1..8 devices, a codec with tile math for the dtype (the
    Hadamard FP8 codecs with B = 256, echo4); exchange "owner" needs M / 64 divisible by P
    (each owner's rows whole tiles)."""
    if not 1 <= p <= MAX_P:
        return f"P={p} devices (covered: 1..{MAX_P})"
    if exchange not in EXCHANGES:
        return f"exchange={exchange!r} (covered: {', '.join(EXCHANGES)})"
    why = (pipeline.unsupported(x_shape, w_shape, dtype, cfg or default_config(x_shape[-2]))
           or tile_unsupported(codec, dtype))
    if why is None and exchange == "owner" and (x_shape[-2] // ROWS) % p:
        why = (f"M={x_shape[-2]} in P={p} owners' rows: M / {ROWS} must be divisible by P "
               f"(whole tiles each)")
    return why


def default_config(m: int) -> GemmConfig:
    return pipeline.default_config(m)


def smem_bytes(codec, dtype, cfg: GemmConfig) -> int:
    """Shared memory of one program: the operand slots, per compute warpgroup one 32 KiB
    staging tile (its rounded output, then its wire rows), the tile codec's operands, and
    1 KiB for the barriers."""
    ops = [(a.shape, a.dtype) for a, _ in tile_codec(codec).operands(dtype)]
    return (cfg.pipeline_bytes(dtype) + buffer_bytes([((cfg.wgs, ROWS, TILE_N), dtype)])
            + buffer_bytes(ops) + 1024)


# -- the kernel --------------------------------------------------------------------------------
def _scratch(tiles, dtype, cfg: GemmConfig, p: int, remote: bool) -> list:
    """The pipeline's scratch, then the staging (a union: per compute warpgroup its (64,
    256) rounded output, later its wire rows in the same 32 KiB), the codec's operands,
    their barrier, the Remote semaphores (one per (warpgroup, sender))."""
    staging = plgpu.RefUnion(
        plgpu.SMEM((cfg.wgs, ROWS, TILE_N), dtype, transforms=tiles.x_transforms(dtype)),
        plgpu.SMEM((cfg.wgs, STAGE_LINES, LINE), jnp.uint8))
    consts = [plgpu.SMEM(a.shape, a.dtype, transforms=t) for a, t in tiles.operands(dtype)]
    return (pipeline.pipeline_scratch(cfg, dtype) + [staging] + consts
            + [plgpu.Barrier(num_barriers=max(len(consts), 1))]
            + ([plgpu.SemaphoreType.REGULAR((cfg.wgs * p,))] if remote else []))


def _body(peers, tiles, cfg: GemmConfig, n_ops: int, remote: bool, tiles_m: int,
          tiles_n: int, dtype, exchange: str):
    """The kernel body for plgpu.kernel: (x, w, *operands, recv, *scratch)."""
    p, nprog = peers.p, peers.nprog
    owned_rows = tiles_m * cfg.tile_m // ROWS // p   # "owner": 64-row tiles an owner has
    row = tiles.row_bytes
    lines = ROWS * row // LINE

    def body(x_gmem, w_gmem, *refs):
        consts_gmem, (recv_gmem,), refs = refs[:n_ops], refs[n_ops:n_ops + 1], refs[n_ops + 1:]
        a_smem, b_smem, full, consumed, turn, staging = refs[:6]
        consts, c_bar = refs[6:6 + n_ops], refs[6 + n_ops]
        sem_scratch = refs[7 + n_ops] if remote else None
        xs_smem, ws_smem = staging
        me, b = peers.ids()
        wg = lax.axis_index("wg")
        x_mine, w_mine = peers.local(x_gmem, me), peers.local(w_gmem, me)
        recv_mine = peers.local(recv_gmem, me)
        sems = peers.semaphores(sem_scratch, me, b) if p > 1 else None
        count, tile = pipeline.program_tiles(tiles_m * tiles_n, nprog, b)

        @pl.when(wg == 0)
        def _():
            for k, (src, dst) in enumerate(zip(consts_gmem, consts)):
                plgpu.copy_gmem_to_smem(src, dst, c_bar.at[k])

        def send(stage, r, tn):
            """The staged wire of codec tile (row tile r, column tile tn) → its
            destinations' receive buffers, slot me."""
            if exchange == "all":
                rows = pl.ds((r * tiles_n + tn) * lines, lines)
                for k in range(1, p + 1):              # peers first, this device's slot last
                    dst = recv_mine if k == p else peers.peer(recv_gmem, me, (me + k) % p)
                    plgpu.copy_smem_to_gmem(stage, dst.at[me, rows])
                return
            owner = r // owned_rows
            rows = pl.ds(((r - owner * owned_rows) * tiles_n + tn) * lines, lines)

            @pl.when(owner == me)
            def _():
                plgpu.copy_smem_to_gmem(stage, recv_mine.at[me, rows])
            if p > 1:
                @pl.when(owner != me)
                def _():
                    plgpu.copy_smem_to_gmem(stage, peers.peer(recv_gmem, me, owner).at[
                        me, rows])

        def epilogue(i, at, g, acc):
            r, tn = at                              # the codec tile: 64-row tile r, column tn
            xs, ws = xs_smem.at[g], ws_smem.at[g]
            # the staging was last read by the previous tile's wire stores
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            # an untiled tile (echo4's, read back by plain loads) takes plain stores of
            # the WGMMA layout, which jax 0.12's transfer planning would refuse
            _jax_private.mgpu_store(xs, acc.astype(dtype),
                                    tiled=bool(tiles.x_transforms(dtype)))
            plgpu.commit_smem()
            wire = tiles.encode(xs, consts)
            plgpu.commit_smem()             # every warp is past its reads of xs, which ws overlays
            stage = ws.at[pl.ds(0, lines)]
            tiles.store(wire_view(stage, row), wire)
            plgpu.commit_smem()
            send(stage, r, tn)

        def handshake(g):
            """Compute warpgroup g's stores have landed: tell the peers' warpgroup g of
            program b, then wait for each of theirs (their stores into this device)."""
            plgpu.wait_smem_to_gmem(0)
            if p > 1:
                others = [(me + k) % p for k in range(1, p)]
                peers.signal(sems, me, b, others, phase=g)
                for src in others:
                    peers.wait(sems, me, b, src, phase=g)

        @pl.when(wg < cfg.wgs)
        def _():
            for k in range(n_ops):
                plgpu.barrier_wait(c_bar.at[k])

        pipeline.mainloop(x_mine, w_mine, a_smem, b_smem, full, consumed, turn, cfg=cfg,
                          count=count, tile=tile, n_cols=tiles_n, epilogue=epilogue,
                          after=handshake)
    return body


def _launch(x, w, tiles, peers, cfg: GemmConfig, exchange: str = "all", mat=None):
    """x (…, M, K), w (…, K, N), a leading P in loopback → the receive buffers: (…, P,
    tiles·lines, 256), slot j device j's wire (exchange "all": of every tile; "owner": of
    this device's rows' tiles)."""
    dtype = x.dtype
    m, n = x.shape[-2], w.shape[-1]
    tiles_m, tiles_n = pipeline.tile_grid(m, n, cfg)
    n_tiles = (m // ROWS) * (n // TILE_N) // (peers.p if exchange == "owner" else 1)
    lines = ROWS * tiles.row_bytes // LINE
    remote = isinstance(peers, Remote)
    lead = () if remote else (peers.p,)
    shape = (*lead, peers.p, n_tiles * lines, LINE)
    out = (jax.ShapeDtypeStruct(shape, jnp.uint8) if mat is None else
           jax.ShapeDtypeStruct(shape, jnp.uint8, manual_axis_type=mat))
    operands = [a for a, _ in tiles.operands(dtype)]
    body = _body(peers, tiles, cfg, len(operands), remote, tiles_m, tiles_n, dtype,
                 exchange)
    return pipeline.launch(body, (x, w, *operands), out_type=out,
                           scratch=_scratch(tiles, dtype, cfg, peers.p, remote), cfg=cfg,
                           nprog=peers.nprog, groups=1 if remote else peers.p,
                           name="taco_gemm_encode")


def wire_view(lines_ref, row_bytes: int):
    """A (64·row_bytes/256, 256) ref of TMA lines → the (64, row_bytes) view of its 64 wire
    rows that the tile codec reads and writes (the ref itself where that is its shape)."""
    if tuple(lines_ref.shape) == (ROWS, row_bytes):
        return lines_ref
    return lines_ref.reshape(ROWS, row_bytes)


def _check(where, codec, p, x, w, cfg, exchange="all"):
    why = unsupported(codec, p, x.shape, w.shape, x.dtype, cfg, exchange) or (
        None if w.dtype == x.dtype else f"x is {x.dtype}, w is {w.dtype}")
    if why is not None:
        raise ValueError(f"{where}: {why}")
    pipeline.check_fits(where, smem_bytes(codec, x.dtype, cfg), cfg)


def _wire_rows(recv, row_bytes: int):
    """(…, n_tiles·lines, 256) lines → (…, n_rows, row_bytes) wire rows (the same bytes)."""
    return recv.reshape(*recv.shape[:-2], -1, row_bytes)


@functools.partial(jax.jit, static_argnames=("codec", "cfg"))
def gemm_encode(x, w, codec, cfg: GemmConfig | None = None):
    """encode(round(x @ w)) on one device: the GEMM's output leaves as the codec's wire.

    Args:
      x: (M, K) bf16 or f16; w: (K, N) of x's dtype; M % (64·wgs) == 0, K % tile_k == 0,
        N % 256 == 0.
      codec: a codec with tile math for x's dtype (`unsupported`).
      cfg: `GemmConfig`; None: `default_config(M)`.
    Returns: (M·N/256, row_bytes) uint8, the wire in tile-major block order (the codec's
      compress of `tile_blocks(round(x @ w))`, up to its rounding).
    Raises: ValueError naming what is not covered."""
    cfg = cfg or default_config(x.shape[-2])
    _check("gemm_encode", codec, 1, x, w, cfg)
    tiles = tile_codec(codec)
    tiles_m, tiles_n = pipeline.tile_grid(x.shape[-2], w.shape[-1], cfg)
    peers = Loopback(1, cfg.grid(tiles_m * tiles_n), phases=cfg.wgs)
    recv = _launch(x[None], w[None], tiles, peers, cfg)
    return _wire_rows(recv[0, 0], tiles.row_bytes)


@functools.partial(jax.jit, static_argnames=("codec", "cfg", "exchange"))
def loopback_gemm_encode(xs, ws, codec, cfg: GemmConfig | None = None,
                         exchange: str = "all"):
    """The exchange kernel on one GPU for P = xs.shape[0] virtual devices: device d
    computes xs[d] @ ws[d], encodes it and stores each tile's wire into its destinations'
    receive buffers.

    Args:
      xs: (P, M, K); ws: (P, K, N), as `gemm_encode`'s x and w per device.
      exchange: "all" (every device gets every tile) or "owner" (device o gets the tiles
        of rows [o·M/P, (o+1)·M/P)).
    Returns: (P, P, rows, row_bytes) uint8: [d, j] device j's wire as device d received it;
      "all": rows = M·N/256, the same for every d when the exchange is right; "owner":
      rows = M·N/(256·P), device j's wire of d's rows (tile-major over them).
    Raises: ValueError as `gemm_encode`."""
    p = xs.shape[0]
    cfg = cfg or default_config(xs.shape[-2])
    _check("loopback_gemm_encode", codec, p, xs[0], ws[0], cfg, exchange)
    tiles = tile_codec(codec)
    tiles_m, tiles_n = pipeline.tile_grid(xs.shape[-2], ws.shape[-1], cfg)
    peers = Loopback(p, cfg.grid(tiles_m * tiles_n, p), phases=cfg.wgs)
    return _wire_rows(_launch(xs, ws, tiles, peers, cfg, exchange), tiles.row_bytes)


def gemm_encode_exchange(x, w, axis: str, p: int, codec, *, exchange: str = "all",
                         out_mat=None, cfg: GemmConfig | None = None):
    """Inside `jax.shard_map` over GPUs of one process (mesh devices 0..n−1 in order):
    this device's encode(round(x @ w)), each tile stored into its destinations among the
    members of mesh axis `axis`.

    Args:
      x, w: this device's operands, as `gemm_encode`'s.
      axis: the mesh axis of the P devices; p: its size (1..8).
      exchange: "all" or "owner", as `loopback_gemm_encode`'s.
      out_mat: the result's `manual_axis_type` under check_vma (None without).
    Returns: (P, rows, row_bytes) uint8, slot j device j's wire (tile-major; "all": of
      every tile, "owner": of this device's rows), complete when the kernel ends.
    Raises: ValueError as `gemm_encode`."""
    cfg = cfg or default_config(x.shape[-2])
    _check("gemm_encode_exchange", codec, p, x, w, cfg, exchange)
    tiles = tile_codec(codec)
    tiles_m, tiles_n = pipeline.tile_grid(x.shape[-2], w.shape[-1], cfg)
    peers = Remote(axis, p, cfg.grid(tiles_m * tiles_n, 1))
    return _wire_rows(_launch(x, w, tiles, peers, cfg, exchange, out_mat), tiles.row_bytes)


def gemm_encode_reference(x, w, codec):
    """Plain jnp: the codec's compress (`compress_reference`) of round(x @ w) (f32
    accumulation, rounded to x's dtype), blocks in tile-major order: (…, M·N/256,
    row_bytes) for x (…, M, K), w (…, K, N); a codec with B < 256 (echo4: 128) has
    256 / B of its rows in each."""
    blocks = tile_blocks(pipeline.matmul_reference(x, w))              # (…, rows, 256)
    wire = codec.compress_reference(blocks.reshape(-1, codec.block_size))
    return wire.reshape(*blocks.shape[:-1], -1)     # a tile row: 256 // B codec rows
