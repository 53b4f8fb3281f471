"""The compressed one-shot all-reduce in one Pallas Mosaic GPU kernel (Hopper).

Each device encodes its tensor tile by tile, stores every wire tile (codes and scales)
into its own and every peer's receive buffer, signals the peers per tile, and, as the
tiles of every device arrive, decodes them and sums them in device order (0, 1, …,
P − 1) in f32: one quantization per element, the same bytes decoded in the same order on
every device, so every device gets the same bits. The result equals
`two_shot.one_shot` (compress → all-gather → `decode_sum`, three launches) up to the
encoder's rounding (`mosaic.encode_tile` vs the Triton compress).

One kernel body for every codec it covers, through the codec's tile codec
(`kernels.tile_codec`: the Hadamard FP8 codecs' and echo4's), and for both ways to address a
peer (`peers`: `Remote` over a mesh axis, `Loopback` on one GPU). The collectives select it
only for the codecs and dtypes whose loopback checks passed on a GPU at these kernel
sources (`checked`).

Protocol, per program b (tiles b, b + n, b + 2n, … of this device; every device's
program b handles the same tiles, so it talks only to the peers' programs b):

  step i:  load x tile i+1 (TMA, double-buffered) | encode tile i → staging (SMEM) →
           TMA stores to the peers' slots, own slot last | for tile i − 1: wait until its
           stores have landed, signal each peer, wait for each peer's signal, decode the
           P wire tiles in device order, sum, store the result (TMA).

Every program of every device must be resident at once (a program waits for its peers'
programs): the grid is at most `FusedConfig.per_sm` programs per multiprocessor per
device (1 … 4), and n only where the shared memory of n fits (`smem_bytes`,
`_check_resident`): 2 with one input slot and results stored from registers, for the FP8
codecs' 16-bit input and for echo4. `FusedConfig` (config.py) describes the other variants of the body
(the decode's order, each part stored once summed, this device's tile decoded from its
staging, the measurement knobs); the warp-specialized body is `one_shot_ws`'s. The
two-shot for P ≥ 3 in one kernel is `two_shot`'s.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from taco_jax.kernels.fused.config import (ABLATIONS, IN_DTYPES, MAX_P, SLIM_2_PER_SM,
                                           FP8_DECODE, SMEM_PER_SM, SMEM_RESERVED,
                                           WARP_SPECIALIZED, FusedConfig)
from taco_jax.kernels.fused.launch import buffer_bytes, call
from taco_jax.kernels.fused.one_shot_ws import launch_ws
from taco_jax.kernels import tile_codec
from taco_jax.kernels.fused.body import (BLOCK, LINE, ROWS, first_loads, own_or_peer,
                                         stage_f32, sum_tiles)
from taco_jax.kernels.fused.peers import Loopback, Remote
from taco_jax.kernels.mosaic import registers
from taco_jax.numerics.blocks import from_blocks, to_blocks


def default_config(codec, p: int, in_dtype) -> FusedConfig:
    """The one-shot kernel's launch shape when none is given. The FP8 codecs: FP8_DECODE; at
    P = 2 own_from_smem, and for 16-bit input WARP_SPECIALIZED; otherwise SLIM_2_PER_SM
    where two programs fit (16-bit input; f32 input's staging does not fit twice). echo4:
    SLIM_2_PER_SM wherever two programs fit (every P and input dtype: 69 / 101 KiB a program
    for 16-bit / f32 input), else FusedConfig(). Measured side by side at P = 2 in loopback,
    bf16, each checked on 3 calls (bench/results/fused_echo4_levers.json, commit fc1d4a4):
    23.8 / 84.5 / 324.9 µs per device at 16 / 64 / 256 MiB against 26.5 / 97.2 / 383.1 with
    one program (one warpgroup) a multiprocessor."""
    options = tile_codec.for_codec(codec).options
    if "sum_first" not in options:                 # echo4: the FP8 decode is not its
        need = 2 * (smem_bytes(p, codec, in_dtype, cfg=SLIM_2_PER_SM) + SMEM_RESERVED)
        return SLIM_2_PER_SM if need <= SMEM_PER_SM else FusedConfig()
    fp8 = dict(FP8_DECODE, own_from_smem=p == 2)
    if p == 2 and jnp.dtype(in_dtype).itemsize == 2 and "warp_specialized" in options:
        return FusedConfig(**fp8, **WARP_SPECIALIZED)
    slim = dataclasses.replace(SLIM_2_PER_SM, **fp8)
    if jnp.dtype(in_dtype).itemsize == 2:
        need = 2 * (smem_bytes(p, codec, in_dtype, cfg=slim) + SMEM_RESERVED)
        if need <= SMEM_PER_SM:
            return slim
    return FusedConfig(**fp8)


# -- the kernel ---------------------------------------------------------------------------------
def _kernel_body(x_gmem, c_gmem, y_gmem, recv_gmem, x_smem, xb_smem, w_smem, r_smem, y_smem,
                 c_smem, x_bar, h_bar, r_bar, sem_scratch, *, peers, tiles, n_tiles, out_dtype,
                 cfg):
    """c_gmem, c_smem: the tile codec's constant operands and their shared-memory copies."""
    p, nprog = peers.p, peers.nprog
    parts, ablate = cfg.parts, cfg.ablate
    me, b = peers.ids()
    sems = peers.semaphores(sem_scratch, me, b)
    x_mine, y_mine = peers.local(x_gmem, me), peers.local(y_gmem, me)
    recv_mine = peers.local(recv_gmem, me)
    row = tiles.row_bytes
    lines = ROWS * row // LINE                                   # wire lines per tile
    count = (n_tiles - b + nprog - 1) // nprog                    # this program's tiles
    tile = lambda i: b + i * nprog                               # noqa: E731
    vec = registers.value_vec(out_dtype)
    tma_out = y_smem is not None
    # Bulk store groups per step, in issue order: the wire stores of tile i (n_wire), then
    # the result store of tile i − 1 (n_res; none when results leave from registers).
    own = cfg.own_from_smem
    wire_ks = ([] if ablate == "no_peer_stores" else list(range(1, p))) + ([] if own else [p])
    n_wire = len(wire_ks)
    n_res = 1 if tma_out else 0
    sync = ablate not in ("no_signal", "no_sync")

    for src, dst in zip(c_gmem, c_smem):
        plgpu.copy_gmem_to_smem(src, dst, h_bar)
        plgpu.barrier_wait(h_bar)

    x_slots = x_smem.shape[0]
    r_wire = w_smem if own else r_smem             # where the decode reads wire tiles

    def load_x(i):
        slot = i % x_slots
        plgpu.copy_gmem_to_smem(x_mine.at[pl.ds(tile(i) * ROWS, ROWS)], x_smem.at[slot],
                                x_bar.at[slot])

    def prefetch(i):
        @pl.when(i + 1 < count)
        def _():
            load_x(i + 1)

    def landed(n):
        """All but the last n bulk store groups are complete (skipped by "no_sync")."""
        if ablate != "no_sync":
            plgpu.wait_smem_to_gmem(n)

    def encode_and_push(i):
        slot = i % x_slots
        plgpu.barrier_wait(x_bar.at[slot])
        src = stage_f32(x_smem.at[slot], xb_smem,
                        (lambda: prefetch(i)) if x_slots == 1 else None)
        wires = [tiles.encode(src, c_smem)
                 for _ in range({"encode_twice": 2, "no_encode": 0}.get(ablate, 1))]
        if x_slots == 1 and xb_smem is None:
            prefetch(i)                    # the transform has read the tile
        # of the two staging slots, this one was last read by step i − 2's stores, so all
        # groups issued before step i − 1's wire stores and result store are done reading
        plgpu.wait_smem_to_gmem(n_wire + n_res, wait_read_only=True)
        if own:
            # step i − 1 decoded this device's tile i − 2 from this slot by register loads:
            # every warp is past them before any overwrites it
            plgpu.commit_smem()
        stage = w_smem.at[i % 2]
        for wire in wires:
            tiles.store(stage.reshape(ROWS, row), wire)
        plgpu.commit_smem()
        rows = pl.ds(tile(i) * lines, lines)
        for k in wire_ks:                        # peers first, this device's own slot last
            dst = (me + k) % p
            out = recv_mine if k == p else peers.peer(recv_gmem, me, dst)
            plgpu.copy_smem_to_gmem(stage, out.at[me, rows])

    def arrive(i):
        """Tile i's stores have landed (the caller waited): signal the peers, wait for
        theirs, start loading the P wire tiles."""
        if sync:
            peers.signal(sems, me, b, [(me + k) % p for k in range(1, p)])
            for k in range(1, p):
                peers.wait(sems, me, b, (me + k) % p)
        rows = pl.ds(tile(i) * lines, lines)

        def load(j, slot):
            plgpu.copy_gmem_to_smem(recv_mine.at[j, rows], r_smem.at[slot], r_bar.at[slot])
        if own:             # P = 2: the peer's tile into the slot after the two staging ones
            plgpu.copy_gmem_to_smem(recv_mine.at[1 - me, rows], w_smem.at[2], r_bar.at[0])
        else:
            first_loads(load, r_smem, p)
        return load

    def sources(i):
        """own_from_smem: source j of tile i → (its slot in w_smem, its wait)."""
        return own_or_peer(me, i, r_bar.at[0]) if own else None

    def decode(i, load):
        out_rows = pl.ds(tile(i) * ROWS, ROWS)
        if cfg.store_parts:
            if tma_out:        # as below: the last result store has read y_smem
                plgpu.wait_smem_to_gmem(n_wire, wait_read_only=True)
            dst = y_smem if tma_out else y_mine.at[out_rows]

            def emit(part, value):
                registers.store_part(dst, part, parts, value.astype(out_dtype))
            sum_tiles(load, r_wire, r_bar, tiles, c_smem, p, vec, parts, ablate, emit=emit,
                       sources=sources(i))
            if tma_out:
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(y_smem, y_mine.at[out_rows])
            return
        totals = sum_tiles(load, r_wire, r_bar, tiles, c_smem, p, vec, parts, ablate,
                            sources=sources(i))
        values = [t.astype(out_dtype) for t in totals]
        if tma_out:
            # the last result store has read y_smem (only the wire stores issued after it
            # may still be reading their staging)
            plgpu.wait_smem_to_gmem(n_wire, wait_read_only=True)
            registers.store_values(y_smem, values)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(y_smem, y_mine.at[out_rows])
        else:
            registers.store_values(y_mine.at[out_rows], values)

    @pl.when(count > 0)
    def _():
        load_x(0)

        @pl.loop(0, count)
        def _(i):
            if x_slots == 2:
                prefetch(i)
            encode_and_push(i)

            @pl.when(i > 0)
            def _():
                # all but this step's wire stores complete: tile i − 1 has landed
                landed(n_wire)
                decode(i - 1, arrive(i - 1))

        plgpu.wait_smem_to_gmem(0)
        decode(count - 1, arrive(count - 1))
        plgpu.wait_smem_to_gmem(0)


def _scratch(p, tiles, in_dtype, out_dtype, cfg, remote: bool):
    """The kernel's scratch, in `_kernel_body`'s order (None: not used; a tuple: the
    shared-memory copies of the tile codec's operands)."""
    lines = ROWS * tiles.row_bytes // LINE
    x_slots = cfg.x_slots or tiles.x_slots(in_dtype)
    tma_out = jnp.dtype(out_dtype).itemsize == 2 and cfg.out_store == "tma"
    return [
        plgpu.SMEM((x_slots, ROWS, BLOCK), in_dtype, transforms=tiles.x_transforms(in_dtype)),
        tiles.staging(in_dtype),
        # wire staging: tile i is staged while tile i − 1's stores still read the other slot
        # (own_from_smem: and while it is decoded; a third slot receives the peer's tile)
        plgpu.SMEM((3 if cfg.own_from_smem else 2, lines, LINE), jnp.uint8),
        # both wire tiles resident at P = 2; above, the tiles stream through the two slots
        None if cfg.own_from_smem else plgpu.SMEM((2, lines, LINE), jnp.uint8),
        (plgpu.SMEM((ROWS, BLOCK), out_dtype, transforms=registers.swizzled(out_dtype))
         if tma_out else None),
        tuple(plgpu.SMEM(a.shape, a.dtype, transforms=t) for a, t in tiles.operands(in_dtype)),
        plgpu.Barrier(num_barriers=2), plgpu.Barrier(), plgpu.Barrier(num_barriers=2),
        (plgpu.SemaphoreType.REGULAR((p,)) if remote else None),
    ]


def smem_bytes(p: int, codec, in_dtype, out_dtype=None, cfg: FusedConfig | None = None):
    """Shared memory one program of the kernel takes: the buffers `_scratch` allocates for
    this configuration, each rounded up to 1 KiB (Pallas' shared-memory alignment, what a
    swizzled TMA buffer needs), plus 1 KiB for the barriers, for `FusedConfig.per_sm`'s
    check."""
    out_dtype = in_dtype if out_dtype is None else out_dtype
    return buffer_bytes(_scratch(p, tile_codec.for_codec(codec), in_dtype, out_dtype,
                                  cfg or FusedConfig(), False)) + 1024      # barriers


def _check_resident(p, codec, in_dtype, out_dtype, cfg):
    need = cfg.per_sm * (smem_bytes(p, codec, in_dtype, out_dtype, cfg) + SMEM_RESERVED)
    if need > SMEM_PER_SM:
        raise ValueError(
            f"FusedConfig(per_sm={cfg.per_sm}, x_slots={cfg.x_slots}, "
            f"out_store={cfg.out_store!r}): {cfg.per_sm} programs need {need // 1024} KiB "
            f"of shared memory per multiprocessor at P={p}, {jnp.dtype(in_dtype).name}; "
            f"it has {SMEM_PER_SM // 1024} KiB")


def _launch(blocks, codec, out_dtype, peers, cfg, mat=None):
    """blocks: (n_rows, 256) or, in loopback, (P, n_rows, 256); n_rows % 64 == 0."""
    p = peers.p
    if cfg.ablate not in ABLATIONS:
        raise ValueError(f"FusedConfig(ablate={cfg.ablate!r}) is the two-shot kernel's "
                         f"measurement knob, not the one-shot's")
    options = tile_codec.for_codec(codec).options
    if cfg.decode == "sum_first" and "sum_first" not in options:
        raise ValueError(f"FusedConfig(decode='sum_first'): {codec.name} has no transform "
                         f"to sum before (the FP8 codecs have)")
    if cfg.encode_parts != 1 and "encode_parts" not in options:
        raise ValueError(f"FusedConfig(encode_parts={cfg.encode_parts}): {codec.name}'s "
                         f"encode has no column passes (the FP8 codecs' has)")
    chosen = {"sum_first": cfg.decode == "sum_first", "encode_parts": cfg.encode_parts}
    tiles = tile_codec.for_codec(codec, **{k: v for k, v in chosen.items() if k in options})
    if cfg.own_from_smem and p != 2:
        raise ValueError(f"FusedConfig(own_from_smem=True) covers P = 2, not P={p} (above 2 "
                         f"the wire tiles stream through two receive slots)")
    in_dtype = blocks.dtype
    if cfg.warp_specialized:
        return launch_ws(blocks, tiles, out_dtype, peers, cfg, mat)
    _check_resident(p, codec, in_dtype, out_dtype, cfg)
    scratch = _scratch(p, tiles, in_dtype, out_dtype, cfg, isinstance(peers, Remote))
    return call(_kernel_body, blocks, tiles, out_dtype, peers, cfg, scratch, mat)


# -- wrappers ------------------------------------------------------------------------------------
def unsupported(codec, p: int, dtype) -> str | None:
    """Why the one-launch kernels do not cover this all-reduce (None: they do; the one-shot
    and the two-shot cover the same calls): the codecs with a tile codec that covers dtype
    (`tile_codec.unsupported`: the Hadamard FP8 codecs with B = 256, echo4), P = 2..8."""
    if not 2 <= p <= MAX_P:
        return f"P={p} devices (the kernel covers 2..{MAX_P})"
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in IN_DTYPES]:
        return f"{jnp.dtype(dtype).name} data (covered: bfloat16, float16, float32)"
    return tile_codec.unsupported(codec, dtype)


def check(codec, p, dtype, where):
    why = unsupported(codec, p, dtype)
    if why is not None:
        raise ValueError(f"{where}: {why}")


def _tiles(flat):
    """(…, n) → ((…, n_rows, 256) blocks, n_rows % 64 == 0): zero blocks decode to zeros
    and are sliced off."""
    n = flat.shape[-1]
    n_rows = -(-max(n, 1) // (ROWS * BLOCK)) * ROWS
    pad = n_rows * BLOCK - n
    if pad:
        flat = jnp.pad(flat, [(0, 0)] * (flat.ndim - 1) + [(0, pad)])
    return flat.reshape(*flat.shape[:-1], n_rows, BLOCK)


def one_shot_allreduce(x, axis: str, p: int, codec, *, out_mat=None,
                    cfg: FusedConfig | None = None):
    """Σ over the P members of mesh axis `axis` of decode(encode(x_j)), in device order:
    the compressed one-shot all-reduce in one kernel. Call inside `jax.shard_map` on GPUs
    of one process whose mesh lists devices 0..n−1 in order.

    Args:
      x: this device's bf16, f16 or f32 array (any shape; f32 is encoded from bf16).
      axis: one mesh axis name; peers are addressed by it, other axes keep this device's
        coordinates.
      p: the axis size (2..8).
      codec: a codec whose tile codec covers x's dtype (`tile_codec.unsupported`): a
        Hadamard FP8 codec with B = 256 or echo4 (B = 128).
      out_mat: the result's `manual_axis_type` under check_vma (None without).
      cfg: launch shape (`FusedConfig`; None: `default_config`).
    Returns: an array of x's shape and dtype, the same bits on every device.
    Raises: ValueError naming what is not covered."""
    check(codec, p, x.dtype, "one_shot_allreduce")
    cfg = cfg or default_config(codec, p, x.dtype)
    if x.size == 0:
        return x
    blocks = _tiles(x.reshape(-1))
    peers = Remote(axis, p, cfg.grid(blocks.shape[0] // ROWS, 1))
    y = _launch(blocks, codec, x.dtype, peers, cfg, out_mat)
    return from_blocks(y, x.shape)


@functools.partial(jax.jit, static_argnames=("codec", "cfg"))
def one_shot_loopback(xs, codec, cfg: FusedConfig | None = None):
    """The same kernel on one GPU for P = xs.shape[0] virtual devices: xs[d] is device d's
    input; returns (P, …): row d is what device d computes (all rows equal when correct).
    Raises ValueError as `one_shot_allreduce`."""
    p = xs.shape[0]
    check(codec, p, xs.dtype, "one_shot_loopback")
    cfg = cfg or default_config(codec, p, xs.dtype)
    if xs.size == 0:
        return xs
    blocks = _tiles(xs.reshape(p, -1))
    peers = Loopback(p, cfg.grid(blocks.shape[1] // ROWS, p))
    y = _launch(blocks, codec, xs.dtype, peers, cfg)
    return jax.vmap(lambda v: from_blocks(v, xs.shape[1:]))(y)


def one_shot_reference(xs, codec):
    """Plain jnp: (P, …) → Σ_j decode(encode(xs[j])) in f32, j in order, in xs's dtype
    (what the kernel encodes: for the FP8 codecs f32 inputs from bf16, for echo4 as they
    are; its tile codec's `encoded`).

    The contract the kernel keeps with it: each element within one code step of the codec
    (an FP8 step for the FP8 codecs: `reference_steps`), with the same error against the
    exact sum; not the same bits, for any input dtype (on the H200 f32 input was seen one
    FP8 step apart in some elements: the kernel transforms f32 as two bf16 tiles, and its
    default decode sums the sources before one butterfly, in another order than this
    sum). `reference_mismatch` checks a result against it."""
    tiles = tile_codec.for_codec(codec)
    acc = None
    for j in range(xs.shape[0]):
        v = tiles.encoded(xs[j])
        blocks = to_blocks(v, codec.block_size)
        dec = codec.decompress_reference(codec.compress_reference(blocks)).astype(jnp.float32)
        acc = dec if acc is None else acc + dec
    return from_blocks(acc, xs.shape[1:]).astype(xs.dtype)


def reference_steps(xs, codec):
    """(P, …) → (…) f32: per element of the result, one code step of the codec in value
    terms, the largest over the P devices' blocks (its tile codec's `code_step` of each
    device's wire, as `one_shot_reference` encodes it)."""
    tiles = tile_codec.for_codec(codec)
    steps = None
    for j in range(xs.shape[0]):
        wire = codec.compress_reference(to_blocks(tiles.encoded(xs[j]), codec.block_size))
        step = jnp.broadcast_to(tiles.code_step(wire), (wire.shape[0], codec.block_size))
        steps = step if steps is None else jnp.maximum(steps, step)
    return from_blocks(steps, xs.shape[1:])


def reference_mismatch(got, xs, codec, err_rtol: float = 0.01) -> str | None:
    """Does `got`, a result of the kernel on inputs xs (P, …), break its contract with
    `one_shot_reference` (None: it keeps it)? NaN where the reference has NaN,
    elsewhere |got − reference| at most one code step (`reference_steps`), and the error
    against the exact sum within err_rtol of the reference's (relative, root of the summed
    squares).

    Returns: None, or what breaks the contract (counts, the worst element)."""
    want = np.asarray(one_shot_reference(xs, codec))
    got = np.asarray(got)
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"result {got.shape} {got.dtype}, reference {want.shape} {want.dtype}"
    nan = np.isnan(want)
    if not np.array_equal(np.isnan(got), nan):
        return "NaN where the reference has none, or a value where it has NaN"
    steps = np.asarray(reference_steps(xs, codec), np.float64)
    ratio = np.where(nan, 0.0, np.abs(got.astype(np.float64) - want) / steps)
    worst = int(np.argmax(ratio))
    if ratio.flat[worst] > 1 + 2.0 ** -16:            # one step, up to its f32 rounding
        return (f"{int(np.sum(ratio > 1))} elements more than one code step from the "
                f"reference (the worst, #{worst}, by {float(ratio.flat[worst]):.3g} steps)")
    exact = np.sum(np.asarray(xs, np.float64), axis=0)
    errs = [np.sqrt(np.sum(np.where(nan, 0.0, v - exact) ** 2) / np.sum(
        np.where(nan, 0.0, exact) ** 2)) for v in (got.astype(np.float64), want)]
    if abs(errs[0] - errs[1]) > err_rtol * errs[1]:
        return (f"error against the exact sum {errs[0]:.4g}, the reference's {errs[1]:.4g} "
                f"(more than {err_rtol} apart, relative)")
    return None
