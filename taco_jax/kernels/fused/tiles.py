"""Tile codecs: what the fused kernels need of a codec, on tiles of 64 rows of 256 values
(a tile row's wire bytes, the constant operands kept in shared memory, encode a tile and
store its wire, load a wire tile and decode-and-add a column part of it in f32):
`TacoTiles` (the Hadamard FP8 codecs, `mosaic.taco_tiles`) and `Echo4Tiles` (echo4,
`mosaic.echo4`). Also what the kernel bodies share around them: the P-way decode and
sum of wire tiles (`sum_tiles`) and the bf16 staging of f32 input (`stage_f32`)."""
from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith

from taco_jax import _jax_private
from taco_jax.kernels.mosaic import echo4 as mosaic_echo4, registers, taco_tiles
from taco_jax.numerics import quant

ROWS, BLOCK, LINE = registers.ROWS, registers.BLOCK, 256


# -- tile codecs: a codec's math on a tile, for the one kernel body ----------------------------
# The one-shot kernel's protocol (stores, signals, sums) is codec-blind; what it needs of a
# codec is a tile codec: the wire bytes of a tile row (64 rows of 256 values per tile), the
# constant operands it keeps in shared memory, encode a tile of values and store its wire,
# load a wire tile and decode-and-add one column part of it in f32.
@dataclasses.dataclass(frozen=True)
class TacoTiles:
    """The Hadamard FP8 codecs with B = 256 (taco, taco-e5m2, taco-1scale): a block per tile
    row, taco_tiles.py's tile math (wgmma transform; f32 input is encoded from bf16).
    `checked_on_gpu`: the one-launch kernels whose loopback checks pass on a GPU with it, so
    that the collectives may select them."""
    codec: object
    # FusedConfig.decode == "sum_first": decode_add keeps the running sum before the
    # butterfly (the wgmma accumulators scaled by their gains) and `finish` completes it.
    sum_first: bool = False
    encode_parts: int = 1                  # FusedConfig.encode_parts
    checked_on_gpu = frozenset({"one_shot", "two_shot"})

    @property
    def row_bytes(self) -> int:
        return self.codec.row_bytes

    def unsupported(self, dtype) -> str | None:
        enc = jnp.bfloat16 if jnp.dtype(dtype) == jnp.float32 else dtype
        return (taco_tiles.unsupported("compress", self.codec, (ROWS, BLOCK), enc)
                or taco_tiles.unsupported("decompress", self.codec, (ROWS, BLOCK), dtype))

    def staged(self, in_dtype) -> bool:
        """f32 input goes through a bf16 copy in shared memory (the wgmma's operand)."""
        return jnp.dtype(in_dtype) == jnp.float32

    def x_transforms(self, in_dtype) -> tuple:
        return () if self.staged(in_dtype) else taco_tiles.SMEM_TRANSFORMS

    def x_slots(self, in_dtype) -> int:
        return 1 if self.staged(in_dtype) else 2

    def operands(self, in_dtype) -> tuple:
        """(encode factor, decode factor), each with its SMEM transforms."""
        enc = jnp.bfloat16 if self.staged(in_dtype) else in_dtype
        return ((taco_tiles.hadamard_operand("encode", enc), taco_tiles.SMEM_TRANSFORMS),
                (taco_tiles.hadamard_operand("decode"), taco_tiles.SMEM_TRANSFORMS))

    def encode(self, x_smem, consts):
        return taco_tiles.encode_tile(x_smem, consts[0], self.codec, self.encode_parts)

    def store(self, view, wire):
        taco_tiles.store_wire_tile(view, *wire)

    def load(self, view, part: int, parts: int):
        del part, parts                    # the whole tile: a part's wgmma reads every code
        return taco_tiles.load_wire_tile(view, self.codec)

    def decode_add(self, wire, consts, vec: int, part: int, parts: int, total=None):
        codes, scales = wire
        fmt = taco_tiles.CODE_FORMATS[self.codec.fmt]
        q = [lax.bitcast_convert_type(codes[:, 16 * c:16 * (c + 1)], fmt)
             .astype(jnp.float16) for c in range(registers.FACTOR)]
        acc = taco_tiles.transform_part(lambda c: q[c], consts[1], part, parts)
        rest = () if total is None else (total,)
        if self.sum_first:
            return _gain_add_fn(self.codec, parts, total is None)(acc, scales, *rest)
        return _decode_add_fn(self.codec, vec, parts, total is None)(acc, scales, *rest)

    def finish(self, total, vec: int, parts: int):
        """decode_add's running sum of a column part → its values (value layout)."""
        return _finish_fn(vec, parts)(total) if self.sum_first else total

    def encoded(self, v):
        """What the kernel encodes of input v (for the references)."""
        return v.astype(jnp.bfloat16) if v.dtype == jnp.float32 else v

    # -- the owner's sum of the two-shot kernel: its exact tile plus decoded wire tiles, in
    # f32, encoded once. Summed as the transform's coefficients (`taco_tiles.coefficients`):
    # a wire tile adds q·gain per code, with no transform, and the sum is quantized as it
    # is (no transform back and forth).
    def own_scratch(self, in_dtype) -> tuple:
        """The owner's exact tile (its TMA copy) and, for f32 input, its split into two bf16
        tiles (the transform's operands)."""
        own = plgpu.SMEM((ROWS, BLOCK), in_dtype, transforms=self.x_transforms(in_dtype))
        if not self.staged(in_dtype):
            return (own,)
        return (own, plgpu.SMEM((2, ROWS, BLOCK), jnp.bfloat16,
                                transforms=taco_tiles.SMEM_TRANSFORMS))

    def sum_init(self, own, consts):
        """The owner's exact tile → its coefficients (f32). For f32 input the tile is held
        as two bf16 tiles, its rounding and the remainder; the transform is linear, so both
        go through one wgmma accumulator (to ~2⁻¹⁶ of the value, far below FP8's step)."""
        x_smem = own[0]
        if len(own) == 1:
            acc = taco_tiles.transform_part(
                lambda sl: x_smem.at[:, pl.ds(registers.FACTOR * sl, registers.FACTOR)],
                consts[0], 0, 1)
            return taco_tiles.coefficients(acc, self.codec)
        hl = own[1]
        v = plgpu.load(x_smem, layout=plgpu.Layout.WGMMA, optimized=False)
        hi = v.astype(jnp.bfloat16)
        hl[0] = hi
        hl[1] = (v - hi.astype(jnp.float32)).astype(jnp.bfloat16)
        plgpu.commit_smem()
        b = taco_tiles.factor_cols(consts[0], 0, 1)
        f = registers.FACTOR

        def run(acc):
            for sl in range(f):
                for h in range(2):
                    plgpu.wgmma(acc.at[:, pl.ds(f * sl, f)], hl.at[h].at[:, pl.ds(f * sl, f)], b)
            plgpu.wgmma_wait(0)
            return acc[...]
        acc = pl.run_scoped(run, plgpu.ACC((ROWS, BLOCK), jnp.float32))
        return taco_tiles.coefficients(acc, self.codec)

    def sum_load(self, view):
        """A wire tile (a (64, row_bytes) view) → registers, as `sum_add` takes it."""
        return taco_tiles.load_wire_codes(view, self.codec)

    def sum_add(self, total, wire, consts):
        del consts
        return taco_tiles.add_coefficients(*wire, self.codec, total)

    def sum_encode(self, total):
        """The sum → its wire (as `store` takes it)."""
        return taco_tiles.encode_coefficients(total, self.codec)

    def decode(self, view, consts, out_dtype, parts: int):
        """A wire tile → its values in out_dtype: `parts` column parts (value layout)."""
        codes, scales = taco_tiles.load_wire_tile(view, self.codec)
        return taco_tiles.decode_tile(codes, scales, consts[1], self.codec, out_dtype, parts)

    def code_step(self, wire):
        """(rows, row_bytes) wire rows → (rows, 1) f32: the most that one step of one code
        of a row moves a decoded value (the code format's spacing at Qmax, times s, over
        α·√B where the row is transformed; for the reference checks)."""
        c = self.codec
        dtype = jnp.dtype(c.code_dtype)
        spacing = (1.0 if jnp.issubdtype(dtype, jnp.integer) else
                   2.0 ** (np.floor(np.log2(c.qmax)) - jnp.finfo(dtype).nmant))
        scales = quant.unpack_scales(wire[:, c.block_size:], c.n_scales)
        step = scales[0] * np.float32(spacing)
        if c.transform != "none":
            step = step * np.float32(1 / np.sqrt(c.block_size))
        return step / scales[1] if c.transform == "ash" else step


@dataclasses.dataclass(frozen=True)
class Echo4Tiles:
    """echo4 (groups of 128, 4-bit codes): two groups per tile row, a tile row's wire their
    two codec rows (144 bytes), `mosaic_echo4`'s register math; no constant operands, input
    of any covered dtype encoded as it is (f32 too, as the codec does). Its loopback checks
    pass on an H200 with the one-shot kernel (P = 2, 4, 8; bf16, f32; 1 KiB to 64 MiB;
    fused_echo4_checks.json) and the two-shot (P = 3..8; bf16, f16, f32; 1 KiB to 1 GiB;
    fused_two_shot_checks.json)."""
    codec: object
    checked_on_gpu = frozenset({"one_shot", "two_shot"})

    @property
    def row_bytes(self) -> int:
        return mosaic_echo4.row_bytes(self.codec)

    def unsupported(self, dtype) -> str | None:
        why = mosaic_echo4.unsupported(self.codec)
        if why is None and jnp.dtype(dtype) not in map(jnp.dtype, mosaic_echo4.IN_DTYPES):
            why = f"{jnp.dtype(dtype).name} data (covered: bfloat16, float16, float32)"
        return why

    def staged(self, in_dtype) -> bool:
        return False

    def x_transforms(self, in_dtype) -> tuple:
        return ()                          # read into registers by plain loads

    def x_slots(self, in_dtype) -> int:
        return 2

    def operands(self, in_dtype) -> tuple:
        return ()

    def encode(self, x_smem, consts):
        return mosaic_echo4.encode_tile(x_smem)

    def store(self, view, wire):
        mosaic_echo4.store_wire_tile(view, wire)

    def load(self, view, part: int, parts: int):
        return mosaic_echo4.load_wire_tile(view, part, parts)

    def decode_add(self, wire, consts, vec: int, part: int, parts: int, total=None):
        return mosaic_echo4.decode_add(wire, vec, total)

    def finish(self, total, vec: int, parts: int):
        return total

    def encoded(self, v):
        return v

    # -- the owner's sum of the two-shot kernel (as TacoTiles'), in values: f32 in the value
    # layout of 4-element vectors, encoded from f32 as the codec does
    def own_scratch(self, in_dtype) -> tuple:
        return (plgpu.SMEM((ROWS, BLOCK), in_dtype),)

    def sum_init(self, own, consts):
        del consts
        return plgpu.load(own[0], layout=registers.value_layout(jnp.float32),
                          optimized=False).astype(jnp.float32)

    def sum_load(self, view):
        return mosaic_echo4.load_wire_tile(view)

    def sum_add(self, total, wire, consts):
        del consts
        return mosaic_echo4.decode_add(wire, registers.value_vec(jnp.float32), total)

    def sum_encode(self, total):
        return mosaic_echo4.encode_values(total)

    def decode(self, view, consts, out_dtype, parts: int):
        vec = registers.value_vec(out_dtype)
        return [mosaic_echo4.decode_add(mosaic_echo4.load_wire_tile(view, part, parts), vec)
                .astype(out_dtype) for part in range(parts)]

    def code_step(self, wire):
        """As `TacoTiles.code_step`: one step of the 4-bit grid is its scale s."""
        return quant.unpack_scales(wire[:, self.codec.block_size // 2:], 2)[0]


def tile_codec(codec):
    """The tile codec of `codec`: Echo4Tiles for echo4, else TacoTiles (whose `unsupported`
    says whether it covers the codec)."""
    if mosaic_echo4.unsupported(codec) is None:
        return Echo4Tiles(codec)
    return TacoTiles(codec)


# -- decode and add, in registers ---------------------------------------------------------------
@functools.cache
def _decode_add_fn(codec, vec: int, parts: int, first: bool):
    """One column part of a decoded tile (f32, value layout of `vec`-element vectors), plus
    the running sum of the previous devices' (unless first): taco_tiles.decode_tile's math
    without its final cast, so P tiles sum in f32 in one register array. Built from
    taco_tiles.py's register helpers (`_assemble`, `_transformed`, …): its public decode_tile
    returns every part of a tile at once, cast, which would hold two f32 tiles in
    registers while summing."""
    layout = registers.pallas_layout(registers.wire_tiled(vec, BLOCK // parts))
    out = plgpu.ShapeDtypeStruct((ROWS, BLOCK // parts), jnp.float32, layout)
    args = (plgpu.Layout.WGMMA, taco_tiles.scale_layout(codec)) + (() if first else (layout,))

    @plgpu.inline_mgpu(arg_types=args, return_type=out)
    def decode_add(ctx, acc, sbytes, total=None):
        del ctx
        vals = taco_tiles.assemble(taco_tiles.transformed(acc), vec, ir.F32Type.get(),
                                taco_tiles.row_gains(codec, sbytes, 2))                # eq. 12
        return vals if total is None else total + vals
    return decode_add


@functools.cache
def _gain_add_fn(codec, parts: int, first: bool):
    """decode="sum_first": a tile's wgmma accumulator for one column part (WGMMA layout,
    before the butterfly), each row times its gain, plus the running sum (unless first)."""
    wgmma = plgpu.Layout.WGMMA
    out = plgpu.ShapeDtypeStruct((ROWS, BLOCK // parts), jnp.float32, wgmma)
    args = (wgmma, taco_tiles.scale_layout(codec)) + (() if first else (wgmma,))

    @plgpu.inline_mgpu(arg_types=args, return_type=out)
    def gain_add(ctx, acc, sbytes, total=None):
        del ctx
        gains = taco_tiles.row_gains(codec, sbytes, 2)
        regs = acc.registers.reshape(-1, 2)                  # [column group, row half]
        prev = None if total is None else total.registers.reshape(-1, 2)
        res = np.empty_like(regs)
        for c, i in np.ndindex(regs.shape):
            v = arith.mulf(regs[c, i], gains[i])
            res[c, i] = v if prev is None else arith.addf(prev[c, i], v)
        return _jax_private.fragmented_array(res.reshape(acc.registers.shape), acc.layout,
                                             is_signed=None)
    return gain_add


@functools.cache
def _finish_fn(vec: int, parts: int):
    """decode="sum_first": the gain-scaled sum of the P accumulators → the butterfly and
    assembly of `_decode_add_fn`, once (value layout of `vec`-element vectors)."""
    layout = registers.pallas_layout(registers.wire_tiled(vec, BLOCK // parts))
    out = plgpu.ShapeDtypeStruct((ROWS, BLOCK // parts), jnp.float32, layout)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,), return_type=out)
    def finish(ctx, total):
        del ctx
        return taco_tiles.assemble(taco_tiles.transformed(total), vec, ir.F32Type.get())
    return finish


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
