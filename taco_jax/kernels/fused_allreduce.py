"""The compressed one-shot all-reduce in one Pallas Mosaic GPU kernel (Hopper).

Each device encodes its tensor tile by tile, stores every wire tile (codes and scales)
into its own and every peer's receive buffer, signals the peers per tile, and, as the
tiles of every device arrive, decodes them and sums them in device order (0, 1, …,
P − 1) in f32: one quantization per element, the same bytes decoded in the same order on
every device, so every device gets the same bits. The result equals
`two_shot.one_shot` (compress → all-gather → `decode_sum`, three launches) up to the
encoder's rounding (`mosaic.encode_tile` vs the Triton compress).

One kernel body for every codec it covers: what it needs of a codec is a tile codec
(`tile_codec`: a tile row's wire bytes, constant operands in shared memory, encode and
store a tile, load and decode-and-add a column part): `TacoTiles` (the Hadamard FP8 codecs,
mosaic.py's tile math) and `Echo4Tiles` (echo4, `mosaic_echo4`: two groups of 128 per tile
row). A tile codec's `checked_on_gpu` says whether its loopback checks have passed on a
GPU; the collectives select the kernel only for those (both have: `python -m bench.fused`,
bench/results/fused_loopback.json and fused_echo4_checks.json).

And two ways to address a peer (`Remote`, `Loopback`):

  * `Remote`: inside `jax.shard_map`, one device per mesh member along `axis`; a peer's
    receive buffer is `plgpu.remote_ref(recv, {axis: peer})` (addressed by axis name, so
    any other mesh axes keep this device's own coordinates), the semaphores are per
    program and signalled on the peer. XLA zeroes them and runs a cross-device barrier
    before the kernel, so no store reaches a peer whose previous call still reads.
  * `Loopback`: P virtual devices on one GPU are P groups of programs of one kernel; a
    peer's receive buffer is a slice of one (P, …) buffer and the semaphores are one
    global array indexed (receiver, sender, program). It runs the same protocol, tile
    math and stores, so correctness and compute cost are checkable on one GPU; the link,
    XLA's barrier and remote TMA descriptors are not.

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
codecs' 16-bit input.

`FusedConfig.decode="sum_first"` (FP8 codecs): the inverse transform is linear and each
row's gain a scalar, so Σ_j gain_j·H(q_j) = H(Σ_j gain_j·(q_j's wgmma part)): each tile's
wgmma accumulator is scaled by its gains and summed, and the butterfly and assembly run
once per column part instead of once per source (f32 throughout; the sum's rounding order
differs from the per-source decode's).

`FusedConfig.store_parts`: each column part of the sum is converted and stored as soon as
its P tiles are summed, so a finished part is not held in registers while the next one is
decoded (the same values). With sum_first it is the FP8 codecs' default (`FP8_DECODE`).

`FusedConfig.own_from_smem` (P = 2): this device's own wire tile is decoded from the
shared-memory staging it was encoded into, one step later, instead of being stored to its
own receive slot and loaded back (per device, 2 × the wire's bytes less HBM traffic; the
staging slots become three, the receive slots none). The FP8 codecs' default at P = 2
(measured, see `default_config`).

`FusedConfig.warp_specialized` (P = 2, the FP8 codecs' 16-bit input, the default there): one
program per multiprocessor of four warpgroups, two tile streams; in each, a math warpgroup
encodes, stages and decodes, and a transport warpgroup stores the staged tile to the peer,
waits for it to land, signals, waits for the peer's signal and loads the peer's tile, the
two handing tiles over through shared-memory barriers (`_ws_body`). The system-scope fence
of each signal, the semaphore spin and the peer tile's load latency leave the math's path,
and the peer's tile i − 1 is loaded while tile i is encoded. Registers move to the math
(setmaxnreg: 224 a thread there, 32 in transport).

`FusedConfig.ablate` is a measurement knob (`ABLATIONS`: a stage of the per-tile work left
out or done twice; wrong results) for `python -m bench.fused --ablate`, which times the
variants side by side to attribute the kernel's time.

The two-shot for P ≥ 3 in one kernel is `fused_two_shot`'s (these peers, tile math and
configuration).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, vector

from taco_jax import _jax_private, codecs
from taco_jax.kernels import mosaic, mosaic_echo4

ROWS, BLOCK, LINE = mosaic.ROWS, mosaic.BLOCK, 256
IN_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
MAX_P = 8


# -- configuration ----------------------------------------------------------------------------
# Measurement knobs (`FusedConfig.ablate`): each leaves one stage of the per-tile work out
# or does it twice, so variants timed side by side attribute the kernel's time
# (`python -m bench.fused --ablate`). With any of them but "none" the results are wrong.
ABLATIONS = {
    "none": "the kernel as it is",
    "encode_twice": "each tile encoded and staged twice",
    "no_encode": "no encode: the staging buffer's bytes as they are go out",
    "decode_twice": "each wire tile read from shared memory, transformed and decoded twice",
    "no_decode": "wire tiles loaded and waited for, not decoded: zeros stored",
    "no_peer_stores": "each tile stored into this device's own slot only",
    "no_signal": "no semaphore signal or wait (stores still waited for)",
    "no_sync": "no semaphore signal or wait, no wait for the stores to land",
}
SMEM_PER_SM = 228 * 1024     # Hopper: shared memory per multiprocessor …
SMEM_RESERVED = 1024         # … of which each resident program's runtime takes this


@dataclasses.dataclass(frozen=True)
class FusedConfig:
    """`programs`: programs per device (None: all that can be resident: `per_sm` per
    multiprocessor, divided by P in loopback); every program of every device must be
    resident together (a program waits for its peers' programs). `parts`: the decode's
    column passes (2 halves the registers a thread holds while P tiles are summed)."""
    programs: int | None = None
    parts: int = 2
    # Shared memory per program, so that 2 programs fit per multiprocessor (`per_sm=2`):
    # input tiles staged (None: the tile codec's: 2, double-buffered; 1 for f32 input to
    # the FP8 codecs, whose bf16 copy of the tile takes the second slot's room) and
    # "tma": 16-bit results staged in shared memory and stored by TMA, "registers":
    # stored from registers (f32 results always are).
    x_slots: int | None = None
    out_store: str = "tma"
    # Programs per multiprocessor (1 … 4): n needs each program's shared memory to fit in
    # 1/n of it (`smem_bytes`, `_check_resident`), so one program's waits can hide behind
    # the others' work.
    per_sm: int = 1
    # How the P wire tiles of a column part are decoded and summed (FP8 codecs). "per_source":
    # each tile through the whole decode (wgmma transform, butterfly, gain), the values summed
    # in f32. "sum_first": the transform is linear, so each tile's wgmma accumulator is scaled
    # by its rows' gains and summed, and the butterfly and assembly run once on the sum (the
    # same math up to f32 rounding order; P − 1 fewer butterflies per tile).
    decode: str = "per_source"
    # The encode's column passes (FP8 codecs): 1, one wgmma transform into a (64, 256) f32
    # accumulator (128 registers a thread); 2, the halves in turn (`mosaic.encode_tile`:
    # the row statistics from one half, the other quantized, the first transformed again
    # and quantized: three transforms, half the accumulator registers). The one-launch
    # kernel runs at 255 registers a thread with local-memory spills
    # (bench/results/ncu_src_fused.json), which this is meant to relieve.
    encode_parts: int = 1
    # True: each column part of the decoded sum is converted and stored as soon as its P
    # tiles are summed, before the next part is decoded; False: after every part. The
    # decode holds the whole wire tile as f16 (a part's transform reads every code), the
    # part's accumulator and its sum; a finished part kept until the end adds its 64 f32
    # registers a thread to that peak, at 255 registers with spills.
    store_parts: bool = False
    # True (P = 2): this device's own wire tile is decoded from the shared-memory staging it
    # was encoded into (kept there until its decode, one step later), not stored to its own
    # receive slot and loaded back: 2 × the wire's bytes less HBM traffic a device, one
    # receive slot less, and a warpgroup barrier per tile before the staging is rewritten.
    own_from_smem: bool = False
    # True (P = 2, 16-bit input, with own_from_smem): one program per multiprocessor of four
    # warpgroups, two tile streams each of a math warpgroup (encode, decode) and a transport
    # warpgroup (stores, landing waits, signals, the peer tile's load), handing tiles over
    # through shared-memory barriers (`_ws_body`), so that no fence, semaphore spin or load
    # latency lies on the math's path.
    warp_specialized: bool = False
    # A measurement knob (ABLATIONS), "none" in use.
    ablate: str = "none"

    def __post_init__(self):
        if self.parts not in (1, 2):
            raise ValueError(f"FusedConfig.parts={self.parts} must be 1 or 2")
        if self.programs is not None and self.programs < 1:
            raise ValueError(f"FusedConfig.programs={self.programs} must be >= 1")
        if self.x_slots not in (None, 1, 2):
            raise ValueError(f"FusedConfig.x_slots={self.x_slots} must be None, 1 or 2")
        if self.out_store not in ("tma", "registers"):
            raise ValueError(f"FusedConfig.out_store={self.out_store!r} must be 'tma' or "
                             f"'registers'")
        if self.per_sm not in (1, 2, 3, 4):
            raise ValueError(f"FusedConfig.per_sm={self.per_sm} must be 1, 2, 3 or 4")
        if not isinstance(self.own_from_smem, bool):
            raise ValueError(f"FusedConfig.own_from_smem={self.own_from_smem!r} must be True "
                             f"or False")
        if not isinstance(self.store_parts, bool):
            raise ValueError(f"FusedConfig.store_parts={self.store_parts!r} must be True or "
                             f"False")
        if self.encode_parts not in (1, 2):
            raise ValueError(f"FusedConfig.encode_parts={self.encode_parts} must be 1 or 2")
        if self.decode not in ("per_source", "sum_first"):
            raise ValueError(f"FusedConfig.decode={self.decode!r} must be 'per_source' or "
                             f"'sum_first'")
        if self.warp_specialized and not (self.own_from_smem and self.ablate == "none"
                                          and self.per_sm == 1):
            raise ValueError("FusedConfig(warp_specialized=True) needs own_from_smem=True, "
                             "per_sm=1 (one program of four warpgroups per multiprocessor) "
                             "and no ablate knob")
        if self.ablate not in ABLATIONS:
            raise ValueError(f"FusedConfig.ablate={self.ablate!r} must be one of "
                             f"{', '.join(ABLATIONS)}")

    def grid(self, n_tiles: int, devices_here: int) -> int:
        """Programs per device: ≤ per_sm × this GPU's multiprocessors / devices_here."""
        cap = max(1, self.per_sm * mosaic.sm_count() // devices_here)
        want = cap if self.programs is None else self.programs
        if want > cap:
            raise ValueError(f"FusedConfig.programs={want} exceeds the {cap} programs that "
                             f"can be resident per device ({devices_here} on this GPU, "
                             f"per_sm={self.per_sm})")
        return max(1, min(n_tiles, want))


# Two programs per multiprocessor, each with half the shared memory (one input slot, results
# stored from registers): one program's decode hides behind the other's waits. Measured at
# P = 2 in loopback, bf16 (bench/results/fused_ablation_residency.json): 31.1 / 110.4 /
# 413.5 µs per device at 16 / 64 / 256 MiB against 34.7 / 126.2 / 499.6 for FusedConfig().
SLIM_2_PER_SM = FusedConfig(x_slots=1, out_store="registers", per_sm=2)

# The FP8 codecs' decode: each column part stored once summed, and the P accumulators summed
# before one butterfly. Measured side by side at P = 2 in loopback, bf16, on SLIM_2_PER_SM
# (bench/results/fused_ablation_store.json as of commit 8aa8ef6): 27.4 / 100.5 / 386.9 µs per device at 16 / 64 /
# 256 MiB against 31.0 / 110.6 / 420.7 without either, 28.6 / 106.0 / 406.9 with store_parts
# alone, 29.9 / 108.3 / 412.4 with sum_first alone; loopback checks pass with both at P = 2,
# 4, 8, bf16 and f32 (fused_loopback_checks_p*.json).
FP8_DECODE = dict(store_parts=True, decode="sum_first")


# P = 2, the FP8 codecs: this device's tile decoded from its staging. Measured side by side
# in loopback, bf16, on SLIM_2_PER_SM + FP8_DECODE (bench/results/fused_ablation_store.json):
# 25.8 / 90.3 / 337.5 µs per device at 16 / 64 / 256 MiB against 27.4 / 101.0 / 385.5 from
# its own receive slot; loopback checks pass, bf16 and f32, 1 KiB … 1 GiB
# (fused_loopback_checks_p2.json). Above P = 2 there is no such option.
#
# P = 2, the FP8 codecs, 16-bit input: warp_specialized. Measured side by side in loopback,
# bf16 (bench/results/fused_ws_levers.json, 5889904): 24.9 / 81.1 / 295.0 µs per device at 16
# / 64 / 256 MiB against 26.3 / 93.2 / 352.4 for one warpgroup per program (SLIM_2_PER_SM,
# FP8_DECODE, own_from_smem); loopback checks pass, bf16, 1 KiB … 1 GiB, 5 calls
# (fused_ws_checks_p2.json, fused_ws_checks_p2_1gib.json).
WARP_SPECIALIZED = dict(warp_specialized=True, per_sm=1)


def default_config(codec, p: int, in_dtype) -> FusedConfig:
    """The one-shot kernel's launch shape when none is given. The FP8 codecs: FP8_DECODE; at
    P = 2 own_from_smem, and for 16-bit input WARP_SPECIALIZED; otherwise SLIM_2_PER_SM
    where two programs fit (16-bit input; f32 input's staging does not fit twice). echo4:
    FusedConfig(), the shape its loopback checks passed with."""
    if not isinstance(tile_codec(codec), TacoTiles):
        return FusedConfig()
    fp8 = dict(FP8_DECODE, own_from_smem=p == 2)
    if p == 2 and jnp.dtype(in_dtype).itemsize == 2:
        return FusedConfig(**fp8, **WARP_SPECIALIZED)
    slim = dataclasses.replace(SLIM_2_PER_SM, **fp8)
    if jnp.dtype(in_dtype).itemsize == 2:
        need = 2 * (smem_bytes(p, codec, in_dtype, cfg=slim) + SMEM_RESERVED)
        if need <= SMEM_PER_SM:
            return slim
    return FusedConfig(**fp8)


# -- how a peer is addressed ------------------------------------------------------------------
def signal_released(signals):
    """Increment each (semaphore, device_id) of `signals` by 1 with release semantics
    (red.release.sys after a warpgroup barrier): called once the stores it announces have
    landed, so the peer that acquires the count sees them. Not
    `plgpu.semaphore_signal_parallel`: its increment is relaxed and its release fence comes
    after it, which does not order the stores before the signal."""
    for sem, device_id in signals:
        pl.semaphore_signal(sem, 1, device_id=device_id)


@dataclasses.dataclass(frozen=True)
class Remote:
    """One device per member of mesh axis `axis` (inside shard_map)."""
    axis: str
    p: int
    nprog: int

    devices_here = 1

    def grid(self):
        return self.nprog

    def ids(self):
        return lax.axis_index(self.axis), lax.axis_index("prog")

    def local(self, ref, me):
        return ref

    def peer(self, ref, me, dst):
        return plgpu.remote_ref(ref, {self.axis: dst})

    def semaphores(self, scratch, me, b):
        return scratch

    def signal(self, sems, me, b, dsts, phase=0):
        signal_released([(sems.at[phase * self.p + me], {self.axis: d}) for d in dsts])

    def wait(self, sems, me, b, src, phase=0):
        pl.semaphore_wait(sems.at[phase * self.p + src], 1)


@dataclasses.dataclass(frozen=True)
class Loopback:
    """P virtual devices on this GPU: device d is programs d·nprog … (d+1)·nprog − 1;
    `phases` handshakes per program (one semaphore per (phase, receiver, sender, program))."""
    p: int
    nprog: int
    phases: int = 1

    @property
    def devices_here(self):
        return self.p

    def grid(self):
        return self.p * self.nprog

    def ids(self):
        g = lax.axis_index("prog")
        return g // self.nprog, g % self.nprog

    def local(self, ref, me):
        return ref.at[me]

    def peer(self, ref, me, dst):
        return ref.at[dst]

    def semaphores(self, scratch, me, b):
        # global: they persist between calls, and every signal is consumed by one wait
        return pl.get_global(plgpu.SemaphoreType.REGULAR(
            (self.phases * self.p * self.p * self.nprog,)))

    def _sem(self, sems, dst, src, b, phase):
        return sems.at[((phase * self.p + dst) * self.p + src) * self.nprog + b]

    def signal(self, sems, me, b, dsts, phase=0):
        signal_released([(self._sem(sems, d, me, b, phase), None) for d in dsts])

    def wait(self, sems, me, b, src, phase=0):
        pl.semaphore_wait(self._sem(sems, me, src, b, phase), 1)


# -- tile codecs: a codec's math on a tile, for the one kernel body ----------------------------
# The one-shot kernel's protocol (stores, signals, sums) is codec-blind; what it needs of a
# codec is a tile codec: the wire bytes of a tile row (64 rows of 256 values per tile), the
# constant operands it keeps in shared memory, encode a tile of values and store its wire,
# load a wire tile and decode-and-add one column part of it in f32.
@dataclasses.dataclass(frozen=True)
class TacoTiles:
    """The Hadamard FP8 codecs with B = 256 (taco, taco-e5m2, taco-1scale): a block per tile
    row, mosaic.py's tile math (wgmma transform; f32 input is encoded from bf16).
    `checked_on_gpu`: its loopback checks pass on a GPU, so the collectives may select it."""
    codec: object
    # FusedConfig.decode == "sum_first": decode_add keeps the running sum before the
    # butterfly (the wgmma accumulators scaled by their gains) and `finish` completes it.
    sum_first: bool = False
    encode_parts: int = 1                  # FusedConfig.encode_parts
    checked_on_gpu = True

    @property
    def row_bytes(self) -> int:
        return self.codec.row_bytes

    def unsupported(self, dtype) -> str | None:
        enc = jnp.bfloat16 if jnp.dtype(dtype) == jnp.float32 else dtype
        return (mosaic.unsupported("compress", self.codec, (ROWS, BLOCK), enc)
                or mosaic.unsupported("decompress", self.codec, (ROWS, BLOCK), dtype))

    def staged(self, in_dtype) -> bool:
        """f32 input goes through a bf16 copy in shared memory (the wgmma's operand)."""
        return jnp.dtype(in_dtype) == jnp.float32

    def x_transforms(self, in_dtype) -> tuple:
        return () if self.staged(in_dtype) else mosaic.SMEM_TRANSFORMS

    def x_slots(self, in_dtype) -> int:
        return 1 if self.staged(in_dtype) else 2

    def operands(self, in_dtype) -> tuple:
        """(encode factor, decode factor), each with its SMEM transforms."""
        enc = jnp.bfloat16 if self.staged(in_dtype) else in_dtype
        return ((mosaic.hadamard_operand("encode", enc), mosaic.SMEM_TRANSFORMS),
                (mosaic.hadamard_operand("decode"), mosaic.SMEM_TRANSFORMS))

    def encode(self, x_smem, consts):
        return mosaic.encode_tile(x_smem, consts[0], self.codec, self.encode_parts)

    def store(self, view, wire):
        mosaic.store_wire_tile(view, *wire)

    def load(self, view, part: int, parts: int):
        del part, parts                    # the whole tile: a part's wgmma reads every code
        return mosaic.load_wire_tile(view, self.codec)

    def decode_add(self, wire, consts, vec: int, part: int, parts: int, total=None):
        codes, scales = wire
        fmt = mosaic.CODE_FORMATS[self.codec.fmt]
        q = [lax.bitcast_convert_type(codes[:, 16 * c:16 * (c + 1)], fmt)
             .astype(jnp.float16) for c in range(mosaic.FACTOR)]
        acc = mosaic._transform_part(lambda c: q[c], consts[1], part, parts)
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


@dataclasses.dataclass(frozen=True)
class Echo4Tiles:
    """echo4 (groups of 128, 4-bit codes): two groups per tile row, a tile row's wire their
    two codec rows (144 bytes), `mosaic_echo4`'s register math; no constant operands, input
    of any covered dtype encoded as it is (f32 too, as the codec does). Its loopback checks
    pass on an H200 (P = 2, 4, 8; bf16, f32; 1 KiB to 64 MiB; fused_echo4_checks.json)."""
    codec: object
    checked_on_gpu = True

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


def tile_codec(codec):
    """The tile codec of `codec`: Echo4Tiles for echo4, else TacoTiles (whose `unsupported`
    says whether it covers the codec)."""
    if mosaic_echo4.unsupported(codec) is None:
        return Echo4Tiles(codec)
    return TacoTiles(codec)


# -- decode and add, in registers ---------------------------------------------------------------
def _row_gains(codec, sbytes) -> list:
    """The decode gain of this thread's two rows (eq. 11, and eq. 13's second scale for
    "ash"), times the transform's 1/√256: a vector<2> per row half."""
    f32 = ir.F32Type.get()
    gains = []
    for i in range(2):
        sv = vector.bitcast(ir.VectorType.get((codec.n_scales,), f32),
                            sbytes.registers.reshape(2)[i])
        gain = mosaic._elem(sv, 0)                                        # eq. 11
        if codec.transform == "ash":                                      # eq. 13
            gain = arith.mulf(gain, mosaic._ptx_f32("rcp.approx.ftz.f32", mosaic._elem(sv, 1)))
        gains.append(vector.broadcast(ir.VectorType.get((2,), f32),
                                      arith.mulf(gain, mosaic._f32(1 / np.sqrt(BLOCK)))))
    return gains


@functools.cache
def _decode_add_fn(codec, vec: int, parts: int, first: bool):
    """One column part of a decoded tile (f32, value layout of `vec`-element vectors), plus
    the running sum of the previous devices' (unless first): mosaic.decode_tile's math
    without its final cast, so P tiles sum in f32 in one register array. Built from
    mosaic.py's register helpers (`_assemble`, `_transformed`, …): its public decode_tile
    returns every part of a tile at once, cast, which would hold two f32 tiles in
    registers while summing."""
    layout = mosaic._pallas_layout(mosaic._wire_tiled(vec, BLOCK // parts))
    out = plgpu.ShapeDtypeStruct((ROWS, BLOCK // parts), jnp.float32, layout)
    args = (plgpu.Layout.WGMMA, mosaic.scale_layout(codec)) + (() if first else (layout,))

    @plgpu.inline_mgpu(arg_types=args, return_type=out)
    def decode_add(ctx, acc, sbytes, total=None):
        del ctx
        vals = mosaic._assemble(mosaic._transformed(acc), vec, ir.F32Type.get(),
                                _row_gains(codec, sbytes))                # eq. 12
        return vals if total is None else total + vals
    return decode_add


@functools.cache
def _gain_add_fn(codec, parts: int, first: bool):
    """decode="sum_first": a tile's wgmma accumulator for one column part (WGMMA layout,
    before the butterfly), each row times its gain, plus the running sum (unless first)."""
    wgmma = plgpu.Layout.WGMMA
    out = plgpu.ShapeDtypeStruct((ROWS, BLOCK // parts), jnp.float32, wgmma)
    args = (wgmma, mosaic.scale_layout(codec)) + (() if first else (wgmma,))

    @plgpu.inline_mgpu(arg_types=args, return_type=out)
    def gain_add(ctx, acc, sbytes, total=None):
        del ctx
        gains = _row_gains(codec, sbytes)
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
    layout = mosaic._pallas_layout(mosaic._wire_tiled(vec, BLOCK // parts))
    out = plgpu.ShapeDtypeStruct((ROWS, BLOCK // parts), jnp.float32, layout)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,), return_type=out)
    def finish(ctx, total):
        del ctx
        return mosaic._assemble(mosaic._transformed(total), vec, ir.F32Type.get())
    return finish


def _own_or_peer(me, i, peer_bar):
    """P = 2, this device's tile decoded from its staging (own_from_smem): `_sum_tiles`'
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


def _first_loads(load, r_smem, n_src):
    """The copies `_sum_tiles` starts with: every tile when all n_src fit, else the
    first's."""
    for j in range(n_src if n_src <= r_smem.shape[0] else 1):
        load(j, j)


def _loader(recv, r_smem, r_bar, row0, lines):
    def load(j, slot):
        plgpu.copy_gmem_to_smem(recv.at[j, pl.ds(row0, lines)], r_smem.at[slot],
                                r_bar.at[slot])
    return load


def _zeros(vec: int, parts: int):
    """A column part of zeros in the decode's value layout (the "no_decode" knob)."""
    layout = mosaic._pallas_layout(mosaic._wire_tiled(vec, BLOCK // parts))
    return plgpu.layout_cast(jnp.zeros((ROWS, BLOCK // parts), jnp.float32), layout)


def _sum_tiles(load, r_smem, r_bar, tiles, consts, n_src, vec, parts, ablate="none",
               init=None, emit=None, sources=None):
    """init + Σ_j decode(wire tile j), j = 0 … n_src − 1 in that order, summed in f32:
    `parts` arrays (init: `parts` f32 arrays in the same layout, or None). load(j, slot)
    starts the TMA copy of source j's wire tile into r_smem[slot] (arriving on
    r_bar[slot]); the first copies were started by `_first_loads`. When every source has
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
    if init is not None and getattr(tiles, "sum_first", False):
        raise ValueError("_sum_tiles: an init in the value layout cannot join a sum kept "
                         "before the transform (decode='sum_first')")
    row = tiles.row_bytes
    resident = sources is not None or n_src <= r_smem.shape[0]
    seq = [(part, j) for part in range(parts) for j in range(n_src)]
    slot_of = (lambda e: seq[e][1]) if resident else (lambda e: e % 2)   # noqa: E731
    reps = {"decode_twice": 2, "no_decode": 0}.get(ablate, 1)
    totals = list(init) if init is not None else [None] * parts
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
    vec = mosaic._value_vec(out_dtype)
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
        src = x_smem.at[slot]
        if xb_smem is not None:            # f32 input: the transform's operand is bf16
            v = plgpu.load(src, layout=plgpu.Layout.WGMMA, optimized=False)
            xb_smem[...] = v.astype(xb_smem.dtype)
            plgpu.commit_smem()
            if x_slots == 1:
                # one x slot: refill it once every warp has read it. commit_smem ends in a
                # warpgroup barrier; a TMA issued right after this thread's own loads could
                # overwrite the slot under a slower warp's
                prefetch(i)
            src = xb_smem
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
            _first_loads(load, r_smem, p)
        return load

    def sources(i):
        """own_from_smem: source j of tile i → (its slot in w_smem, its wait)."""
        return _own_or_peer(me, i, r_bar.at[0]) if own else None

    def decode(i, load):
        out_rows = pl.ds(tile(i) * ROWS, ROWS)
        if cfg.store_parts:
            if tma_out:        # as below: the last result store has read y_smem
                plgpu.wait_smem_to_gmem(n_wire, wait_read_only=True)
            dst = y_smem if tma_out else y_mine.at[out_rows]

            def emit(part, value):
                mosaic.store_part(dst, part, parts, value.astype(out_dtype))
            _sum_tiles(load, r_wire, r_bar, tiles, c_smem, p, vec, parts, ablate, emit=emit,
                       sources=sources(i))
            if tma_out:
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(y_smem, y_mine.at[out_rows])
            return
        totals = _sum_tiles(load, r_wire, r_bar, tiles, c_smem, p, vec, parts, ablate,
                            sources=sources(i))
        values = [t.astype(out_dtype) for t in totals]
        if tma_out:
            # the last result store has read y_smem (only the wire stores issued after it
            # may still be reading their staging)
            plgpu.wait_smem_to_gmem(n_wire, wait_read_only=True)
            mosaic.store_values(y_smem, values)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(y_smem, y_mine.at[out_rows])
        else:
            mosaic.store_values(y_mine.at[out_rows], values)

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
        (plgpu.SMEM((ROWS, BLOCK), jnp.bfloat16, transforms=mosaic.SMEM_TRANSFORMS)
         if tiles.staged(in_dtype) else None),
        # wire staging: tile i is staged while tile i − 1's stores still read the other slot
        # (own_from_smem: and while it is decoded; a third slot receives the peer's tile)
        plgpu.SMEM((3 if cfg.own_from_smem else 2, lines, LINE), jnp.uint8),
        # both wire tiles resident at P = 2; above, the tiles stream through the two slots
        None if cfg.own_from_smem else plgpu.SMEM((2, lines, LINE), jnp.uint8),
        (plgpu.SMEM((ROWS, BLOCK), out_dtype, transforms=mosaic.swizzled(out_dtype))
         if tma_out else None),
        tuple(plgpu.SMEM(a.shape, a.dtype, transforms=t) for a, t in tiles.operands(in_dtype)),
        plgpu.Barrier(num_barriers=2), plgpu.Barrier(), plgpu.Barrier(num_barriers=2),
        (plgpu.SemaphoreType.REGULAR((p,)) if remote else None),
    ]


def _flat(scratch) -> list:
    """The scratch list without its Nones, the operand copies spliced in."""
    out = []
    for s in scratch:
        out += list(s) if isinstance(s, tuple) else [] if s is None else [s]
    return out


def _unflatten(scratch, refs) -> list:
    """The kernel's scratch refs → one argument per `_scratch` entry."""
    it = iter(refs)
    return [tuple(next(it) for _ in s) if isinstance(s, tuple) else
            None if s is None else next(it) for s in scratch]


def smem_bytes(p: int, codec, in_dtype, out_dtype=None, cfg: FusedConfig | None = None):
    """Shared memory one program of the kernel takes: the buffers `_scratch` allocates for
    this configuration, each rounded up to 1 KiB (Pallas' shared-memory alignment, what a
    swizzled TMA buffer needs), plus 1 KiB for the barriers, for `FusedConfig.per_sm`'s
    check."""
    out_dtype = in_dtype if out_dtype is None else out_dtype
    return _buffer_bytes(_scratch(p, tile_codec(codec), in_dtype, out_dtype,
                                  cfg or FusedConfig(), False)) + 1024      # barriers


def _buffer_bytes(scratch) -> int:
    """The shared-memory buffers of a scratch list (semaphores left out), each rounded up to
    1 KiB."""
    return sum(-(-int(np.prod(s.shape)) * jnp.dtype(s.dtype).itemsize // 1024) * 1024
               for s in _flat(scratch) if hasattr(s, "shape"))


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
    tiles = tile_codec(codec)
    if cfg.decode == "sum_first":
        if not isinstance(tiles, TacoTiles):
            raise ValueError(f"FusedConfig(decode='sum_first'): {codec.name} has no transform "
                             f"to sum before (the FP8 codecs have)")
        tiles = dataclasses.replace(tiles, sum_first=True)
    if cfg.encode_parts != 1:
        if not isinstance(tiles, TacoTiles):
            raise ValueError(f"FusedConfig(encode_parts={cfg.encode_parts}): {codec.name}'s "
                             f"encode has no column passes (the FP8 codecs' has)")
        tiles = dataclasses.replace(tiles, encode_parts=cfg.encode_parts)
    if cfg.own_from_smem and p != 2:
        raise ValueError(f"FusedConfig(own_from_smem=True) covers P = 2, not P={p} (above 2 "
                         f"the wire tiles stream through two receive slots)")
    in_dtype = blocks.dtype
    if cfg.warp_specialized:
        return _launch_ws(blocks, tiles, out_dtype, peers, cfg, mat)
    _check_resident(p, codec, in_dtype, out_dtype, cfg)
    scratch = _scratch(p, tiles, in_dtype, out_dtype, cfg, isinstance(peers, Remote))
    return _call(_kernel_body, blocks, tiles, out_dtype, peers, cfg, scratch, mat)


def _call(kernel_body, blocks, tiles, out_dtype, peers, cfg, scratch, mat, **mesh):
    """Launch kernel_body(x, consts, y, recv, *scratch refs, …) over `peers.grid()` programs
    (`mesh`: plgpu.kernel's warpgroup arguments): returns y, (…, n_rows, 256)."""
    n_rows = blocks.shape[-2]
    n_tiles = n_rows // ROWS
    lead = blocks.shape[:-2]
    lines = ROWS * tiles.row_bytes // LINE

    def struct(shape, dtype):
        if mat is None:
            return jax.ShapeDtypeStruct(shape, dtype)
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)

    out_type = (struct((*lead, n_rows, BLOCK), out_dtype),
                struct((*lead, peers.p, n_tiles * lines, LINE), jnp.uint8))   # receive buffers
    operands = [a for a, _ in tiles.operands(blocks.dtype)]
    n_ops = len(operands)

    def body(x, *refs):
        consts, (y, recv), refs = refs[:n_ops], refs[n_ops:n_ops + 2], refs[n_ops + 2:]
        kernel_body(x, consts, y, recv, *_unflatten(scratch, refs), peers=peers, tiles=tiles,
                    n_tiles=n_tiles, out_dtype=out_dtype, cfg=cfg)

    kernel = plgpu.kernel(
        body, out_type=out_type, scratch_types=_flat(scratch),
        grid=(peers.grid(),), grid_names=("prog",), kernel_name="taco_fused_allreduce",
        compiler_params=plgpu.CompilerParams(lowering_semantics=mosaic.LANE), **mesh)
    y, _ = kernel(blocks, *operands)
    return y


# -- the warp-specialized kernel (P = 2) --------------------------------------------------------
WS_MATH_REGS, WS_TRANSPORT_REGS = 224, 32   # a thread's registers: 2 × 224 + 2 × 32 = 4 × 128


def ws_unsupported(p: int, tiles, in_dtype) -> str | None:
    """Why FusedConfig(warp_specialized=True) does not cover this call (None: it does)."""
    if p != 2:
        return f"P={p} (it covers P = 2: this device's tile from its staging)"
    if not isinstance(tiles, TacoTiles):
        return f"{tiles.codec.name} (it has the FP8 codecs' tile math)"
    if jnp.dtype(in_dtype).itemsize != 2:
        return f"{jnp.dtype(in_dtype).name} input (it covers 16-bit input)"
    return None


def _ws_scratch(tiles, in_dtype, remote: bool):
    """`_ws_body`'s scratch (the same conventions as `_scratch`): per stream one input slot
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
    vec = mosaic._value_vec(out_dtype)
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

            where = _own_or_peer(me, i, peer_full.at[c])

            def emit(part, value):
                mosaic.store_part(out, part, parts, value.astype(out_dtype))
            if cfg.store_parts:
                _sum_tiles(None, ws, None, tiles, c_smem, p, vec, parts, emit=emit,
                           sources=where)
            else:
                totals = _sum_tiles(None, ws, None, tiles, c_smem, p, vec, parts,
                                    sources=where)
                mosaic.store_values(out, [t.astype(out_dtype) for t in totals])
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


def _launch_ws(blocks, tiles, out_dtype, peers, cfg, mat=None):
    """`_launch` for FusedConfig(warp_specialized=True): one program per multiprocessor
    (per device here), four warpgroups, two tile streams."""
    p = peers.p
    in_dtype = blocks.dtype
    why = ws_unsupported(p, tiles, in_dtype)
    if why is not None:
        raise ValueError(f"FusedConfig(warp_specialized=True): {why}")
    n_tiles = blocks.shape[-2] // ROWS
    remote = isinstance(peers, Remote)
    nprog = max(1, min(-(-n_tiles // 2), mosaic.sm_count() // peers.devices_here))
    if cfg.programs is not None:
        nprog = min(nprog, cfg.programs)
    peers = (dataclasses.replace(peers, nprog=nprog) if remote else
             Loopback(p, nprog, phases=2))
    scratch = _ws_scratch(tiles, in_dtype, remote)
    need = (_buffer_bytes(_ws_scratch(tiles, in_dtype, False))
            + 2048 + SMEM_RESERVED)                             # + barriers, + the runtime's
    if need > SMEM_PER_SM:
        raise ValueError(f"FusedConfig(warp_specialized=True): {need // 1024} KiB of shared "
                         f"memory per program; a multiprocessor has {SMEM_PER_SM // 1024}")
    return _call(_ws_body, blocks, tiles, out_dtype, peers, cfg, scratch, mat, num_threads=4,
                 thread_name="wg")


# -- wrappers ------------------------------------------------------------------------------------
def unsupported(codec, p: int, dtype, kernel: str = "one_shot") -> str | None:
    """Why the one-launch kernel does not cover this all-reduce (None: it does). kernel
    "one_shot": the Hadamard FP8 codecs with B = 256 and echo4 (`tile_codec`); "two_shot":
    the former only."""
    if not 2 <= p <= MAX_P:
        return f"P={p} devices (the kernel covers 2..{MAX_P})"
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in IN_DTYPES]:
        return f"{jnp.dtype(dtype).name} data (covered: bfloat16, float16, float32)"
    tiles = tile_codec(codec)
    if kernel == "two_shot" and not isinstance(tiles, TacoTiles):
        return f"{codec.name}: the two-shot kernel has the FP8 codecs' tile math only"
    return tiles.unsupported(dtype)


def _check(codec, p, dtype, where, kernel="one_shot"):
    why = unsupported(codec, p, dtype, kernel)
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


def fused_allreduce(x, axis: str, p: int, codec, *, out_mat=None,
                    cfg: FusedConfig | None = None):
    """Σ over the P members of mesh axis `axis` of decode(encode(x_j)), in device order:
    the compressed one-shot all-reduce in one kernel. Call inside `jax.shard_map` on GPUs
    of one process whose mesh lists devices 0..n−1 in order.

    Args:
      x: this device's bf16, f16 or f32 array (any shape; f32 is encoded from bf16).
      axis: one mesh axis name; peers are addressed by it, other axes keep this device's
        coordinates.
      p: the axis size (2..8).
      codec: a Hadamard FP8 codec with B = 256 (`mosaic.unsupported`) or echo4 (B = 128,
        `mosaic_echo4`): `tile_codec(codec)` gives its tile math.
      out_mat: the result's `manual_axis_type` under check_vma (None without).
      cfg: launch shape (`FusedConfig`; None: `default_config`).
    Returns: an array of x's shape and dtype, the same bits on every device.
    Raises: ValueError naming what is not covered."""
    _check(codec, p, x.dtype, "fused_allreduce")
    cfg = cfg or default_config(codec, p, x.dtype)
    if x.size == 0:
        return x
    blocks = _tiles(x.reshape(-1))
    peers = Remote(axis, p, cfg.grid(blocks.shape[0] // ROWS, 1))
    y = _launch(blocks, codec, x.dtype, peers, cfg, out_mat)
    return codecs.from_blocks(y, x.shape)


@functools.partial(jax.jit, static_argnames=("codec", "cfg"))
def loopback_allreduce(xs, codec, cfg: FusedConfig | None = None):
    """The same kernel on one GPU for P = xs.shape[0] virtual devices: xs[d] is device d's
    input; returns (P, …): row d is what device d computes (all rows equal when correct).
    Raises ValueError as `fused_allreduce`."""
    p = xs.shape[0]
    _check(codec, p, xs.dtype, "loopback_allreduce")
    cfg = cfg or default_config(codec, p, xs.dtype)
    if xs.size == 0:
        return xs
    blocks = _tiles(xs.reshape(p, -1))
    peers = Loopback(p, cfg.grid(blocks.shape[1] // ROWS, p))
    y = _launch(blocks, codec, xs.dtype, peers, cfg)
    return jax.vmap(lambda v: codecs.from_blocks(v, xs.shape[1:]))(y)


def fused_allreduce_reference(xs, codec):
    """Plain jnp: (P, …) → Σ_j decode(encode(xs[j])) in f32, j in order, in xs's dtype
    (what the kernel encodes: for the FP8 codecs f32 inputs from bf16, for echo4 as they
    are; `tile_codec(codec).encoded`)."""
    tiles = tile_codec(codec)
    acc = None
    for j in range(xs.shape[0]):
        v = tiles.encoded(xs[j])
        blocks = codecs.to_blocks(v, codec.block_size)
        dec = codec.decompress_reference(codec.compress_reference(blocks)).astype(jnp.float32)
        acc = dec if acc is None else acc + dec
    return codecs.from_blocks(acc, xs.shape[1:]).astype(xs.dtype)
