"""Compressed collectives for use inside `jax.shard_map`: drop-ins for lax.psum & co.

`psum` is the two-shot all-reduce of DESIGN_NOTES §2:
  1. compress x as P segments (segment j is owned by device j);
  2. all-to-all the compressed segments (the reduce-scatter half);
  3.–4. the owner decompresses the P−1 copies it received, adds its own segment
     unquantized in fp32 and compresses the sum once (one fused kernel);
  5. all-gather the compressed sums; every device decodes the *same* bytes, so the result
     is bit-identical on every device, as lax.psum's is.
Every element is quantized at most twice for any axis size.

All ops are `custom_vjp`s whose backward passes are themselves compressed collectives:
psum ↔ pvary (Megatron's g and f), all_gather ↔ psum_scatter.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import config as _jax_config

from taco_jax import codecs, dispatch, telemetry

# Below this many bytes per device, the fixed latency of three kernels and two collectives
# loses to one NCCL all-reduce; measured on 2×H200 (docs/results.md).
DEFAULT_MIN_BYTES = 4 << 20


# -- argument handling ----------------------------------------------------------
def _check_vma() -> bool:
    return bool(_jax_config._check_vma.value)


def _single_axis(axis_name, op: str):
    axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    if len(axes) != 1:
        raise ValueError(f"taco_jax.{op} compresses over one mesh axis; got "
                         f"axis_name={axis_name!r}. Nest calls, one per axis.")
    return axes[0]


def _axis_size(axis, op: str) -> int:
    try:
        return lax.axis_size(axis)
    except NameError as e:
        raise ValueError(f"taco_jax.{op}: axis_name={axis!r} is not a mesh axis bound "
                         f"here; call it inside jax.shard_map over a mesh with that axis "
                         f"({e})") from None


def _compressible(x, codec) -> bool:
    return (not getattr(codec, "is_identity", False)
            and jnp.issubdtype(jnp.result_type(x), jnp.floating)
            and jnp.result_type(x) in codecs.FLOAT_DTYPES)


def _varying(x, axis) -> bool:
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    return mat is not None and axis in mat.varying


# -- the two-shot all-reduce ------------------------------------------------------
def _segments(x, p: int, block: int):
    """Flatten and pad to P·nb whole blocks: (P·nb, B) with segment j = rows [j·nb, (j+1)·nb)."""
    flat = x.reshape(-1)
    nb = max(1, -(-flat.size // (p * block)))
    pad = p * nb * block - flat.size
    if pad:
        flat = jnp.pad(flat, (0, pad))
    return flat.reshape(p * nb, block), nb


def _two_shot(x, axis, codec, p: int):
    blocks, nb = _segments(x, p, codec.block_size)                  # (P·nb, B)
    me = lax.axis_index(axis)
    wire = dispatch.compress(blocks, codec).reshape(p, nb, codec.row_bytes)
    recv = lax.all_to_all(wire, axis, 0, 0)                          # recv[j]: from device j
    own = lax.dynamic_slice_in_dim(blocks, me * nb, nb)             # exact own segment
    mine = dispatch.reduce(recv, own, me, codec)                    # (nb, row) compressed sum
    everyone = lax.all_gather(mine, axis, to="invarying" if _check_vma() else "varying")
    out = dispatch.decompress(everyone.reshape(p * nb, codec.row_bytes), codec, x.dtype)
    y = codecs.from_blocks(out, x.shape)
    if telemetry.enabled():
        telemetry.report("psum", x, y, axis, codec, wire_bytes=2 * p * nb * codec.row_bytes)
    return y


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _psum(x, axis, codec, p, vma):
    return _two_shot(x, axis, codec, p)


def _psum_fwd(x, axis, codec, p, vma):
    return _two_shot(x, axis, codec, p), None


def _psum_bwd(axis, codec, p, vma, _, g):
    # lax.psum's transpose: under check_vma the cotangent of an invariant output is
    # broadcast to the varying input; without it, JAX's convention is psum(g).
    if vma:
        return (lax.pcast(g, axis, to="varying"),)
    return (_psum(g, axis, codec, p, vma),)


_psum.defvjp(_psum_fwd, _psum_bwd)


def psum(x, axis_name, *, codec="taco", min_bytes: int | None = None):
    """Drop-in for `jax.lax.psum` inside `jax.shard_map`, compressed with `codec`.

    Leaves that are not float32/bfloat16/float16, smaller than `min_bytes`
    (default DEFAULT_MIN_BYTES) or on an axis of size 1, and every leaf with codec="none",
    go through `lax.psum` unchanged. The result is identical on every device.
    """
    codec = codecs.get(codec)
    axis = _single_axis(axis_name, "psum")
    p = _axis_size(axis, "psum")
    min_bytes = DEFAULT_MIN_BYTES if min_bytes is None else int(min_bytes)
    vma = _check_vma()

    def leaf(v):
        v = jnp.asarray(v)
        if (p == 1 or not _compressible(v, codec) or v.size * v.dtype.itemsize < min_bytes
                or (vma and not _varying(v, axis))):
            return lax.psum(v, axis)
        return _psum(v, axis, codec, p, vma)
    return jax.tree.map(leaf, x)


# -- pvary: Megatron's f (identity forward, compressed all-reduce backward) ----------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _pvary(x, axis, codec, p, vma):
    return lax.pcast(x, axis, to="varying") if vma else x


def _pvary_fwd(x, axis, codec, p, vma):
    return _pvary(x, axis, codec, p, vma), None


def _pvary_bwd(axis, codec, p, vma, _, g):
    return (_psum(g, axis, codec, p, vma),)


_pvary.defvjp(_pvary_fwd, _pvary_bwd)


def pvary(x, axis_name, *, codec="taco", min_bytes: int | None = None):
    """Identity forward; compressed psum of the cotangent backward (Megatron's `f`).

    Under check_vma=True the result is varying over `axis_name` (like
    `lax.pcast(x, axis_name, to="varying")`), so column-parallel weights can consume it."""
    codec = codecs.get(codec)
    axis = _single_axis(axis_name, "pvary")
    p = _axis_size(axis, "pvary")
    min_bytes = DEFAULT_MIN_BYTES if min_bytes is None else int(min_bytes)
    vma = _check_vma()

    def leaf(v):
        v = jnp.asarray(v)
        if vma and _varying(v, axis):
            raise ValueError(f"taco_jax.pvary: x is already varying over {axis!r}")
        if (p == 1 or not _compressible(v, codec) or v.size * v.dtype.itemsize < min_bytes):
            return lax.pcast(v, axis, to="varying") if vma else v
        return _pvary(v, axis, codec, p, vma)
    return jax.tree.map(leaf, x)
