"""What the fused kernel bodies share around their tile codec (`kernels.tile_codec`): the
P-way decode and sum of wire tiles (`sum_tiles`, with `first_loads` and `own_or_peer`
saying where its sources are) and the staging of an input tile that the tile codec encodes
from a converted copy (`stage_f32`)."""
from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from taco_jax.kernels.mosaic import registers
from taco_jax.kernels.tile_codec import BLOCK, LINE, ROWS  # noqa: F401  (the kernels' tile)


def own_or_peer(me, i, peer_bar):
    """P = 2, this device's tile decoded from its staging (own_from_smem): `sum_tiles`'
    sources for tile i: source j → (its wire slot: staging i % 2 for this device's, 2 for
    the peer's; a callable that waits for it: the peer's copy on peer_bar, nothing for this
    device's)."""
    def where(j):
        mine = (me == j).astype(jnp.int32)

        def wait():
            @pl.when(me != j)
            def _():
                plgpu.barrier_wait(peer_bar)
        return mine * (i % 2) + (1 - mine) * 2, wait
    return where


def first_loads(load, r_smem, n_src):
    """The copies `sum_tiles` starts with: every tile when all n_src fit, else the
    first's."""
    for j in range(n_src if n_src <= r_smem.shape[0] else 1):
        load(j, j)


def _zeros(vec: int, parts: int):
    """A column part of zeros in the decode's value layout (the "no_decode" knob)."""
    layout = registers.pallas_layout(registers.wire_tiled(vec, BLOCK // parts))
    return plgpu.layout_cast(jnp.zeros((ROWS, BLOCK // parts), jnp.float32), layout)


def sum_tiles(load, r_smem, r_bar, tiles, consts, n_src, vec, parts, ablate="none",
               emit=None, sources=None):
    """Σ_j decode(wire tile j), j = 0 … n_src − 1 in that order, summed in f32: `parts`
    arrays. load(j, slot) starts the TMA copy of source j's wire tile into r_smem[slot]
    (arriving on r_bar[slot]); the first copies were started by `first_loads`. When every source has
    a slot each tile is read once; else (P > 2, to fit shared memory) the tiles stream
    through 2 slots once per column part, the next copy issued as soon as the previous
    occupant of its slot is in registers. ablate "decode_twice" / "no_decode": each tile
    decoded twice / not at all (zeros returned); the copies and their waits are the same.
    `tiles`: the tile codec, `consts` its operands in shared memory. emit(part, values):
    called with each part as soon as its sources are summed (the parts then returned are
    None), so a finished part is not held while the next is decoded. sources(j) → (slot,
    wait): where source j's tile is in r_smem (a traced index) and a callable that waits for
    it (FusedConfig.own_from_smem: this device's tile in its staging slot, no copy to wait
    for); None: source j in slot j, on r_bar[j] (or streamed, as above)."""
    row = tiles.row_bytes
    resident = sources is not None or n_src <= r_smem.shape[0]
    seq = [(part, j) for part in range(parts) for j in range(n_src)]
    slot_of = (lambda e: seq[e][1]) if resident else (lambda e: e % 2)   # noqa: E731
    reps = {"decode_twice": 2, "no_decode": 0}.get(ablate, 1)
    totals = [None] * parts
    for e, (part, j) in enumerate(seq):
        if sources is not None:
            slot, wait = sources(j)
            if part == 0:
                wait()
        else:
            slot = slot_of(e)
            if not resident or part == 0:
                plgpu.barrier_wait(r_bar.at[slot])
        for rep in range(max(reps, 1)):
            if reps:
                wire = tiles.load(r_smem.at[slot].reshape(ROWS, row), part, parts)
            if rep == 0 and not resident and e + 1 < len(seq):
                load(seq[e + 1][1], (e + 1) % 2)   # the slot's last reader is done (loads sync)
            if not reps:
                continue
            totals[part] = tiles.decode_add(wire, consts, vec, part, parts, totals[part])
        if emit is not None and j == n_src - 1:
            t = totals[part]
            emit(part, _zeros(vec, parts) if t is None else tiles.finish(t, vec, parts))
            totals[part] = None
    if emit is not None:
        return [None] * parts
    return [_zeros(vec, parts) if t is None else tiles.finish(t, vec, parts) for t in totals]


def stage_f32(src, xb_smem, refill=None):
    """The tile a kernel encodes: src itself, or for f32 input (xb_smem not None) its bf16
    copy in xb_smem, the transform's operand. refill (one input slot): called once every
    warp has read src, to start the next tile's copy into its slot; commit_smem ends in a
    warpgroup barrier, whereas a TMA issued right after this thread's own loads could
    overwrite the slot under a slower warp's."""
    if xb_smem is None:
        return src
    v = plgpu.load(src, layout=plgpu.Layout.WGMMA, optimized=False)
    xb_smem[...] = v.astype(xb_smem.dtype)
    plgpu.commit_smem()
    if refill is not None:
        refill()
    return xb_smem
