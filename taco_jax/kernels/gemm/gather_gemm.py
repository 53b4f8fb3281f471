"""The column-parallel GEMM of tensor parallelism with its all-gather compressed, in one
launch (Pallas Mosaic GPU, Hopper): x sharded by rows over P devices, w's columns local,

    y = gather_d(decode(encode(x_d))) @ w,  x_d (M/P, K), w (K, N) bf16 or f16,

accumulated in f32 and rounded to x's dtype; y (M, N), rows [d·M/P, (d+1)·M/P) from
device d's shard. The gathered x never reaches HBM in bf16: each device encodes its shard
once and stores the codes into every device's receive buffer, and the GEMM's producer
decodes them straight into the shared-memory operand tiles that feed the wgmma.

The local shard is quantized too: every row block, a device's own included, enters the
GEMM as decode(encode(x_d)), so every device multiplies the same bits for the same
gathered rows (`gather_gemm_reference` does the same).

Wire layout: device d's shard in the codec's rows, tile-major (`encode_epilogue`'s
order): codec tile t = i·(K/256) + c covers shard rows 64i … 64i + 63, columns 256c …
256c + 255, its 64 wire rows lines [t·lines, (t+1)·lines) of slot d of the receive
buffer (lines = 64·row_bytes/256: 66 for taco, 36 for echo4).

Per program (`GatherConfig`: one compute warpgroup, one memory warpgroup, one decoding
producer warpgroup; tile_k = 128, one decode column part a step):
  compute warpgroup, first (`pipeline.mainloop`'s `before`): encode the program's share
      of the local shard's 64-row bands (bands b, b + nprog, …): per codec tile, TMA the
      (64, 256) x tile into shared memory, encode it, stage its wire rows and TMA them into
      every device's receive buffer, this device's last; once a band's stores have
      landed, add N/256 (the band's consumers) to the band's semaphore on every device;
  memory warpgroup: w's (128, 256) slices by TMA, as the plain GEMM;
  producer warpgroup (`mainloop`'s load_a): per output tile (gathered rows 64r …, from
      device r // bands, band r % bands), wait for that band's semaphore (taking 1),
      then per K step decode column part k % 2 of codec tile k // 2 from the receive
      buffer in HBM into the step's (64, 128) x slot, in x's dtype;
  compute warpgroup: the wgmma mainloop, then the epilogue (round, stage, TMA out).
Output tiles run from this device's own rows on (whose codes are ready first). Every
program's encode comes before its own waits, and all programs are resident (one per
multiprocessor), so no wait waits on a program that cannot run.

`loopback_gather_gemm` (P virtual devices on one GPU), `all_gather_gemm` (inside
`jax.shard_map` over GPUs of one process), `gather_gemm_reference` (jnp);
`unsupported` says why a call is not covered. No library path selects this kernel: its
GPU checks have not run (`bench/gather_gemm.py`); only explicit calls use it.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from taco_jax import _jax_private
from taco_jax.kernels.fused.peers import Loopback, Remote
from taco_jax.kernels.gemm import encode_epilogue as ee
from taco_jax.kernels.gemm import pipeline
from taco_jax.kernels.gemm.config import ROWS, TILE_N, GemmConfig, buffer_bytes
from taco_jax.kernels.mosaic import registers

LINE = ee.LINE
PARTS = 2            # decode passes of a codec tile: each is one K step of 128 values
TILE_K = TILE_N // PARTS
# Which parts of the launch run: "both" (the product: encode, exchange, GEMM, with the
# semaphores between them); "encode" or "gemm" alone (the receive buffer an output, or an
# input): the interpreter runs grid programs one after another and has no semaphores, so
# it checks the two halves as two launches.
STAGES = ("both", "encode", "gemm")


@dataclasses.dataclass(frozen=True)
class GatherConfig:
    """A launch of the gather GEMM: one program per multiprocessor (`programs` caps it)
    of three warpgroups: compute (232 registers), memory (40), decoding producer (232);
    2 × 232 + 40 ≤ 512 leaves no room for a second compute warpgroup."""
    # Operand slots: each a (64, 128) x slot (decoded) and a (128, 256) w slot (TMA),
    # 80 KiB; 2 leave room for the 32 KiB staging tile.
    steps: int = 2
    programs: int | None = None

    def __post_init__(self):
        if not 2 <= self.steps <= 8:
            raise ValueError(f"GatherConfig.steps={self.steps} must be in 2..8")
        if self.programs is not None and self.programs < 1:
            raise ValueError(f"GatherConfig.programs={self.programs} must be >= 1")

    def gemm(self) -> GemmConfig:
        """The mainloop's launch: one compute warpgroup, K steps of one decode part."""
        return GemmConfig(tile_k=TILE_K, steps=self.steps, wgs=1, programs=self.programs)


def smem_bytes(codec, dtype, cfg: GatherConfig) -> int:
    """Shared memory of one program: the operand slots, one 32 KiB staging tile (the x tile
    being encoded, then its wire rows; later the output tile of the epilogue), the tile
    codec's operands, and 1 KiB for the barriers."""
    ops = [(a.shape, a.dtype) for a, _ in ee.tile_codec(codec).operands(dtype)]
    return (cfg.gemm().pipeline_bytes(dtype) + buffer_bytes([((ROWS, TILE_N), dtype)])
            + buffer_bytes(ops) + 1024)


def unsupported(codec, p: int, x_shape, w_shape, dtype,
                cfg: GatherConfig | None = None) -> str | None:
    """Why the gather GEMM does not cover x_d (M/P, K) gathered over P devices @ w (K, N)
    (None: it does): P = 1..8, bf16 or f16, M/P a positive multiple of 64, K of 256 (a
    codec tile's columns), N of 256, a codec with tile math for the dtype, a launch that
    fits shared memory."""
    cfg = cfg or GatherConfig()
    if not 1 <= p <= ee.MAX_P:
        return f"P={p} devices (covered: 1..{ee.MAX_P})"
    why = pipeline.unsupported(x_shape, w_shape, dtype, cfg.gemm())
    if why is not None:
        return why
    if x_shape[-1] % TILE_N:
        return f"K={x_shape[-1]} is not a multiple of {TILE_N} (the codec tile's columns)"
    why = ee.tile_unsupported(codec, dtype)
    if why is not None:
        return why
    need = smem_bytes(codec, dtype, cfg)
    if need + pipeline.SMEM_RESERVED > pipeline.SMEM_PER_SM:
        return (f"{cfg} needs {need // 1024} KiB of shared memory a program; a "
                f"multiprocessor has {pipeline.SMEM_PER_SM // 1024} KiB")
    return None


# -- the kernel --------------------------------------------------------------------------------
class _Bands:
    """The band semaphores: on each device, one per (source device, 64-row band of its
    shard), counting the band's consumers still to come (N/256 output tiles); one global
    array, so a band encoded by any program releases the tiles of every program. Remote:
    (P · bands,) on each device; Loopback: (P receivers · P · bands,)."""

    def __init__(self, peers, bands: int, consumers: int):
        self.peers, self.bands, self.consumers = peers, bands, consumers
        self.remote = isinstance(peers, Remote)
        n = peers.p * bands * (1 if self.remote else peers.p)
        self.sems = pl.get_global(plgpu.SemaphoreType.REGULAR((n,)))

    def _at(self, dst, src, band):
        p = self.peers.p
        idx = src * self.bands + band if self.remote else (dst * p + src) * self.bands + band
        return self.sems.at[idx]

    def release(self, me, band):
        """This device's band `band` has landed everywhere: its consumers may read it."""
        p = self.peers.p
        for k in range(1, p + 1):                      # peers first, this device last
            dst = (me + k) % p
            device_id = ({self.peers.axis: dst} if self.remote and k < p else None)
            pl.semaphore_signal(self._at(dst, me, band), self.consumers,
                                device_id=device_id)

    def acquire(self, me, src, band):
        pl.semaphore_wait(self._at(me, src, band), 1)


def _body(peers, tiles, cfg: GemmConfig, n_ops: int, stages: str, bands: int, kt: int,
          tiles_n: int, dtype):
    """The kernel body for plgpu.kernel: (x, w, *operands, [recv in], [y], [recv out],
    *scratch)."""
    p, nprog = peers.p, peers.nprog
    row = tiles.row_bytes
    lines = ROWS * row // LINE
    vec = registers.value_vec(dtype)
    rows_total = p * bands                       # 64-row tiles of the gathered M
    n_tiles = rows_total * tiles_n
    sync = stages == "both"

    def body(x_gmem, w_gmem, *refs):
        consts_gmem, refs = refs[:n_ops], refs[n_ops:]
        y_gmem = None
        if stages == "both":
            y_gmem, recv_gmem, refs = refs[0], refs[1], refs[2:]
        elif stages == "gemm":
            recv_gmem, y_gmem, refs = refs[0], refs[1], refs[2:]
        else:
            recv_gmem, refs = refs[0], refs[1:]
        a_smem, b_smem, full, consumed, turn, staging = refs[:6]
        consts, (c_bar, x_bar) = refs[6:6 + n_ops], refs[6 + n_ops:8 + n_ops]
        xs_smem, lines_smem, o_smem = staging
        me, b = peers.ids()
        wg = lax.axis_index("wg")
        recv_mine = peers.local(recv_gmem, me)
        # at P = 1 too: the programs that decode a band are not the one that encodes it
        sems = _Bands(peers, bands, tiles_n) if sync else None

        @pl.when(wg == 0)
        def _():
            for k, (src, dst) in enumerate(zip(consts_gmem, consts)):
                plgpu.copy_gmem_to_smem(src, dst, c_bar.at[k])

        def wait_consts():
            for k in range(n_ops):
                plgpu.barrier_wait(c_bar.at[k])

        def encode_shard(g):
            """Encode this program's bands of the local shard into every device's slot me."""
            del g
            wait_consts()
            x_mine = peers.local(x_gmem, me)
            stage = lines_smem.at[pl.ds(0, lines)]

            @pl.loop(b, bands, step=nprog)
            def _band(band):
                @pl.loop(0, kt)
                def _tile(c):
                    # the staging was last read by the previous tile's wire stores
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    plgpu.copy_gmem_to_smem(
                        x_mine.at[pl.ds(band * ROWS, ROWS), pl.ds(c * TILE_N, TILE_N)],
                        xs_smem, x_bar.at[0])
                    plgpu.barrier_wait(x_bar.at[0])
                    wire = tiles.encode(xs_smem, consts)
                    plgpu.commit_smem()     # every warp is past its reads of xs (stage overlays it)
                    tiles.store(ee.wire_view(stage, row), wire)
                    plgpu.commit_smem()
                    at = pl.ds((band * kt + c) * lines, lines)
                    for k in range(1, p + 1):          # peers first, this device's slot last
                        dst = recv_mine if k == p else peers.peer(recv_gmem, me, (me + k) % p)
                        plgpu.copy_smem_to_gmem(stage, dst.at[me, at])
                if sems is not None:
                    plgpu.wait_smem_to_gmem(0)         # the band has landed everywhere
                    sems.release(me, band)
            plgpu.wait_smem_to_gmem(0)

        if stages == "encode":
            @pl.when(wg == 0)
            def _():
                encode_shard(0)
            return

        def decode_step(s, at, k, slot, full_bar):
            """Step s's x slot ← column part k % 2 of codec tile k // 2 of output row tile
            r's band, decoded from the receive buffer."""
            r, _ = at
            src, band = r // bands, r % bands
            c, part = k // PARTS, k % PARTS

            @pl.when(s == 0)
            def _():
                wait_consts()
            if sems is not None:
                @pl.when(k == 0)
                def _():
                    sems.acquire(me, src, band)
            view = ee.wire_view(recv_mine.at[src, pl.ds((band * kt + c) * lines, lines)], row)
            for h in range(PARTS):                     # the tile math takes a static part
                @pl.when(part == h)
                def _():
                    total = tiles.decode_add(tiles.load(view, h, PARTS), consts, vec, h, PARTS)
                    _jax_private.mgpu_store(slot, tiles.finish(total, vec, PARTS).astype(dtype),
                                            tiled=True)     # the wgmma operand slot
            plgpu.commit_smem()
            plgpu.barrier_arrive(full_bar)

        def epilogue(i, at, g, acc):
            r, tn = at
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)     # the last tile's store
            o_smem[...] = acc.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, peers.local(y_gmem, me).at[
                pl.ds(r * ROWS, ROWS), pl.ds(tn * TILE_N, TILE_N)])

        count, first = pipeline.program_tiles(n_tiles, nprog, b)

        def tile(i):
            # from this device's own rows on: its codes are the first ready
            return (first(i) + me * bands * tiles_n) % n_tiles

        def after(g):
            plgpu.wait_smem_to_gmem(0)

        pipeline.mainloop(x_gmem, w_gmem, a_smem, b_smem, full, consumed, turn, cfg=cfg,
                          count=count, tile=tile, n_cols=tiles_n, epilogue=epilogue,
                          after=after, before=encode_shard if sync else None,
                          load_a=decode_step, k_steps=kt * PARTS)
    return body


def _scratch(tiles, dtype, cfg: GemmConfig) -> list:
    """The pipeline's scratch (x slots in the output tile's transforms: what the decoded
    parts are stored with), the staging union (the x tile to encode, its wire lines, the
    output tile), the codec's operands, their barrier, the x tile's barrier."""
    staging = plgpu.RefUnion(
        plgpu.SMEM((ROWS, TILE_N), dtype, transforms=tiles.x_transforms(dtype)),
        plgpu.SMEM((ROWS * TILE_N * jnp.dtype(dtype).itemsize // LINE, LINE), jnp.uint8),
        plgpu.SMEM((ROWS, TILE_N), dtype, transforms=registers.swizzled(dtype)))
    consts = [plgpu.SMEM(a.shape, a.dtype, transforms=t) for a, t in tiles.operands(dtype)]
    return (pipeline.pipeline_scratch(cfg, dtype) + [staging] + consts
            + [plgpu.Barrier(num_barriers=max(len(consts), 1)), plgpu.Barrier(num_barriers=1)])


def _launch(x, w, tiles, peers, gcfg: GatherConfig, stages: str = "both", recv=None,
            mat=None):
    """x (…, M/P, K) (a leading P in loopback), w (K, N) → by stages: "both" (y, recv),
    "encode" recv, "gemm" y (from recv, an input). y (…, M, N); recv (…, P, lines·M·K /
    (P·64·256), 256) uint8, slot d device d's wire."""
    dtype = x.dtype
    mp, k = x.shape[-2:]
    n = w.shape[-1]
    p = peers.p
    bands, kt, tiles_n = mp // ROWS, k // TILE_N, n // TILE_N
    lines = ROWS * tiles.row_bytes // LINE
    remote = isinstance(peers, Remote)
    lead = () if remote else (p,)

    def out(shape, dt):
        return (jax.ShapeDtypeStruct(shape, dt) if mat is None else
                jax.ShapeDtypeStruct(shape, dt, manual_axis_type=mat))
    y_type = out((*lead, p * mp, n), dtype)
    recv_type = out((*lead, p, bands * kt * lines, LINE), jnp.uint8)
    out_type = {"both": (y_type, recv_type), "encode": recv_type, "gemm": y_type}[stages]
    operands = [a for a, _ in tiles.operands(dtype)]
    cfg = gcfg.gemm()
    body = _body(peers, tiles, cfg, len(operands), stages, bands, kt, tiles_n, dtype)
    args = (x, w, *operands) + ((recv,) if stages == "gemm" else ())
    return pipeline.launch(body, args, out_type=out_type, scratch=_scratch(tiles, dtype, cfg),
                           cfg=cfg, nprog=peers.nprog, groups=1 if remote else p,
                           name="taco_gather_gemm", producer=True)


def _grid(gcfg: GatherConfig, p: int, mp: int, n: int, devices_here: int) -> int:
    return gcfg.gemm().grid((p * mp // ROWS) * (n // TILE_N), devices_here)


def _check(where, codec, p, x, w, cfg):
    why = unsupported(codec, p, x.shape, w.shape, x.dtype, cfg) or (
        None if w.dtype == x.dtype else f"x is {x.dtype}, w is {w.dtype}")
    if why is not None:
        raise ValueError(f"{where}: {why}")


def loopback_launch(xs, w, codec, cfg: GatherConfig | None = None, stages: str = "both",
                    recv=None):
    """`loopback_gather_gemm` unjitted, by stages (`STAGES`): "both" → (y, recv); "encode"
    → recv; "gemm" → y from recv (the interpreter checks the halves so)."""
    if stages not in STAGES:
        raise ValueError(f"gather_gemm: stages={stages!r} (one of {', '.join(STAGES)})")
    p = xs.shape[0] if xs.ndim == 3 else 0
    cfg = cfg or GatherConfig()
    _check("loopback_gather_gemm", codec, p, xs[0] if p else xs, w, cfg)
    tiles = ee.tile_codec(codec)
    peers = Loopback(p, _grid(cfg, p, xs.shape[1], w.shape[1], p))
    return _launch(xs, w, tiles, peers, cfg, stages, recv)


@functools.partial(jax.jit, static_argnames=("codec", "cfg"))
def loopback_gather_gemm(xs, w, codec, cfg: GatherConfig | None = None):
    """The gather GEMM on one GPU for P = xs.shape[0] virtual devices: device d encodes
    xs[d], stores its codes into every device's receive buffer, and computes the gathered,
    decoded x @ w.

    Args:
      xs: (P, M/P, K) bf16 or f16, device d's shard xs[d]; M/P % 64 == 0, K % 256 == 0.
      w: (K, N) of xs' dtype, every device's (N % 256 == 0).
      codec: a codec with tile math for the dtype (`unsupported`).
      cfg: `GatherConfig`; None: its defaults.
    Returns: (P, M, N): [d] what device d computed, the same bits for every d when the
      exchange is right.
    Raises: ValueError naming what is not covered."""
    y, _ = loopback_launch(xs, w, codec, cfg)
    return y


def all_gather_gemm(x, w, axis: str, p: int, codec, *, out_mat=None,
                cfg: GatherConfig | None = None):
    """Inside `jax.shard_map` over GPUs of one process (mesh devices 0..n−1 in order): the
    all-gather of x's shards over mesh axis `axis`, compressed, times this device's w.

    Args:
      x: this device's (M/P, K) rows, bf16 or f16; w: its (K, N) columns, x's dtype.
      axis: the mesh axis of the P devices; p: its size (1..8).
      codec: a codec with tile math for the dtype (`unsupported`).
      out_mat: the result's `manual_axis_type` under check_vma (None without).
      cfg: `GatherConfig`; None: its defaults.
    Returns: (M, N) in x's dtype, rows [d·M/P, (d+1)·M/P) from device d's codes.
    Raises: ValueError naming what is not covered."""
    cfg = cfg or GatherConfig()
    _check("all_gather_gemm", codec, p, x, w, cfg)
    tiles = ee.tile_codec(codec)
    peers = Remote(axis, p, _grid(cfg, p, x.shape[0], w.shape[1], 1))
    y, _ = _launch(x, w, tiles, peers, cfg, mat=out_mat)
    return y


# -- references -------------------------------------------------------------------------------
def decoded_shards(xs, codec):
    """Plain jnp: decode(encode(xs[d])) for every shard, in xs' dtype (the codec's blocks
    of B consecutive values of a row; decoded in f32, then rounded, as the kernel's
    producer stores its operand)."""
    blocks = xs.reshape(-1, codec.block_size)
    dec = codec.decompress_reference(codec.compress_reference(blocks))
    return dec.astype(jnp.float32).astype(xs.dtype).reshape(xs.shape)


def gather_gemm_reference(xs, w, codec):
    """Plain jnp: the gathered decode(encode(xs[d])) (d in order) @ w, accumulated in f32
    and rounded to xs' dtype: (M, N) for xs (P, M/P, K), w (K, N)."""
    x = decoded_shards(xs, codec).reshape(-1, xs.shape[-1])          # (M, K)
    return pipeline.matmul_reference(x, w)


def gather_wire_reference(x, codec):
    """Plain jnp: one device's wire, the codec's rows of x (…, M/P, K) in tile-major block
    order: (…, M·K/(P·256), row_bytes)."""
    blocks = ee.tile_blocks(x)                                       # (…, rows, 256)
    wire = codec.compress_reference(blocks.reshape(-1, codec.block_size))
    return wire.reshape(*blocks.shape[:-1], -1)
