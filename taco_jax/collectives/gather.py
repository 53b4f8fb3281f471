"""`all_gather` and `psum_scatter` (sequence parallelism), compressed, each the other's
transpose. They are the two halves of the two-shot all-reduce."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from taco_jax import codecs, telemetry
from taco_jax.collectives import axes as axes_lib, members
from taco_jax.collectives.call import Call, transport_move
from taco_jax.collectives.two_shot import gather_decoded, scatter_sum
from taco_jax.kernels import dispatch


def _gather(x, axis, codec, p, dim: int, tiled: bool, transport: str):
    return _gathered(x, axis, codec, p, dim, tiled, transport, False)


def _gathered(x, axis, codec, p, dim: int, tiled: bool, transport: str, invariant: bool):
    """Every device decodes the same bytes, its own part included, so all copies agree."""
    blocks = codecs.to_blocks(x, codec.block_size)                   # (nb, B)
    wire = dispatch.compress(blocks, codec)
    dec = gather_decoded(wire, axis, codec, p, x.dtype, vma=invariant,
                         move=transport_move(transport, axis))
    parts = jax.vmap(lambda b: codecs.from_blocks(b, x.shape))(
        dec.reshape(p, blocks.shape[0], codec.block_size))           # (P, *x.shape)
    y = jnp.moveaxis(parts, 0, dim) if not tiled else jnp.concatenate(list(parts), axis=dim)
    y = y if invariant else axes_lib.per_member(y, axes_lib.as_tuple(axis), force=True)
    if telemetry.enabled():   # against the exact gather of the same tensor, in f32
        exact = lax.all_gather(x.astype(jnp.float32), axis, axis=dim, tiled=tiled,
                               to="invarying" if invariant else "varying")
        got = y
        if invariant:          # the record sums over the axis: make both varying
            exact, got = (lax.pcast(v, axis, to="varying") for v in (exact, y))
        telemetry.report_send("all_gather", exact, got, axis, codec,
                              wire_bytes=(p - 1) * wire.size, bf16_bytes=2 * (p - 1) * x.size)
    return y


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5, 6))
def _all_gather_invariant(x, axis, codec, p, dim, tiled, transport):
    return _gathered(x, axis, codec, p, dim, tiled, transport, True)


def _agi_fwd(x, axis, codec, p, dim, tiled, transport):
    return _all_gather_invariant(x, axis, codec, p, dim, tiled, transport), None


def _agi_bwd(axis, codec, p, dim, tiled, transport, _, g):
    # every device holds the whole (invariant) cotangent: its own part is a slice of it
    # (statically under jax.vmap: `members`)
    axes = axes_lib.as_tuple(axis)
    n = g.shape[dim] // p if tiled else 1
    with axes_lib.bound(axes, p):
        part = members.take(g, axes, lambda me: me * n, n, dim)
    if not tiled:
        part = lax.squeeze(part, (dim,))
    if not axes_lib.varying(part, axes_lib.as_tuple(axis)):
        part = lax.pcast(part, axis, to="varying")
    return (part,)


_all_gather_invariant.defvjp(_agi_fwd, _agi_bwd)


def _scatter(x, axis, codec, p, dim: int, tiled: bool, transport: str):
    """Segment j of x along `dim` goes to device j; the owner sums in fp32 with its own part
    exact (one quantization per element)."""
    xs = jnp.moveaxis(x, dim, 0)
    seg_shape = (xs.shape[0] // p, *xs.shape[1:]) if tiled else xs.shape[1:]
    segs = xs.reshape(p, -1)                                         # (P, m)
    m = segs.shape[1]
    nb = max(1, -(-m // codec.block_size))
    blocks = jnp.pad(segs, ((0, 0), (0, nb * codec.block_size - m))).reshape(p * nb, -1)
    total, _ = scatter_sum(blocks, nb, axis, codec, p, transport_move(transport, axis))
    out = total.reshape(-1)[:m].astype(x.dtype).reshape(seg_shape)  # (k, *rest) or rest
    out = jnp.moveaxis(out, 0, dim) if tiled else out
    if telemetry.enabled():   # against the exact reduce-scatter, in f32
        exact = lax.psum_scatter(x.astype(jnp.float32), axis, scatter_dimension=dim,
                                 tiled=tiled)
        telemetry.report_send("psum_scatter", exact, out, axis, codec,
                              wire_bytes=(p - 1) * nb * codec.row_bytes,
                              bf16_bytes=2 * (p - 1) * m)
    return out


def _transpose_pair(forward_a, forward_b):
    """Two custom_vjp ops, each the other's transpose. Static args after x:
    (axis, codec, p, dim, tiled, transport); the fwd rules call the ops themselves so
    higher-order AD keeps using these rules."""
    ops = [jax.custom_vjp(fwd, nondiff_argnums=(1, 2, 3, 4, 5, 6))
           for fwd in (forward_a, forward_b)]
    for k, op in enumerate(ops):
        other = ops[1 - k]
        op.defvjp(lambda x, *a, op=op: (op(x, *a), None), functools.partial(_bwd, other))
    return ops


def _bwd(other, axis, codec, p, dim, tiled, transport, _, g):
    with axes_lib.bound(axes_lib.as_tuple(axis), p):
        return (other(g, axis, codec, p, dim, tiled, transport),)


_all_gather, _psum_scatter = _transpose_pair(_gather, _scatter)


def all_gather(x, axis_name, *, axis: int = 0, tiled: bool = False, to: str = "varying",
               codec=None, min_bytes: int | None = None, transport: str | None = None):
    """All-gather over `axis_name` with compressed payloads: a drop-in for
    `jax.lax.all_gather` (same signature, layouts and `to`).

    Each device compresses its leaf once; every device decodes the same bytes, its own
    part included, so all copies agree bit for bit. Leaves on the plain route (as
    `taco_jax.psum`'s: codec "none", below `min_bytes`, not float, axis of size 1) take
    `lax.all_gather` and trace to exactly its jaxpr.

    Args:
      x: an array, or a pytree of arrays.
      axis_name: a mesh axis name, or a tuple/list of names.
      axis: int, default 0: where the gathered dimension goes (negative counts from the
        end, as lax's).
      tiled: bool, default False: concatenate along `axis` instead of stacking a new one.
      to: "varying" (default) or "invarying" (check_vma=True only: the result is invariant
        over the axis).
      codec, min_bytes, transport: as `taco_jax.psum`'s (each None by default: the
        recipe's).

    Returns:
      `x`'s structure, each leaf gathered as `lax.all_gather` lays it out. Gradient: the
      compressed `taco_jax.psum_scatter` of the cotangent (to="varying"); with
      to="invarying", each device's own slice of the (invariant) cotangent.

    Raises:
      UnboundAxisError: (a NameError) a name in `axis_name` is not bound here.
      ValueError: `to` not "varying" or "invarying"; an unknown codec name, a bad
        `axis_name`, `min_bytes` or `transport` (as `taco_jax.psum`).
      TypeError: a codec that is neither a name nor a Codec.
    """
    op = Call.make("all_gather", axis_name, codec, min_bytes, transport)
    if to not in ("varying", "invarying"):
        raise ValueError(f"taco_jax.all_gather: to={to!r} must be 'varying' or 'invarying'")
    invariant = to == "invarying" and op.vma

    def leaf(v):
        v = jnp.asarray(v)
        ax = axis if axis >= 0 else axis + v.ndim + (0 if tiled else 1)
        route = op.route(v)
        if route == "lax":
            return lax.all_gather(v, op.axis, axis=ax, tiled=tiled, to=to)
        if invariant:
            return _all_gather_invariant(v, op.axis, op.codec, op.p, ax, tiled, route)
        return _all_gather(v, op.axis, op.codec, op.p, ax, tiled, route)
    return jax.tree.map(leaf, x)


def psum_scatter(x, axis_name, *, scatter_dimension: int = 0, tiled: bool = False,
                 codec=None, min_bytes: int | None = None, transport: str | None = None):
    """Reduce-scatter over `axis_name` with compressed payloads: a drop-in for
    `jax.lax.psum_scatter`.

    Segment j of each leaf (along `scatter_dimension`) goes to device j as compressed
    codes (an all-to-all); each device sums its segment in fp32 with its own part exact,
    so every element is quantized once. Leaves on the plain route (as `taco_jax.psum`'s)
    take `lax.psum_scatter` and trace to exactly its jaxpr.

    Args:
      x: an array, or a pytree of arrays.
      axis_name: a mesh axis name, or a tuple/list of names.
      scatter_dimension: int, default 0: the dimension split among the devices (negative
        counts from the end).
      tiled: bool, default False: that dimension is divisible by the axis size and keeps
        its rank (else it equals the axis size and is removed), as lax's.
      codec, min_bytes, transport: as `taco_jax.psum`'s (each None by default: the
        recipe's).

    Returns:
      `x`'s structure, each leaf this device's segment of the sum over `axis_name`, laid
      out as `lax.psum_scatter`'s. Gradient: the compressed `taco_jax.all_gather` of the
      cotangent.

    Raises:
      UnboundAxisError: (a NameError) a name in `axis_name` is not bound here.
      ValueError: the scattered dimension does not equal (tiled: is not divisible by) the
        axis size; an unknown codec name, a bad `axis_name`, `min_bytes` or `transport`
        (as `taco_jax.psum`).
      TypeError: a codec that is neither a name nor a Codec.
    """
    op = Call.make("psum_scatter", axis_name, codec, min_bytes, transport)

    def leaf(v):
        v = jnp.asarray(v)
        dim = scatter_dimension % max(v.ndim, 1)
        size = v.shape[dim] if v.ndim else 0
        if (not tiled and size != op.p) or (tiled and size % op.p):
            raise ValueError(f"taco_jax.psum_scatter: dimension {dim} of shape {v.shape} must "
                             f"{'be divisible by' if tiled else 'equal'} the axis size {op.p}")
        route = op.route(v)
        if route == "lax":
            return lax.psum_scatter(v, op.axis, scatter_dimension=dim, tiled=tiled)
        # an input shared by vmap's members: each member its copy (see psum)
        v = axes_lib.per_member(v, op.axes, force=True)
        return _psum_scatter(v, op.axis, op.codec, op.p, dim, tiled, route)
    return jax.tree.map(leaf, x)
