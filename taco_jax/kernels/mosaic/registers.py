"""Register layouts and Mosaic GPU IR helpers shared by the Mosaic tile math (the
Hadamard FP8 codecs' `taco_tiles`, echo4's `echo4`) and the kernels built on it, and the
stores of decoded value tiles (`store_values`, `store_part`, `swizzled`). A tile is 64
rows, one warpgroup; in `wire_tiled` a thread holds runs of 16 consecutive bytes or values
of its rows (8-byte code vectors, 16-byte value vectors)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import fragmented_array as fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, vector

from taco_jax import _jax_private

ROWS = 64                  # blocks per tile: one warpgroup, the wgmma M
BLOCK = 256
FACTOR = 16                # H_256 = H_16 ⊗ H_16
LANE = plgpu.LoweringSemantics.Lane


def sm_count() -> int:
    """Multiprocessors of this process's first GPU: the most programs that are resident at
    once when each takes one. Without a GPU (lowering for CUDA on CPU, as the tests and
    the lowering checks do), or where the device does not report its count, 132: an H100
    SXM or an H200 has 132, so a grid sized on CPU is the grid those GPUs launch."""
    try:
        dev = jax.devices("gpu")[0]
        return int(getattr(dev, "core_count", 0)) or 132
    except RuntimeError:      # no GPU here (lowering on CPU): an H200's count
        return 132


# -- register layouts -----------------------------------------------------------------------
def wire_tiled(vec: int, width: int = BLOCK) -> fa.TiledLayout:
    """(64, width), width 256 or 128: rows as in the WGMMA layout (warp w: rows
    16w..16w+15; lane l: rows l//4 and l//4 + 8); columns 16c .. 16c+15 for the c =
    8j + 2(l%4) + e (e ∈ {0, 1}, j < width/128) of lane l, as 16/vec vectors of vec
    consecutive elements."""
    tiles = ((64, width), (16, width), (8, width)) + (((128,),) if width == 256 else ()) \
        + ((32,), (16,), (vec,))
    extra = 1 if width == 256 else 0
    return fa.TiledLayout(fa.Tiling(tiles), warp_dims=(-9 - extra,),
                          lane_dims=(-5 - extra, -4), vector_dim=-1)


def scale_tiled(width: int) -> fa.TiledLayout:
    """(64, width): one vector per row, rows as in the WGMMA layout, the four lanes of a
    row holding the same bytes."""
    return _jax_private.tiled_layout(
        fa.Tiling(((64, width), (16, width), (8, width), (width,))), warp_dims=(-7,),
        lane_dims=(-3, fa.Replicated(4)), vector_dim=-1)


def pallas_layout(t: fa.TiledLayout):
    return plgpu.Layout.TILED(t.tiling, warp_dims=t.warp_dims, lane_dims=t.lane_dims,
                              vector_dim=t.vector_dim)


def value_vec(dtype) -> int:
    return 16 // jnp.dtype(dtype).itemsize          # 16-byte vectors


def value_layout(dtype=jnp.float32, parts: int = 1):
    """Pallas layout of each of decode_tile's value parts (vectors of 16 bytes)."""
    return pallas_layout(wire_tiled(value_vec(dtype), BLOCK // parts))


# -- register-level pieces (Mosaic GPU IR, run inside plgpu.inline_mgpu) ------------------
def f32_const(v):
    """An f32 constant (the value as Python's float)."""
    return arith.constant(ir.F32Type.get(), float(v))


def ptx_f32(instr: str, x):
    return mgpu_utils.inline_ptx(f"{instr} $0, $1;", x, result_types=ir.F32Type.get())


def elem(v, k: int):
    return vector.extract(v, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([k]))


# -- value tiles ----------------------------------------------------------------------------
def store_part(ref, part: int, parts: int, value):
    """Column part `part` of `parts` of a (64, 256) view ← value (its value layout). The
    view is of GMEM (plain stores) or of an SMEM tile with `swizzled`'s transforms (the
    stores planned to spread over the banks)."""
    width = BLOCK // parts
    _jax_private.mgpu_store(ref.at[:, pl.ds(width * part, width)], value,
                            tiled=_in_smem(ref))


def _in_smem(ref) -> bool:
    base = getattr(ref, "ref", ref)           # a view (`ref.at[...]`) holds its buffer
    return jax.typeof(base).memory_space == plgpu.SMEM


def store_values(ref, values):
    """Value parts → a (64, 256) view (of GMEM, or of an SMEM tile with `swizzled`'s
    transforms)."""
    for p, part in enumerate(values):
        store_part(ref, p, len(values), part)


def swizzled(dtype) -> tuple:
    """The SMEM transforms of a (ROWS, BLOCK) tile of decoded values that `store_values`
    writes and a TMA copy sends out: (8, 128 / itemsize) tiling and a 128-byte swizzle, so
    the 16-byte vector stores of the value layout spread over the banks.

    Args:
      dtype: the values' dtype (bf16, f16 or f32).
    Returns:
      transforms for `plgpu.SMEM((ROWS, BLOCK), dtype, transforms=...)` or a BlockSpec."""
    return (plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(128))
