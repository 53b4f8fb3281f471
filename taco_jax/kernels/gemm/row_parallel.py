"""The row-parallel GEMM of tensor parallelism with its compressed all-reduce (or, under
sequence parallelism, reduce-scatter) and residual add, in two launches: `encode_epilogue`
(GEMM, encode, each tile's wire stored into its destinations' receive buffers) then
`decode_residual` (decode the P wires, sum in f32, add the residual). The partial and the
decoded sum stay on chip.

    all-reduce:      y = round(residual + Σ_j decode(encode(round(x_j @ w_j)))),
    reduce-scatter:  rows [o·M/P, (o+1)·M/P) of it on device o, its residual those rows,

j = 0 … P − 1 in order. One quantization per element; every device decodes the same bytes
in the same order, so all get the same bits (the reduce-scatter's shards are the
all-reduce's rows, bit for bit). Per output element a device writes P wire copies and
reads P (all-reduce), or writes one and reads P of its 1/P of the rows (reduce-scatter),
plus the residual's read and the result's write. The library selects them
(`collectives.gemm_fused`: matmul_reduce_scatter, matmul_psum) only where their loopback
checks passed on a GPU (`kernels.fused.checked`, kernels "gemm_owner", "gemm_all", from
`bench/gemm_codec.py`'s rows).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from taco_jax.kernels.gemm import decode_residual, encode_epilogue
from taco_jax.kernels.gemm.config import GemmConfig
from taco_jax.kernels.gemm.decode_residual import DecodeConfig


def unsupported(codec, p: int, x_shape, w_shape, dtype, cfg: GemmConfig | None = None,
                decode_cfg: DecodeConfig | None = None, scatter: bool = False) -> str | None:
    """Why the two launches do not cover x (M, K) @ w (K, N) all-reduced (scatter:
    reduce-scattered by rows) over P devices (None: they do), for a dispatcher to fall back
    on."""
    exchange = "owner" if scatter else "all"
    why = encode_epilogue.unsupported(codec, p, x_shape, w_shape, dtype, cfg, exchange)
    if why is not None:
        return why
    m, n = x_shape[-2] // (p if scatter else 1), w_shape[-1]
    row_bytes = encode_epilogue.tile_codec(codec).row_bytes
    return decode_residual.unsupported(codec, p, (p, m * n // 256, row_bytes), (m, n), dtype,
                                       decode_cfg)


def gemm_allreduce(x, w, residual, axis: str, p: int, codec, *, out_mat=None,
                   cfg: GemmConfig | None = None, decode_cfg: DecodeConfig | None = None):
    """residual + Σ over mesh axis `axis` of x @ w, compressed, inside `jax.shard_map` on
    GPUs of one process (mesh devices 0..n−1 in order).

    Args:
      x: this device's (M, K) bf16 or f16 input; w: its (K, N) weight shard.
      residual: (M, N) of x's dtype, the same on every device (the residual stream).
      axis, p: the mesh axis and its size (1..8). codec: with tile math (`unsupported`).
      out_mat: the results' `manual_axis_type` under check_vma (None without).
      cfg, decode_cfg: the two launches' configurations (None: their defaults).
    Returns: (M, N) in x's dtype, the same bits on every device.
    Raises: ValueError naming what is not covered."""
    recv = encode_epilogue.gemm_encode_exchange(x, w, axis, p, codec, out_mat=out_mat,
                                                cfg=cfg)
    return decode_residual.decode_launch(recv, residual, codec, decode_cfg, out_mat)


def gemm_reduce_scatter(x, w, residual, axis: str, p: int, codec, *, out_mat=None,
                        cfg: GemmConfig | None = None,
                        decode_cfg: DecodeConfig | None = None):
    """This device's rows of residual + Σ over `axis` of x @ w, compressed: Megatron-SP's
    row-parallel GEMM and reduce-scatter (along M) with the residual add, inside
    `jax.shard_map` as `gemm_allreduce`.

    Args:
      x, w: as `gemm_allreduce`'s; M / 64 divisible by P.
      residual: (M / P, N), this device's rows of the residual stream (device o owns rows
        [o·M/P, (o+1)·M/P), o its index along `axis`).
    Returns: (M / P, N) in x's dtype.
    Raises: ValueError naming what is not covered."""
    recv = encode_epilogue.gemm_encode_exchange(x, w, axis, p, codec, exchange="owner",
                                                out_mat=out_mat, cfg=cfg)
    return decode_residual.decode_launch(recv, residual, codec, decode_cfg, out_mat)


@functools.partial(jax.jit, static_argnames=("codec", "cfg", "decode_cfg", "scatter"))
def loopback_gemm_allreduce(xs, ws, residual, codec, cfg: GemmConfig | None = None,
                            decode_cfg: DecodeConfig | None = None, scatter: bool = False):
    """The two launches on one GPU for P = xs.shape[0] virtual devices.

    Args:
      xs: (P, M, K); ws: (P, K, N); residual: (M, N), every device's residual stream.
      scatter: False, the all-reduce; True, the reduce-scatter (device o's rows its own).
    Returns: (P, M, N), row d what device d computes (all equal when correct); scatter:
      (P, M / P, N), device o's rows.
    Raises: ValueError as `gemm_allreduce`."""
    p = xs.shape[0]
    m, n = residual.shape
    exchange = "owner" if scatter else "all"
    recv = encode_epilogue.loopback_gemm_encode(xs, ws, codec, cfg, exchange)
    res = (residual.reshape(p, m // p, n) if scatter else
           jnp.broadcast_to(residual, (p, m, n)))
    return decode_residual.decode_sum_residual(recv, res, codec, decode_cfg)


def gemm_allreduce_reference(xs, ws, residual, codec):
    """Plain jnp: round(residual + Σ_j decode(encode(round(xs[j] @ ws[j])))) in f32, j in
    order: (M, N) for xs (P, M, K), ws (P, K, N), residual (M, N). Its rows
    [o·M/P, (o+1)·M/P) are the reduce-scatter's device o's."""
    wires = jnp.stack([encode_epilogue.gemm_encode_reference(xs[j], ws[j], codec)
                       for j in range(xs.shape[0])])
    return decode_residual.decode_sum_residual_reference(wires, residual, codec)
