"""`psum` and `pvary`: Megatron's g and f, compressed, as a `custom_vjp` pair.

psum is the compressed two-shot all-reduce (`two_shot`); its backward is lax.psum's
transpose. pvary is the identity forward and the compressed all-reduce of the cotangent
backward (under check_vma=True)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from taco_jax import telemetry
from taco_jax.collectives import axes as axes_lib, fused
from taco_jax.collectives.call import Call, transport_move
from taco_jax.collectives.two_shot import one_shot, two_shot


def allreduce(x, axis, codec, p: int, vma: bool, transport: str):
    """The compressed psum over one transport: the xla transport's two-shot; the fused
    transport's one-launch kernel where it covers the codec and dtype (the one-shot at
    P = 2, the two-shot beyond; under jax.vmap its loopback), else its separate kernels:
    the one-shot at P = 2 (and for exact sums, codec "none"), the two-shot beyond."""
    if transport == "fused" and fused.one_launch_reason(codec, p, x.dtype) is None:
        return fused.one_launch(x, axis, codec, p, vma)
    move = transport_move(transport, axis)
    if transport == "fused" and (p == 2 or codec.is_identity):
        return one_shot(x, axis, codec, p, vma, move)
    return two_shot(x, axis, codec, p, vma, move=move)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _psum(x, axis, codec, p, vma, transport):
    return allreduce(x, axis, codec, p, vma, transport)


def _psum_fwd(x, axis, codec, p, vma, transport):
    # Call the custom_vjp itself (not allreduce): under higher-order AD JAX differentiates
    # this rule, and the integer wire codes would give a zero derivative.
    return _psum(x, axis, codec, p, vma, transport), None


def _psum_bwd(axis, codec, p, vma, transport, _, g):
    # lax.psum's transpose: under check_vma the cotangent of an invariant output is
    # broadcast to the varying input; without it (and under vmap) it is psum(g).
    axes = axes_lib.as_tuple(axis)
    if vma:
        if axes_lib.emulated(axes):     # the shared result's cotangent, to every member
            return (g,)
        return (lax.pcast(g, axis, to="varying"),)
    with axes_lib.bound(axes, p):
        return (_psum(g, axis, codec, p, vma, transport),)


_psum.defvjp(_psum_fwd, _psum_bwd)


def psum(x, axis_name, *, codec=None, min_bytes: int | None = None,
         transport: str | None = None):
    """Compressed all-reduce sum over `axis_name`: a drop-in for `jax.lax.psum`.

    Call it inside `jax.shard_map` (or `jax.vmap` with an `axis_name`). A float leaf of at
    least `min_bytes` per device takes the compressed two-shot all-reduce: each element is
    quantized at most twice, and the result is bit-identical on every device. Any other
    leaf takes `lax.psum` and traces to exactly its jaxpr: a leaf that is not
    float32/bfloat16/float16, on an axis of size 1, with codec "none", below `min_bytes`,
    or (check_vma=True) invariant over the axis. `telemetry.sites()` tells which route
    each call site took and why.

    Args:
      x: an array, or a pytree of arrays.
      axis_name: a mesh axis name, or a tuple/list of names (summed over all of them).
      codec: a codec name (`taco_jax.codecs.names()`) or a `taco_jax.codecs.Codec`; None
        (default): the recipe's (`taco_jax.config`).
      min_bytes: an int >= 0, the smallest leaf (bytes per device) that is compressed;
        None (default): the recipe's, whose own None means this machine's calibration
        (`python -m taco_jax.calibrate`), else `taco_jax.DEFAULT_MIN_BYTES`.
      transport: how compressed bytes move: "xla" (XLA's all-to-all and all-gather),
        "fused" (in-kernel stores into the peers' memory; GPUs of one process, one mesh
        axis) or "auto" (the calibration's choice per size, else "xla"); None (default):
        the recipe's.

    Returns:
      `x`'s structure, each leaf the sum over `axis_name` in the leaf's dtype, replicated
      (invariant over the axis under check_vma=True). Gradient: lax.psum's transpose (under
      check_vma=False and under vmap, the same compressed psum of the cotangent).

    Raises:
      UnboundAxisError: (a NameError) a name in `axis_name` is not bound here.
      ValueError: an unknown codec name; an empty or repeated `axis_name`; a `min_bytes`
        or `transport` outside the values above; transport="fused" where it cannot run
        (the message says why).
      TypeError: a codec that is neither a name nor a Codec.
    """
    op = Call.make("psum", axis_name, codec, min_bytes, transport)

    def leaf(v):
        v = jnp.asarray(v)
        invariant = op.vma and not axes_lib.varying(v, op.axes)
        tap = telemetry.capturing() and op.taps(v) and not invariant
        if tap:     # fidelity study: the tensor this all-reduce sums, whatever the route
            telemetry.capture_value("fwd", "psum", v, op.axis)
        route = op.route(v, invariant=invariant)
        if route == "lax":
            y = lax.psum(v, op.axis)
        else:
            # under vmap an input shared by the members (unbatched) would meet the codec's
            # reshapes unbatched while the exchange batches them: give each member its copy
            v = axes_lib.per_member(v, op.axes, force=True)
            y = _psum(v, op.axis, op.codec, op.p, op.vma, route)
        if tap and not op.vma:   # psum's transpose all-reduces the cotangent of y
            y = telemetry.capture_cotangent(y, "psum", op.axis)
        return y
    return jax.tree.map(leaf, x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _pvary(x, axis, codec, p, vma, transport):
    axes = axes_lib.as_tuple(axis)
    if axes_lib.emulated(axes):       # each member's cotangent must reach the backward
        return axes_lib.per_member(x, axes, force=True)
    return lax.pcast(x, axis, to="varying") if vma else x


def _pvary_fwd(x, axis, codec, p, vma, transport):
    return _pvary(x, axis, codec, p, vma, transport), None


def _pvary_bwd(axis, codec, p, vma, transport, _, g):
    # only reached with check_vma=True (or the recipe's vmap_check_vma)
    axes = axes_lib.as_tuple(axis)
    if not axes_lib.emulated(axes):
        return (_psum(g, axis, codec, p, vma, transport),)
    with axes_lib.bound(axes, p):
        total = _psum(g, axis, codec, p, vma, transport)
        # vmap sums the members' cotangents of a shared input: give the total to one
        return (jnp.where(lax.axis_index(axis) == 0, total, jnp.zeros_like(total)),)



_pvary.defvjp(_pvary_fwd, _pvary_bwd)


def pvary(x, axis_name, *, codec=None, min_bytes: int | None = None,
          transport: str | None = None):
    """Identity forward, compressed psum of the cotangent backward (Megatron's `f`): a
    drop-in for `jax.lax.pcast(x, axis_name, to="varying")`.

    Under check_vma=True the result is varying over `axis_name`, so column-parallel weights
    can consume it, and its backward all-reduces the cotangent, compressed as `psum` is
    (the plain route traces to exactly lax.pcast's jaxpr). Under check_vma=False (and under
    vmap, unless the recipe's `vmap_check_vma`) it is the identity both ways: JAX's
    convention there already sums the cotangents of replicated values (at the shard_map
    boundary, and through psum's transpose), so an all-reduce here would count them P times.

    Args:
      x: an array, or a pytree of arrays, invariant over `axis_name`.
      axis_name: a mesh axis name, or a tuple/list of names.
      codec, min_bytes, transport: as `taco_jax.psum`'s, for the backward all-reduce
        (each None by default: the recipe's).

    Returns:
      `x`, varying over `axis_name` under check_vma=True; unchanged otherwise.

    Raises:
      UnboundAxisError: (a NameError) a name in `axis_name` is not bound here.
      ValueError: a leaf already varying over `axis_name` (check_vma=True); an unknown
        codec name, a bad `axis_name`, `min_bytes` or `transport` (as `taco_jax.psum`).
      TypeError: a codec that is neither a name nor a Codec.
    """
    op = Call.make("pvary", axis_name, codec, min_bytes, transport)

    def leaf(v):
        v = jnp.asarray(v)
        if not op.vma:
            return v
        if axes_lib.varying(v, op.axes) and not axes_lib.emulated(op.axes):
            raise ValueError(f"taco_jax.pvary: x is already varying over {op.axis!r}")
        route = op.route(v)
        if route == "lax":
            y = v if axes_lib.emulated(op.axes) else lax.pcast(v, op.axis, to="varying")
        else:
            y = _pvary(v, op.axis, op.codec, op.p, op.vma, route)
        if telemetry.capturing() and op.taps(v):   # backward all-reduces y's cotangent
            y = telemetry.capture_cotangent(y, "pvary", op.axis)
        return y
    return jax.tree.map(leaf, x)
