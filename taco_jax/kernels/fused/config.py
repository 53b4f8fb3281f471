"""The fused all-reduce kernels' launch configuration: `FusedConfig` (each field with its
reason), the measured presets the one-shot kernel's `default_config` combines, the
measurement knobs (`ABLATIONS`, `TWO_SHOT_ABLATIONS`) and the shared-memory budget of a
multiprocessor."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from taco_jax.kernels.mosaic import registers

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
# The two-shot kernel's: its phases left out from the end, so that differences give each
# phase's time (scatter; + reduce; + gather, the kernel as it is).
TWO_SHOT_ABLATIONS = {
    "none": "the kernel as it is",
    "scatter_only": "its scatter and first handshake only",
    "no_gather": "scatter and reduce, the P sums not decoded",
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
    # through shared-memory barriers (`one_shot_ws`), so that no fence, semaphore spin or load
    # latency lies on the math's path.
    warp_specialized: bool = False
    # The two-shot kernel: shared-memory slots for incoming wire tiles (the owner's copies,
    # the sums), so that many are in flight (None: the most that fit, up to 7, the P − 1
    # copies of a tile at P = 8).
    ring: int | None = None
    # A measurement knob (ABLATIONS, TWO_SHOT_ABLATIONS), "none" in use.
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
        if self.ring is not None and not 2 <= self.ring <= 8:
            raise ValueError(f"FusedConfig.ring={self.ring} must be None or 2..8")
        if self.ablate not in ABLATIONS and self.ablate not in TWO_SHOT_ABLATIONS:
            raise ValueError(f"FusedConfig.ablate={self.ablate!r} must be one of "
                             f"{', '.join(ABLATIONS)} (the one-shot kernel's) or "
                             f"{', '.join(TWO_SHOT_ABLATIONS)} (the two-shot's)")

    def grid(self, n_tiles: int, devices_here: int) -> int:
        """Programs per device: ≤ per_sm × this GPU's multiprocessors / devices_here."""
        cap = max(1, self.per_sm * registers.sm_count() // devices_here)
        want = cap if self.programs is None else self.programs
        if want > cap:
            raise ValueError(f"FusedConfig.programs={want} exceeds the {cap} programs that "
                             f"can be resident per device ({devices_here} on this GPU, "
                             f"per_sm={self.per_sm})")
        return max(1, min(n_tiles, want))


# Two programs per multiprocessor, each with half the shared memory (one input slot, results
# stored from registers): one program's decode hides behind the other's waits. Measured at
# P = 2 in loopback, bf16 (bench/results/fused_ablation_residency.json): 31.1 / 110.4 /
# 413.5 µs per device at 16 / 64 / 256 MiB against 34.6 / 127.2 / 497.6 for FusedConfig().
SLIM_2_PER_SM = FusedConfig(x_slots=1, out_store="registers", per_sm=2)

# The FP8 codecs' decode: each column part stored once summed, and the P accumulators summed
# before one butterfly. Measured side by side at P = 2 in loopback, bf16, on SLIM_2_PER_SM
# (bench/results/fused_ablation_store.json): 27.4 / 101.0 / 385.5 µs per device at 16 / 64 /
# 256 MiB against 28.8 / 106.3 / 405.6 with store_parts alone (decode="per_source"),
# 30.1 / 109.5 / 412.8 with sum_first alone (store_parts=False); loopback checks pass with
# both at P = 2, 4, 8, bf16 and f32 (fused_loopback_checks_p*.json).
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
