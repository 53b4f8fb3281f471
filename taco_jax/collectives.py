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

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import config as _jax_config

from taco_jax import codecs, dispatch, telemetry
from taco_jax.ops.common import KernelConfig

# Below this many bytes per device the compressed path does not beat one NCCL all-reduce
# on 2×H200 NVLink with the current kernels. Measured on a freshly computed input (no copy
# before lax.psum's in-place all-reduce; bench/collectives.py `fresh_ratio`, commit 66cd092):
# taco/lax 1.21 at 16 MiB, 1.11 at 64 MiB, 1.02 at 256 MiB, 0.99 at 1 GiB, so only the
# largest tensors break even. (The older 128 MiB value came from a loop that charged
# lax.psum a 127 µs input copy at 256 MiB.) Slower links (PCIe, inter-node) break even far
# lower: pass min_bytes explicitly there, e.g. from taco_jax.tuning.calibrate_min_bytes.
DEFAULT_MIN_BYTES = 512 << 20
# Chunking (paper: 64 MB chunks) only pays if one chunk's kernels overlap another chunk's
# collectives. XLA does schedule them asynchronously (all-to-all-start … compress of the
# next chunk … all-to-all-done), but measured on 2×H200 chunks were slower (64 MiB chunks:
# 0.93 vs 0.90 unchunked at 256 MiB; 16–32 MiB: 1.1–1.6), so it is off by default.
DEFAULT_CHUNK_BYTES = 0
# Chunked only: cap the kernels' grid at this many programs (0 = one program per tile), to
# leave SMs to NCCL while a chunk's compression overlaps another's transfer. Off: measured
# on 2×H200 at 256 MiB in 64 MiB chunks (bench/results/profile_overlap.json), overlapped
# chunks inflate NCCL time 554 → 822 µs and kernel time 352 → 479 µs, and a cap of 100 or
# 66 programs leaves NCCL at 812–816 µs while the kernels slow to 969–1397 µs: the
# contention is not for SMs.
OVERLAP_PROGRAMS = 0


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


@dataclasses.dataclass(frozen=True)
class _Call:
    """The validated, static arguments of one psum / pvary call."""
    codec: object
    axis: object
    p: int
    min_bytes: int
    chunk: int
    vma: bool

    @staticmethod
    def make(op: str, axis_name, codec, min_bytes, chunk_bytes) -> "_Call":
        axis = _single_axis(axis_name, op)
        return _Call(codecs.get(codec), axis, _axis_size(axis, op),
                     DEFAULT_MIN_BYTES if min_bytes is None else int(min_bytes),
                     DEFAULT_CHUNK_BYTES if chunk_bytes is None else int(chunk_bytes),
                     _check_vma())

    def taps(self, v) -> bool:
        """Does telemetry.capture see this leaf? Every float all-reduce over > 1 device."""
        return self.p > 1 and jnp.issubdtype(v.dtype, jnp.floating)

    def compresses(self, v) -> bool:
        return (self.p > 1 and _compressible(v, self.codec)
                and v.size * v.dtype.itemsize >= self.min_bytes)


def _varying(x, axis) -> bool:
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    return mat is not None and axis in mat.varying


# -- the two-shot all-reduce ------------------------------------------------------
def _chunking(n: int, p: int, block: int, itemsize: int, chunk_bytes: int | None):
    """(k chunks, nb rows per segment per chunk): rows = k·P·nb ≥ n / B. Prefers a k that
    divides the segment rows evenly, so tensors of whole blocks need no padding copy."""
    seg_rows = max(1, -(-n // (p * block)))
    if not chunk_bytes:
        return 1, seg_rows
    target = max(1, -(-seg_rows * p * block * itemsize // chunk_bytes))
    for k in range(target, 2 * target + 1):
        if seg_rows % k == 0:
            return k, seg_rows // k
    return target, -(-seg_rows // target)


def _two_shot(x, axis, codec, p: int, chunk_bytes: int | None):
    """Chunk c covers rows [c·P·nb, (c+1)·P·nb) of the (rows, B) block view; within it,
    segment j (nb rows) is owned by device j. Chunks are independent, so XLA can overlap
    the kernels of one chunk with the collectives of another."""
    b, row = codec.block_size, codec.row_bytes
    flat = x.reshape(-1)
    k, nb = _chunking(flat.size, p, b, x.dtype.itemsize, chunk_bytes)
    total = k * p * nb
    if total * b != flat.size:
        flat = jnp.pad(flat, (0, total * b - flat.size))
    blocks = flat.reshape(total, b)                                  # (rows, B)
    me = lax.axis_index(axis)
    to = "invarying" if _check_vma() else "varying"
    cfg = None
    if k > 1 and OVERLAP_PROGRAMS:
        cfg = dataclasses.replace(KernelConfig.default(b), max_programs=OVERLAP_PROGRAMS)
    out = None
    for c in range(k):
        base = c * p * nb
        wire = dispatch.compress(blocks, codec, row0=base, n_rows=p * nb,
                                 skip_start=me * nb, skip_rows=nb, cfg=cfg)  # own: unused
        recv = lax.all_to_all(wire.reshape(p, nb, row), axis, 0, 0)  # recv[j]: from device j
        mine = dispatch.reduce(recv, blocks, me, codec, own_row0=base + me * nb, cfg=cfg)
        everyone = lax.all_gather(mine, axis, to=to)                 # (P, nb, row)
        out = dispatch.decompress(everyone.reshape(p * nb, row), codec, x.dtype, into=out,
                                  row0=base, total_rows=total, cfg=cfg)
    y = codecs.from_blocks(out, x.shape)
    if telemetry.enabled():
        telemetry.report("psum", x, y, axis, codec, wire_bytes=2 * total * row)
    return y


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _psum(x, axis, codec, p, vma, chunk):
    return _two_shot(x, axis, codec, p, chunk)


def _psum_fwd(x, axis, codec, p, vma, chunk):
    # Call the custom_vjp itself (not _two_shot): under higher-order AD JAX differentiates
    # this rule, and _two_shot's integer wire codes would give a zero derivative.
    return _psum(x, axis, codec, p, vma, chunk), None


def _psum_bwd(axis, codec, p, vma, chunk, _, g):
    # lax.psum's transpose: under check_vma the cotangent of an invariant output is
    # broadcast to the varying input; without it, JAX's convention is psum(g).
    if vma:
        return (lax.pcast(g, axis, to="varying"),)
    return (_psum(g, axis, codec, p, vma, chunk),)


_psum.defvjp(_psum_fwd, _psum_bwd)


def psum(x, axis_name, *, codec="taco", min_bytes: int | None = None,
         chunk_bytes: int | None = None):
    """Drop-in for `jax.lax.psum` inside `jax.shard_map`, compressed with `codec`.

    Leaves that are not float32/bfloat16/float16, smaller than `min_bytes`
    (default DEFAULT_MIN_BYTES) or on an axis of size 1, and every leaf with codec="none",
    go through `lax.psum` unchanged. The result is identical on every device.
    Tensors larger than `chunk_bytes` (default DEFAULT_CHUNK_BYTES; 0 = never) are split
    into chunks whose compression overlaps the communication of their neighbours.
    """
    op = _Call.make("psum", axis_name, codec, min_bytes, chunk_bytes)

    def leaf(v):
        v = jnp.asarray(v)
        tap = telemetry.capturing() and op.taps(v) and not (op.vma and not _varying(v, op.axis))
        if tap:     # fidelity study: the tensor this all-reduce sums, whatever the route
            telemetry.capture_value("fwd", "psum", v, op.axis)
        if not op.compresses(v) or (op.vma and not _varying(v, op.axis)):
            y = lax.psum(v, op.axis)
        else:
            y = _psum(v, op.axis, op.codec, op.p, op.vma, op.chunk)
        if tap and not op.vma:   # psum's transpose all-reduces the cotangent of y
            y = telemetry.capture_cotangent(y, "psum", op.axis)
        return y
    return jax.tree.map(leaf, x)


# -- pvary: Megatron's f (identity forward, compressed all-reduce backward) ----------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _pvary(x, axis, codec, p, vma, chunk):
    return lax.pcast(x, axis, to="varying") if vma else x


def _pvary_fwd(x, axis, codec, p, vma, chunk):
    return _pvary(x, axis, codec, p, vma, chunk), None


def _pvary_bwd(axis, codec, p, vma, chunk, _, g):
    return (_psum(g, axis, codec, p, vma, chunk),)   # only reached with check_vma=True


_pvary.defvjp(_pvary_fwd, _pvary_bwd)


def pvary(x, axis_name, *, codec="taco", min_bytes: int | None = None,
          chunk_bytes: int | None = None):
    """Identity forward; compressed psum of the cotangent backward (Megatron's `f`).

    Under check_vma=True the result is varying over `axis_name` (like
    `lax.pcast(x, axis_name, to="varying")`), so column-parallel weights can consume it.
    Under check_vma=False it is the identity both ways: JAX's own convention there already
    sums the cotangents of replicated values (at the shard_map boundary, and through
    psum's transpose), so an all-reduce here would count them P times. Use
    check_vma=True to get the compressed backward all-reduce."""
    op = _Call.make("pvary", axis_name, codec, min_bytes, chunk_bytes)

    def leaf(v):
        v = jnp.asarray(v)
        if op.vma and _varying(v, op.axis):
            raise ValueError(f"taco_jax.pvary: x is already varying over {op.axis!r}")
        if not op.vma:
            return v
        if not op.compresses(v):
            y = lax.pcast(v, op.axis, to="varying")
        else:
            y = _pvary(v, op.axis, op.codec, op.p, op.vma, op.chunk)
        if telemetry.capturing() and op.taps(v):   # backward all-reduces y's cotangent
            y = telemetry.capture_cotangent(y, "pvary", op.axis)
        return y
    return jax.tree.map(leaf, x)


# -- all_gather and psum_scatter (sequence parallelism): each the other's transpose -------------
def _stack_or_concat(parts, axis: int, tiled: bool):
    """parts (P, *shape) → lax.all_gather's layout for `axis` / `tiled`."""
    if not tiled:
        return jnp.moveaxis(parts, 0, axis)
    return jnp.concatenate(list(parts), axis=axis)


def _gather(x, axis_name, codec, p, axis: int, tiled: bool):
    blocks = codecs.to_blocks(x, codec.block_size)                   # (nb, B)
    wire = dispatch.compress(blocks, codec)
    everyone = lax.all_gather(wire, axis_name)                       # (P, nb, row)
    dec = dispatch.decompress(everyone.reshape(-1, codec.row_bytes), codec, x.dtype)
    parts = jax.vmap(lambda b: codecs.from_blocks(b, x.shape))(
        dec.reshape(p, blocks.shape[0], codec.block_size))
    return _stack_or_concat(parts, axis, tiled)


def _scatter(x, axis_name, codec, p, dim: int, tiled: bool):
    """Reduce-scatter: compressed all-to-all, owner sums in fp32 with its own part exact."""
    xs = jnp.moveaxis(x, dim, 0)
    seg_shape = (xs.shape[0] // p, *xs.shape[1:]) if tiled else xs.shape[1:]
    segs = xs.reshape(p, -1)                                         # (P, m)
    m = segs.shape[1]
    nb = max(1, -(-m // codec.block_size))
    blocks = jnp.pad(segs, ((0, 0), (0, nb * codec.block_size - m))).reshape(p * nb, -1)
    me = lax.axis_index(axis_name)
    wire = dispatch.compress(blocks, codec).reshape(p, nb, codec.row_bytes)
    recv = lax.all_to_all(wire, axis_name, 0, 0)                     # recv[j]: from device j
    dec = dispatch.decompress(recv.reshape(p * nb, -1), codec, jnp.float32).reshape(p, nb, -1)
    own = lax.dynamic_index_in_dim(blocks.reshape(p, nb, -1), me, 0, keepdims=False)
    peers = jnp.where((jnp.arange(p) == me)[:, None, None], 0.0, dec).sum(0)
    total = (own.astype(jnp.float32) + peers).reshape(-1)[:m].astype(x.dtype)
    out = total.reshape(seg_shape)                                   # (k, *rest) or rest
    return jnp.moveaxis(out, 0, dim) if tiled else out


def _transpose_pair(forward_a, forward_b):
    """Two custom_vjp ops, each the other's transpose (all_gather ↔ psum_scatter). Static
    args after x: (axis_name, codec, p, dim, tiled); the fwd rules call the ops themselves so
    higher-order AD keeps using these rules."""
    ops = []
    for fwd in (forward_a, forward_b):
        op = jax.custom_vjp(fwd, nondiff_argnums=(1, 2, 3, 4, 5))
        ops.append(op)
    for k, op in enumerate(ops):
        other = ops[1 - k]
        op.defvjp(lambda x, *a, op=op: (op(x, *a), None),
                  lambda *a, other=other: (other(a[-1], *a[:5]),))
    return ops


_all_gather, _psum_scatter = _transpose_pair(_gather, _scatter)


def all_gather(x, axis_name, *, axis: int = 0, tiled: bool = False, codec="taco",
               min_bytes: int | None = None):
    """`lax.all_gather` with compressed payloads (signature and layout as lax's, default
    `to="varying"`). Every device decodes the same bytes, its own part included, so all
    copies agree. Gradient: the compressed `psum_scatter`."""
    op = _Call.make("all_gather", axis_name, codec, min_bytes, 0)

    def leaf(v):
        v = jnp.asarray(v)
        ax = axis if axis >= 0 else axis + v.ndim + (0 if tiled else 1)
        if not op.compresses(v):
            return lax.all_gather(v, op.axis, axis=ax, tiled=tiled)
        return _all_gather(v, op.axis, op.codec, op.p, ax, tiled)
    return jax.tree.map(leaf, x)


def psum_scatter(x, axis_name, *, scatter_dimension: int = 0, tiled: bool = False,
                 codec="taco", min_bytes: int | None = None):
    """`lax.psum_scatter` with compressed payloads: a compressed all-to-all, then each
    device sums its part in fp32 with its own contribution exact (one quantization per
    element). Gradient: the compressed `all_gather`."""
    op = _Call.make("psum_scatter", axis_name, codec, min_bytes, 0)

    def leaf(v):
        v = jnp.asarray(v)
        dim = scatter_dimension % max(v.ndim, 1)
        size = v.shape[dim] if v.ndim else 0
        if (not tiled and size != op.p) or (tiled and size % op.p):
            raise ValueError(f"taco_jax.psum_scatter: dimension {dim} of shape {v.shape} must "
                             f"{'be divisible by' if tiled else 'equal'} the axis size {op.p}")
        if not op.compresses(v):
            return lax.psum_scatter(v, op.axis, scatter_dimension=dim, tiled=tiled)
        return _psum_scatter(v, op.axis, op.codec, op.p, dim, tiled)
    return jax.tree.map(leaf, x)
