"""Decode, sum and add the residual in one kernel (Pallas Mosaic GPU, Hopper): the consumer
of `encode_epilogue`'s receive buffer, so the decoded sum never reaches HBM before the
residual add reads it.

    y = round(residual + Σ_j decode(wire_j)),  j = 0 … P − 1 in order, summed in f32,

the wires in the tile-major block order of `encode_epilogue` (codec tile t = i·(N/256) + j
is output rows 64i …, columns 256j …), y and residual (M, N) bf16 or f16.

Program b takes codec tiles b, b + n, …. Per tile it loads the residual tile by TMA (the
next tile's while this one is decoded) into a shared-memory slot that then stages the
result; the P wire tiles stream through a ring of `DecodeConfig.ring` slots, item
(tile, part, source) after item, each refilled as soon as every warp holds its wire in
registers, so the loads run ahead across tiles. Per column part the P sources are decoded
and added in f32 in device order (the tile codec's `load`, `decode_add`, `finish`), the
residual part is added, and the sum, rounded, is written over the residual part in place;
the tile leaves by TMA. With `parts` = 2 a taco wire tile is loaded once per part (its
transform reads every code).

`decode_sum_residual` (one device, or a leading D of devices as the loopback runs them),
`decode_sum_residual_reference` (jnp); `unsupported` says why a call is not covered.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from taco_jax.kernels.gemm import encode_epilogue as ee
from taco_jax.kernels.gemm.config import (IN_DTYPES, ROWS, SMEM_PER_SM, SMEM_RESERVED,
                                          TILE_N, buffer_bytes)
from taco_jax.kernels.mosaic import registers

LINE = ee.LINE


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """A launch of `decode_sum_residual`: `per_sm` programs of one warpgroup per
    multiprocessor (nothing waits on another program, so any grid works; `programs` caps
    it per device)."""
    # The decode's column passes: 2 halves the f32 registers a thread holds for the sum
    # and the transform's accumulator (the fused one-shot runs at 255 registers with 2).
    parts: int = 2
    # Wire slots in flight: 2 × 16.5 KiB (taco) with the two 32 KiB residual slots leave
    # room for two programs a multiprocessor, so one's waits hide behind the other's decode.
    ring: int = 2
    per_sm: int = 2
    programs: int | None = None

    def __post_init__(self):
        if self.parts not in (1, 2):
            raise ValueError(f"DecodeConfig.parts={self.parts} must be 1 or 2")
        if not 1 <= self.ring <= 16:
            raise ValueError(f"DecodeConfig.ring={self.ring} must be in 1..16")
        if self.per_sm not in (1, 2, 3, 4):
            raise ValueError(f"DecodeConfig.per_sm={self.per_sm} must be 1, 2, 3 or 4")
        if self.programs is not None and self.programs < 1:
            raise ValueError(f"DecodeConfig.programs={self.programs} must be >= 1")

    def grid(self, n_tiles: int, devices_here: int = 1) -> int:
        cap = max(1, self.per_sm * registers.sm_count() // devices_here)
        want = cap if self.programs is None else min(self.programs, cap)
        return max(1, min(n_tiles, want))


def smem_bytes(codec, dtype, cfg: DecodeConfig) -> int:
    """Shared memory of one program: the wire ring, two residual / result tiles, the tile
    codec's operands, and 1 KiB for the barriers."""
    tiles = ee.tile_codec(codec)
    lines = ROWS * tiles.row_bytes // LINE
    ops = [(a.shape, a.dtype) for a, _ in tiles.operands(dtype)]
    return (buffer_bytes([((cfg.ring, lines, LINE), jnp.uint8), ((2, ROWS, TILE_N), dtype)])
            + buffer_bytes(ops) + 1024)


def unsupported(codec, p: int, recv_shape, residual_shape, dtype,
                cfg: DecodeConfig | None = None) -> str | None:
    """Why `decode_sum_residual` does not cover this call (None: it does): P = 1..8 wires
    of (M·N/256, row_bytes) for a residual (…, M, N), M % 64 == 0, N % 256 == 0, bf16 or
    f16, a codec with tile math, a launch that fits shared memory."""
    cfg = cfg or DecodeConfig()
    if not 1 <= p <= ee.MAX_P:
        return f"P={p} wires (covered: 1..{ee.MAX_P})"
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in IN_DTYPES]:
        return f"{jnp.dtype(dtype).name} residual (covered: bfloat16, float16)"
    why = ee.tile_unsupported(codec, dtype)
    if why is not None:
        return why
    if len(residual_shape) < 2:
        return f"residual shape {tuple(residual_shape)} (want (…, M, N))"
    m, n = residual_shape[-2:]
    if m <= 0 or m % ROWS or n <= 0 or n % TILE_N:
        return (f"residual (M, N) = ({m}, {n}): M must be a positive multiple of {ROWS}, "
                f"N of {TILE_N}")
    want = (*residual_shape[:-2], p, m * n // TILE_N, ee.tile_codec(codec).row_bytes)
    if tuple(recv_shape) != want:
        return f"wires {tuple(recv_shape)} for residual {tuple(residual_shape)} (want {want})"
    need = cfg.per_sm * (smem_bytes(codec, dtype, cfg) + SMEM_RESERVED)
    if need > SMEM_PER_SM:
        return (f"{cfg}: {cfg.per_sm} programs need {need // 1024} KiB of shared memory a "
                f"multiprocessor; it has {SMEM_PER_SM // 1024} KiB")
    return None


def _body(tiles, cfg: DecodeConfig, p: int, nprog: int, n_ops: int, batched: bool,
          tiles_n: int, n_tiles: int, dtype):
    row, parts, ring = tiles.row_bytes, cfg.parts, cfg.ring
    lines = ROWS * row // LINE
    vec = registers.value_vec(dtype)
    width = TILE_N // parts
    per_tile = parts * p                          # ring items per tile: (part, source)

    def body(recv_gmem, res_gmem, *refs):
        consts_gmem, (y_gmem,), refs = refs[:n_ops], refs[n_ops:n_ops + 1], refs[n_ops + 1:]
        r_smem, o_smem, r_bar, o_bar, c_bar = refs[:5]
        consts = refs[5:5 + n_ops]
        g = lax.axis_index("prog")
        d, b = g // nprog, g % nprog
        recv, res, y = ((recv_gmem.at[d], res_gmem.at[d], y_gmem.at[d]) if batched else
                        (recv_gmem, res_gmem, y_gmem))
        count = (n_tiles - b + nprog - 1) // nprog
        items = count * per_tile

        def tile(i):
            return b + i * nprog

        def out_view(ref, i):
            t = tile(i)
            return ref.at[pl.ds((t // tiles_n) * ROWS, ROWS), pl.ds((t % tiles_n) * TILE_N,
                                                                   TILE_N)]

        def load_item(u):
            i, e = u // per_tile, u % per_tile
            plgpu.copy_gmem_to_smem(recv.at[e % p, pl.ds(tile(i) * lines, lines)],
                                    r_smem.at[u % ring], r_bar.at[u % ring])

        def load_residual(i):
            plgpu.copy_gmem_to_smem(out_view(res, i), o_smem.at[i % 2], o_bar.at[i % 2])

        for k, (src, dst) in enumerate(zip(consts_gmem, consts)):
            plgpu.copy_gmem_to_smem(src, dst, c_bar.at[k])
            plgpu.barrier_wait(c_bar.at[k])

        @pl.when(count > 0)
        def _():
            for u in range(ring):
                @pl.when(u < items)
                def _():
                    load_item(u)
            load_residual(0)

            @pl.loop(0, count)
            def _(i):
                @pl.when(i + 1 < count)
                def _():
                    # its slot was last read by tile i − 1's result store
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    load_residual(i + 1)
                plgpu.barrier_wait(o_bar.at[i % 2])
                out = o_smem.at[i % 2]
                for part in range(parts):
                    total = None
                    for j in range(p):
                        u = i * per_tile + part * p + j
                        slot = u % ring
                        plgpu.barrier_wait(r_bar.at[slot])
                        wire = tiles.load(ee.wire_view(r_smem.at[slot], row), part, parts)
                        plgpu.commit_smem()      # every warp holds it: the slot is free

                        @pl.when(u + ring < items)
                        def _():
                            load_item(u + ring)
                        total = tiles.decode_add(wire, consts, vec, part, parts, total)
                    cols = out.at[:, pl.ds(width * part, width)]
                    r = plgpu.load(cols, layout=registers.value_layout(dtype, parts),
                                   optimized=False).astype(jnp.float32)
                    registers.store_part(out, part, parts,
                                         (tiles.finish(total, vec, parts) + r).astype(dtype))
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out, out_view(y, i))
        plgpu.wait_smem_to_gmem(0)
    return body


def _wire_lines(recv):
    """(…, n_rows, row_bytes) → (…, n_tiles·lines, 256): the same bytes as TMA lines."""
    return recv.reshape(*recv.shape[:-2], -1, LINE)


@functools.partial(jax.jit, static_argnames=("codec", "cfg"))
def decode_sum_residual(recv, residual, codec, cfg: DecodeConfig | None = None):
    """round(residual + Σ_j decode(recv[j])), the P wires summed in f32 in order.

    Args:
      recv: (P, M·N/256, row_bytes) uint8, P wires in `encode_epilogue`'s tile-major
        order (`gemm_encode_exchange`'s receive buffer); or (D, P, …) for D devices run
        side by side (`loopback_gemm_encode`'s), each on 1/D of the programs.
      residual: (M, N), or (D, M, N), bf16 or f16: what the sum is added to.
      codec: the codec of the wires (`unsupported`).
      cfg: `DecodeConfig`; None: its defaults.
    Returns: residual's shape and dtype.
    Raises: ValueError naming what is not covered."""
    return decode_launch(recv, residual, codec, cfg)


def decode_launch(recv, residual, codec, cfg: DecodeConfig | None = None, out_mat=None):
    """`decode_sum_residual` unjitted, its result's `manual_axis_type` out_mat (inside
    shard_map under check_vma; None without)."""
    cfg = cfg or DecodeConfig()
    batched = residual.ndim == 3
    p = recv.shape[-3] if recv.ndim >= 3 else 0
    why = unsupported(codec, p, recv.shape, residual.shape, residual.dtype, cfg) or (
        None if recv.dtype == jnp.uint8 else f"wires of {recv.dtype} (want uint8)")
    if why is None and residual.ndim not in (2, 3):
        why = f"residual {residual.shape}: (M, N) or (D, M, N)"
    if why is not None:
        raise ValueError(f"decode_sum_residual: {why}")
    tiles = ee.tile_codec(codec)
    m, n = residual.shape[-2:]
    n_tiles = (m // ROWS) * (n // TILE_N)
    groups = residual.shape[0] if batched else 1
    nprog = cfg.grid(n_tiles, groups)
    dtype = residual.dtype
    lines = ROWS * tiles.row_bytes // LINE
    ops = tiles.operands(dtype)
    scratch = [plgpu.SMEM((cfg.ring, lines, LINE), jnp.uint8),
               plgpu.SMEM((2, ROWS, TILE_N), dtype, transforms=registers.swizzled(dtype)),
               plgpu.Barrier(num_barriers=cfg.ring), plgpu.Barrier(num_barriers=2),
               plgpu.Barrier(num_barriers=max(len(ops), 1))]
    scratch += [plgpu.SMEM(a.shape, a.dtype, transforms=t) for a, t in ops]
    body = _body(tiles, cfg, p, nprog, len(ops), batched, n // TILE_N, n_tiles, dtype)
    out = (jax.ShapeDtypeStruct(residual.shape, dtype) if out_mat is None else
           jax.ShapeDtypeStruct(residual.shape, dtype, manual_axis_type=out_mat))
    kernel = plgpu.kernel(
        body, out_type=out, scratch_types=scratch,
        grid=(groups * nprog,), grid_names=("prog",), kernel_name="taco_decode_residual",
        compiler_params=plgpu.CompilerParams(lowering_semantics=registers.LANE))
    return kernel(_wire_lines(recv), residual, *[a for a, _ in ops])


def decode_sum_residual_reference(recv, residual, codec):
    """Plain jnp: round(residual + Σ_j decode(recv[…, j])) in f32, j in order, the wires'
    blocks in tile-major order (`encode_epilogue.untile_blocks`)."""
    m, n = residual.shape[-2:]
    total = None
    for j in range(recv.shape[-3]):
        w = recv[..., j, :, :]                                  # (…, rows, row_bytes)
        dec = codec.decompress_reference(w.reshape(-1, codec.row_bytes)).astype(jnp.float32)
        dec = ee.untile_blocks(dec.reshape(*w.shape[:-1], TILE_N), m, n)
        total = dec if total is None else total + dec
    return (total + residual.astype(jnp.float32)).astype(residual.dtype)
