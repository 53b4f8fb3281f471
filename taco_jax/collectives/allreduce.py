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
from taco_jax.collectives import axes as axes_lib
from taco_jax.collectives.call import Call, transport_move
from taco_jax.collectives.two_shot import one_shot, two_shot


def allreduce(x, axis, codec, p: int, vma: bool, transport: str):
    """The compressed psum over one transport: the xla transport's two-shot; the fused
    transport's one-shot at P = 2 (and for exact sums, codec "none"), two-shot beyond."""
    move = transport_move(transport)
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
    """Drop-in for `jax.lax.psum` inside `jax.shard_map` (or `jax.vmap` with an axis name),
    compressed with `codec` (default: the recipe's, `taco_jax.config`).

    axis_name: one mesh axis or a tuple of them (compressed over their product). Leaves that
    are not float32/bfloat16/float16, smaller than `min_bytes` per device, on an axis of
    size 1, or with codec "none", go through `lax.psum` unchanged (`telemetry.sites()`
    tells which and why). `min_bytes=None` (and the recipe's None): this machine's
    calibration (`python -m taco_jax.calibrate`) decides per size, else DEFAULT_MIN_BYTES.
    transport: "xla", "fused" (GPUs of one process) or "auto" (default: the calibration's
    choice, else "xla"). The result is identical on every device."""
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
    """Identity forward; compressed psum of the cotangent backward (Megatron's `f`).

    Under check_vma=True the result is varying over `axis_name` (like
    `lax.pcast(x, axis_name, to="varying")`), so column-parallel weights can consume it.
    Under check_vma=False (and under vmap) it is the identity both ways: JAX's convention
    there already sums the cotangents of replicated values (at the shard_map boundary, and
    through psum's transpose), so an all-reduce here would count them P times."""
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
