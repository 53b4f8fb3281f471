"""The compressed two-shot all-reduce in one Pallas Mosaic GPU kernel (Hopper), for P ≥ 3
(`two_shot_allreduce`, `two_shot_loopback`), for the codecs with a tile codec
(`kernels.tile_codec`: the FP8 codecs, echo4): x is cut into P segments of whole tiles;
program b of every device takes every n-th tile of each segment, from a start that moves
by the segment's remainder from one segment to the next (`_shares`: no program takes an
extra tile in every segment).

  1. scatter: for each owner j ≠ me (me + 1, me + 2, …), encode segment j's tiles and
     store them into j's first receive buffer (slot me), one pipelined loop over all of
     them; then wait for the stores, signal the peers' programs b, wait for theirs;
  2. reduce, as owner of segment me: per tile, its exact tile plus the P − 1 peers' copies
     (senders me + 1, me + 2, …) summed in f32 and encoded once (`tiles.sum_init`,
     `sum_add`, `sum_encode`: the FP8 codecs sum the transform's coefficients, so a copy
     costs a convert and a multiply-add per code, no transform), stored into every
     device's second receive buffer (slot me, its own last); the copies stream through a
     ring of shared-memory slots; handshake again;
  3. gather: decode the P owners' sums into the output.
At most two quantizations per element (sender, owner); every device decodes the same
bytes, so all get the same bits; a non-finite block decodes to NaN. Its reference is
`two_shot_reference`. The handshakes are per program b (no grid-wide barrier): a device's
program b only ever waits on the peers' programs b, which handle the same tiles.

Each phase's buffers are scoped to it, so that two programs fit on a multiprocessor where
the largest phase allows (`two_shot_config`): one program's waits then hide behind the
other's work. It shares the one-shot kernel's ways of addressing a peer (`peers.Remote`,
`Loopback`), its tile codecs and its configuration (`FusedConfig`: `programs`, `per_sm`,
`parts`, `x_slots`, `out_store`, `ring`). Its loopback checks passed on an H200 at P = 3..8
for taco and echo4, bf16, f16 and f32, to 1 GiB, at earlier kernel sources
(bench/results/fused_two_shot_checks.json), and on an H100 at P = 3, 4, 8 for the modules
it emits now (bench/results/fused_checks.json; what is selected: `checked`);
its time per device and how it spends it: docs/fused_kernels.md.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from taco_jax.kernels.fused.config import (SMEM_PER_SM, SMEM_RESERVED, TWO_SHOT_ABLATIONS,
                                           FusedConfig)
from taco_jax.kernels import tile_codec
from taco_jax.kernels.fused.body import BLOCK, LINE, ROWS, stage_f32
from taco_jax.kernels.fused.launch import buffer_bytes, scratch_args, scratch_types
from taco_jax.kernels.fused.one_shot import check
from taco_jax.kernels.fused.peers import Loopback, Remote
from taco_jax.kernels.mosaic import registers
from taco_jax.numerics.blocks import from_blocks

RING = (7, 6, 5, 4, 3, 2)   # the reduce's and gather's slots for incoming wire tiles, most first


# -- shared memory, per phase -------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Plan:
    """One launch's shared-memory layout: input slots of the scatter, the ring of incoming
    wire tiles of the reduce and gather, the gather's results staged for TMA or stored from
    registers."""
    x_slots: int
    ring: int
    tma_out: bool


def _phases(tiles, in_dtype, out_dtype, plan: _Plan) -> dict:
    """Each phase's scoped buffers (a list of SMEM specs)."""
    lines = ROWS * tiles.row_bytes // LINE
    wire = lambda n: plgpu.SMEM((n, lines, LINE), jnp.uint8)       # noqa: E731
    scatter = [plgpu.SMEM((plan.x_slots, ROWS, BLOCK), in_dtype,
                          transforms=tiles.x_transforms(in_dtype))]
    if tiles.staging(in_dtype) is not None:
        scatter.append(tiles.staging(in_dtype))
    scatter.append(wire(2))
    reduce = [*tiles.own_scratch(in_dtype), wire(plan.ring), wire(1)]
    gather = [wire(plan.ring)]
    if plan.tma_out:
        gather.append(plgpu.SMEM((ROWS, BLOCK), out_dtype,
                                 transforms=registers.swizzled(out_dtype)))
    return {"scatter": scatter, "reduce": reduce, "gather": gather}


def _program_bytes(tiles, in_dtype, out_dtype, plan: _Plan) -> int:
    """Shared memory of one program: its largest phase, the operands, 1 KiB for barriers."""
    consts = [plgpu.SMEM(a.shape, a.dtype) for a, _ in tiles.operands(in_dtype)]
    return (max(buffer_bytes(b) for b in _phases(tiles, in_dtype, out_dtype, plan).values())
            + buffer_bytes(consts) + 1024)


def _plan(tiles, in_dtype, out_dtype, cfg: FusedConfig) -> _Plan:
    """The deepest ring (`RING`, or `cfg.ring`) that fits `cfg.per_sm` programs per
    multiprocessor; ValueError naming the need where it does not."""
    x_slots = cfg.x_slots or tiles.x_slots(in_dtype)
    tma_out = jnp.dtype(out_dtype).itemsize == 2 and cfg.out_store == "tma"
    room = SMEM_PER_SM // cfg.per_sm - SMEM_RESERVED
    rings = RING if cfg.ring is None else (cfg.ring,)
    for ring in rings:
        plan = _Plan(x_slots, ring, tma_out)
        need = _program_bytes(tiles, in_dtype, out_dtype, plan)
        if need <= room:
            return plan
    raise ValueError(
        f"the two-shot kernel with FusedConfig(per_sm={cfg.per_sm}, x_slots={cfg.x_slots}, "
        f"out_store={cfg.out_store!r}, ring={cfg.ring}): a program needs {need // 1024} KiB "
        f"of shared memory ({tiles.codec.name}, {jnp.dtype(in_dtype).name}); {cfg.per_sm} "
        f"per multiprocessor leave {room // 1024} KiB each")


def two_shot_config(codec, dtype) -> FusedConfig:
    """The two-shot kernel's launch for this codec and input dtype: two programs per
    multiprocessor where the largest phase fits in half of its shared memory (16-bit
    input: the input's double buffer and the ring), else one."""
    tiles = tile_codec.for_codec(codec)
    two = FusedConfig(per_sm=2)
    try:
        _plan(tiles, dtype, dtype, two)
        return two
    except ValueError:
        return FusedConfig()


def two_shot_layout(codec, dtype, cfg: FusedConfig | None = None) -> dict:
    """The two-shot launch's shared memory for this codec and input dtype (cfg None:
    `two_shot_config`): programs per multiprocessor, input slots, ring slots, whether
    results are staged for TMA, a program's bytes and the room each may take. Raises
    ValueError where it does not fit."""
    cfg = cfg or two_shot_config(codec, dtype)
    tiles = tile_codec.for_codec(codec)
    plan = _plan(tiles, dtype, dtype, cfg)
    return {"per_sm": cfg.per_sm, "x_slots": plan.x_slots, "ring": plan.ring,
            "tma_out": plan.tma_out,
            "program_bytes": _program_bytes(tiles, dtype, dtype, plan),
            "room_bytes": SMEM_PER_SM // cfg.per_sm - SMEM_RESERVED}


# -- the kernel ---------------------------------------------------------------------------------
def _shares(seg_tiles: int, nprog: int, b):
    """Program b's tiles of each segment: first(seg) + i·nprog for i < count(seg). A segment
    of q·nprog + r tiles gives r programs one more; the r start one window further in each
    segment ((b + seg·r) mod nprog < r), so the extras of the P segments fall on different
    programs rather than all on the first r, whose loops over every segment set the
    kernel's time. Every device maps a segment alike, so the sender and the owner of a
    tile are programs b of both, and the per-program handshakes stay."""
    q, r = divmod(seg_tiles, nprog)
    if r == 0:
        return (lambda seg: b), (lambda seg: q)
    first = lambda seg: (b + seg * r) % nprog                       # noqa: E731
    return first, lambda seg: q + (first(seg) < r).astype(jnp.int32)


def _items(segs, count):
    """One loop over this program's tiles of the segments `segs` in order: (n, locate),
    locate(e) = (segment, i) of item e."""
    counts = [count(seg) for seg in segs]

    def locate(e):
        seg, i, start = segs[0], e, 0
        for s, c in zip(segs[1:], counts[:-1]):
            start = start + c
            later = e >= start
            seg, i = jnp.where(later, s, seg), jnp.where(later, e - start, i)
        return seg, i
    return sum(counts[1:], counts[0]), locate


def _two_shot_body(x_gmem, consts_gmem, y_gmem, recv1_gmem, recv2_gmem, consts, c_bar, x_bar,
                   r_bar, o_bar, sem_scratch, *, peers, tiles, seg_tiles, in_dtype, out_dtype,
                   cfg, plan):
    p, nprog, parts = peers.p, peers.nprog, cfg.parts
    me, b = peers.ids()
    sems = peers.semaphores(sem_scratch, me, b)
    x_mine, y_mine = peers.local(x_gmem, me), peers.local(y_gmem, me)
    recv1, recv2 = peers.local(recv1_gmem, me), peers.local(recv2_gmem, me)
    row = tiles.row_bytes
    lines = ROWS * row // LINE
    first, count = _shares(seg_tiles, nprog, b)
    tile = lambda seg, i: first(seg) + i * nprog          # noqa: E731  (in segment seg)
    x_rows = lambda seg, i: pl.ds((seg * seg_tiles + tile(seg, i)) * ROWS, ROWS)  # noqa: E731
    w_rows = lambda seg, i: pl.ds(tile(seg, i) * lines, lines)                     # noqa: E731
    others = [(me + k) % p for k in range(1, p)]
    ring = plan.ring
    phases = _phases(tiles, in_dtype, out_dtype, plan)

    for k, (src, dst) in enumerate(zip(consts_gmem, consts)):
        plgpu.copy_gmem_to_smem(src, dst, c_bar.at[k])
    for k in range(len(consts)):
        plgpu.barrier_wait(c_bar.at[k])

    def handshake(phase):
        """Every store so far has landed: tell the peers' programs b, hear from theirs."""
        plgpu.wait_smem_to_gmem(0)
        peers.signal(sems, me, b, others, phase)
        for src in others:
            peers.wait(sems, me, b, src, phase)

    def ring_loads(n, load):
        """The first copies of a ring over n tiles: load(f, slot) for f < ring."""
        for f in range(ring):
            @pl.when(f < n)
            def _():
                load(f, f)

    # 1. segments to their owners: tile e of the P − 1 segments me + 1, …, encoded into
    # the owner's slot `me` (one loop, so the input pipeline runs across segments)
    def scatter(x_smem, *rest):
        xb_smem, w_smem = rest if len(rest) == 2 else (None, rest[0])
        x_slots = x_smem.shape[0]
        n, locate = _items(others, count)

        def load_x(e):
            dst, i = locate(e)
            plgpu.copy_gmem_to_smem(x_mine.at[x_rows(dst, i)], x_smem.at[e % x_slots],
                                    x_bar.at[e % x_slots])

        def prefetch(e):
            @pl.when(e + 1 < n)
            def _():
                load_x(e + 1)

        @pl.when(n > 0)
        def _():
            load_x(0)

        @pl.loop(0, n)
        def _(e):
            slot = e % x_slots
            if x_slots == 2:
                prefetch(e)                  # the other slot: read at e − 1, before a barrier
            plgpu.barrier_wait(x_bar.at[slot])
            src = stage_f32(x_smem.at[slot], xb_smem,
                            (lambda: prefetch(e)) if x_slots == 1 else None)
            wire = tiles.encode(src, consts)
            if x_slots == 1 and xb_smem is None:
                plgpu.commit_smem()          # every warp has read the slot
                prefetch(e)
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)   # the staging slot's last store
            stage = w_smem.at[e % 2]
            tiles.store(stage.reshape(ROWS, row), wire)
            plgpu.commit_smem()
            dst, i = locate(e)
            plgpu.copy_smem_to_gmem(stage, peers.peer(recv1_gmem, me, dst).at[
                me, w_rows(dst, i)])
    pl.run_scoped(scatter, *phases["scatter"])
    handshake(0)
    if cfg.ablate == "scatter_only":
        return

    # 2. the owner: its exact segment + the P − 1 peers' copies (in the order me + 1, …),
    # in f32, encoded once, into every device's slot `me` (its own last)
    def reduce(*bufs):
        own, r_smem, w_smem = bufs[:-2], bufs[-2], bufs[-1]
        n_src = p - 1
        mine = count(me)
        n = mine * n_src

        def load_copy(f, slot):
            src = (me + 1 + f % n_src) % p
            plgpu.copy_gmem_to_smem(recv1.at[src, w_rows(me, f // n_src)], r_smem.at[slot],
                                    r_bar.at[slot])

        def load_own(i):
            plgpu.copy_gmem_to_smem(x_mine.at[x_rows(me, i)], own[0], o_bar)

        @pl.when(mine > 0)
        def _():
            load_own(0)
        ring_loads(n, load_copy)

        @pl.loop(0, mine)
        def _(i):
            plgpu.barrier_wait(o_bar)
            total = tiles.sum_init(own, consts)
            for k in range(n_src):
                f = i * n_src + k
                slot = f % ring
                plgpu.barrier_wait(r_bar.at[slot])
                wire = tiles.sum_load(r_smem.at[slot].reshape(ROWS, row))
                plgpu.commit_smem()          # every warp has read the slot (and, k = 0, own)

                @pl.when(f + ring < n)
                def _():
                    load_copy(f + ring, slot)
                if k == 0:
                    @pl.when(i + 1 < mine)
                    def _():
                        load_own(i + 1)
                total = tiles.sum_add(total, wire, consts)
            wire = tiles.sum_encode(total)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # tile i − 1's P stores
            stage = w_smem.at[0]
            tiles.store(stage.reshape(ROWS, row), wire)
            plgpu.commit_smem()
            for k in range(1, p + 1):
                out = recv2 if k == p else peers.peer(recv2_gmem, me, (me + k) % p)
                plgpu.copy_smem_to_gmem(stage, out.at[me, w_rows(me, i)])
    pl.run_scoped(reduce, *phases["reduce"])
    handshake(1)
    if cfg.ablate == "no_gather":           # the handshake waited for every store
        return

    # 3. every device decodes the P owners' sums: the same bytes everywhere
    def gather(r_smem, y_smem=None):
        n, locate = _items(list(range(p)), count)

        def load_sum(e, slot):
            owner, i = locate(e)
            plgpu.copy_gmem_to_smem(recv2.at[owner, w_rows(owner, i)], r_smem.at[slot],
                                    r_bar.at[slot])
        ring_loads(n, load_sum)

        @pl.loop(0, n)
        def _(e):
            slot = e % ring
            plgpu.barrier_wait(r_bar.at[slot])
            values = tiles.decode(r_smem.at[slot].reshape(ROWS, row), consts, out_dtype, parts)
            plgpu.commit_smem()              # every warp has read the slot

            @pl.when(e + ring < n)
            def _():
                load_sum(e + ring, slot)
            out = y_mine.at[x_rows(*locate(e))]
            if y_smem is None:
                registers.store_values(out, values)
            else:
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the last result store
                registers.store_values(y_smem, values)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(y_smem, out)
        plgpu.wait_smem_to_gmem(0)
    pl.run_scoped(gather, *phases["gather"])


def _launch_two_shot(blocks, codec, out_dtype, peers, cfg, mat=None):
    """blocks: (P·T·64, 256) or, in loopback, (P, P·T·64, 256): P segments of T tiles."""
    p = peers.p
    tiles = tile_codec.for_codec(codec)
    n_rows = blocks.shape[-2]
    seg_tiles = n_rows // (p * ROWS)
    lead = blocks.shape[:-2]
    lines = ROWS * tiles.row_bytes // LINE
    in_dtype = blocks.dtype
    plan = _plan(tiles, in_dtype, out_dtype, cfg)

    def struct(shape, dtype):
        if mat is None:
            return jax.ShapeDtypeStruct(shape, dtype)
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)

    recv = struct((*lead, p, seg_tiles * lines, LINE), jnp.uint8)
    out_type = (struct((*lead, n_rows, BLOCK), out_dtype), recv, recv)
    operands = [a for a, _ in tiles.operands(in_dtype)]
    n_ops = len(operands)
    scratch = [
        tuple(plgpu.SMEM(a.shape, a.dtype, transforms=t) for a, t in tiles.operands(in_dtype)),
        plgpu.Barrier(num_barriers=max(n_ops, 1)),           # the operands landed
        plgpu.Barrier(num_barriers=2),                       # scatter: input tile landed
        plgpu.Barrier(num_barriers=plan.ring),               # reduce, gather: wire tile landed
        plgpu.Barrier(),                                     # reduce: the owner's tile landed
        (plgpu.SemaphoreType.REGULAR((2 * p,)) if isinstance(peers, Remote) else None),
    ]

    def body(x, *refs):
        consts_gmem, outs, refs = refs[:n_ops], refs[n_ops:n_ops + 3], refs[n_ops + 3:]
        _two_shot_body(x, consts_gmem, *outs, *scratch_args(scratch, refs), peers=peers,
                       tiles=tiles, seg_tiles=seg_tiles, in_dtype=in_dtype,
                       out_dtype=out_dtype, cfg=cfg, plan=plan)

    kernel = plgpu.kernel(
        body, out_type=out_type, scratch_types=scratch_types(scratch),
        grid=(peers.grid(),), grid_names=("prog",), kernel_name="taco_fused_two_shot",
        compiler_params=plgpu.CompilerParams(lowering_semantics=registers.LANE))
    y, _, _ = kernel(blocks, *operands)
    return y


# -- wrappers ------------------------------------------------------------------------------------
def _segments(flat, p: int):
    """(…, n) → ((…, P·T·64, 256) blocks, T): P segments of T whole tiles, zero-padded at
    the end (zero blocks decode to zeros and are sliced off)."""
    n = flat.shape[-1]
    seg_tiles = -(-max(n, 1) // (p * ROWS * BLOCK))
    pad = p * seg_tiles * ROWS * BLOCK - n
    if pad:
        flat = jnp.pad(flat, [(0, 0)] * (flat.ndim - 1) + [(0, pad)])
    return flat.reshape(*flat.shape[:-1], p * seg_tiles * ROWS, BLOCK), seg_tiles


def _two_shot_cfg(cfg: FusedConfig | None, codec, dtype) -> FusedConfig:
    """The two-shot kernel reads `programs`, `per_sm` (1 or 2: a program holds up to 255
    registers a thread), `parts`, `x_slots`, `out_store`, `ring` and its measurement knobs
    (`ablate` in TWO_SHOT_ABLATIONS: phases left out, results wrong, timed only); the decode
    options are the one-shot kernel's. None: `two_shot_config`."""
    cfg = cfg or two_shot_config(codec, dtype)
    if cfg.ablate not in TWO_SHOT_ABLATIONS or cfg.per_sm > 2:
        raise ValueError(f"the two-shot kernel takes ablate {', '.join(TWO_SHOT_ABLATIONS)} "
                         f"and per_sm 1 or 2 (got ablate={cfg.ablate!r}, per_sm={cfg.per_sm})")
    if (cfg.decode != "per_source" or cfg.encode_parts != 1 or cfg.store_parts
            or cfg.own_from_smem or cfg.warp_specialized):
        raise ValueError(f"the two-shot kernel takes no decode, encode_parts, store_parts, "
                         f"own_from_smem or warp_specialized (got decode={cfg.decode!r}, "
                         f"encode_parts={cfg.encode_parts}, store_parts={cfg.store_parts}, "
                         f"own_from_smem={cfg.own_from_smem}, warp_specialized="
                         f"{cfg.warp_specialized})")
    _plan(tile_codec.for_codec(codec), dtype, dtype, cfg)   # its shared memory fits, or why not
    return cfg


def two_shot_allreduce(x, axis: str, p: int, codec, *, out_mat=None,
                       cfg: FusedConfig | None = None):
    """The compressed two-shot all-reduce in one kernel (the fused transport's at P = 3..8
    where its loopback checks passed). x is cut into P segments of whole tiles; device d
    encodes segment j ≠ d into owner j's receive buffer; owner j adds the P − 1 decoded
    copies to its exact segment in f32 (its own data never quantized there), encodes the
    sum once and stores it into every device's second receive buffer; every device
    decodes the P sums. At most two quantizations per element; every device decodes the
    same bytes, so all get the same bits. A non-finite block decodes to NaN.

    Args and Raises: as `one_shot_allreduce` (P = 2..8; meant for P ≥ 3).
    Returns: an array of x's shape and dtype."""
    check(codec, p, x.dtype, "two_shot_allreduce")
    cfg = _two_shot_cfg(cfg, codec, x.dtype)
    if x.size == 0:
        return x
    blocks, seg_tiles = _segments(x.reshape(-1), p)
    peers = Remote(axis, p, cfg.grid(seg_tiles, 1))
    y = _launch_two_shot(blocks, codec, x.dtype, peers, cfg, out_mat)
    return from_blocks(y, x.shape)


@functools.partial(jax.jit, static_argnames=("codec", "cfg"))
def two_shot_loopback(xs, codec, cfg: FusedConfig | None = None):
    """`two_shot_allreduce` on one GPU for P = xs.shape[0] virtual devices (as
    `one_shot_loopback`): returns (P, …), row d what device d computes."""
    p = xs.shape[0]
    check(codec, p, xs.dtype, "two_shot_loopback")
    cfg = _two_shot_cfg(cfg, codec, xs.dtype)
    if xs.size == 0:
        return xs
    blocks, seg_tiles = _segments(xs.reshape(p, -1), p)
    peers = Loopback(p, cfg.grid(seg_tiles, p), phases=2)
    y = _launch_two_shot(blocks, codec, xs.dtype, peers, cfg)
    return jax.vmap(lambda v: from_blocks(v, xs.shape[1:]))(y)


def two_shot_reference(xs, codec):
    """Plain jnp, the two-shot kernel's math: (P, …) → the result every device gets.
    Segment j (T whole tiles, `_segments`) of the sum is owner j's exact f32 segment plus
    decode(encode(x_k's segment j)) for k = j + 1, …, j + P − 1 (mod P) in that order
    (what the tile codec encodes: f32 from bf16 for the FP8 codecs), encoded once from f32 and
    decoded into xs's dtype. The codec is blockwise, so every device's segments are
    encoded in one call and the P owners' sums in another (two codec calls to compile
    whatever P is)."""
    p = xs.shape[0]
    blocks, seg_tiles = _segments(xs.reshape(p, -1), p)        # (P, P·T·64, 256)
    segs = blocks.reshape(p, p, seg_tiles * ROWS, BLOCK)       # [device, segment]
    sent = tile_codec.for_codec(codec).encoded(segs)
    width = codec.block_size

    def roundtrip(v):                                          # (…, 256) → f32, blockwise
        w = codec.compress_reference(v.reshape(-1, width))
        return codec.decompress_reference(w).reshape(v.shape)
    dec = roundtrip(sent)
    owners = jnp.arange(p)
    acc = segs[owners, owners].astype(jnp.float32)             # (P, T·64, 256): own, exact
    for k in range(1, p):
        acc = acc + dec[(owners + k) % p, owners]              # senders j + k, in order
    y = roundtrip(acc).astype(xs.dtype)
    return from_blocks(y.reshape(p * seg_tiles * ROWS, BLOCK), xs.shape[1:])
