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
from taco_jax.collectives.call import Call
from taco_jax.collectives.two_shot import two_shot


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _psum(x, axis, codec, p, vma):
    return two_shot(x, axis, codec, p, vma)


def _psum_fwd(x, axis, codec, p, vma):
    # Call the custom_vjp itself (not two_shot): under higher-order AD JAX differentiates
    # this rule, and two_shot's integer wire codes would give a zero derivative.
    return _psum(x, axis, codec, p, vma), None


def _psum_bwd(axis, codec, p, vma, _, g):
    # lax.psum's transpose: under check_vma the cotangent of an invariant output is
    # broadcast to the varying input; without it (and under vmap) it is psum(g).
    if vma:
        return (lax.pcast(g, axis, to="varying"),)
    with axes_lib.bound(axes_lib.as_tuple(axis), p):
        return (_psum(g, axis, codec, p, vma),)


_psum.defvjp(_psum_fwd, _psum_bwd)


def psum(x, axis_name, *, codec=None, min_bytes: int | None = None):
    """Drop-in for `jax.lax.psum` inside `jax.shard_map` (or `jax.vmap` with an axis name),
    compressed with `codec` (default: the recipe's, `taco_jax.config`).

    axis_name: one mesh axis or a tuple of them (compressed over their product). Leaves that
    are not float32/bfloat16/float16, smaller than `min_bytes` per device, on an axis of
    size 1, or with codec "none", go through `lax.psum` unchanged (`telemetry.sites()`
    tells which and why). The result is identical on every device."""
    op = Call.make("psum", axis_name, codec, min_bytes)

    def leaf(v):
        v = jnp.asarray(v)
        invariant = op.vma and not axes_lib.varying(v, op.axes)
        tap = telemetry.capturing() and op.taps(v) and not invariant
        if tap:     # fidelity study: the tensor this all-reduce sums, whatever the route
            telemetry.capture_value("fwd", "psum", v, op.axis)
        if not op.decide(v, invariant=invariant):
            y = lax.psum(v, op.axis)
        else:
            y = _psum(v, op.axis, op.codec, op.p, op.vma)
        if tap and not op.vma:   # psum's transpose all-reduces the cotangent of y
            y = telemetry.capture_cotangent(y, "psum", op.axis)
        return y
    return jax.tree.map(leaf, x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _pvary(x, axis, codec, p, vma):
    return lax.pcast(x, axis, to="varying") if vma else x


def _pvary_fwd(x, axis, codec, p, vma):
    return _pvary(x, axis, codec, p, vma), None


def _pvary_bwd(axis, codec, p, vma, _, g):
    return (_psum(g, axis, codec, p, vma),)   # only reached with check_vma=True



_pvary.defvjp(_pvary_fwd, _pvary_bwd)


def pvary(x, axis_name, *, codec=None, min_bytes: int | None = None):
    """Identity forward; compressed psum of the cotangent backward (Megatron's `f`).

    Under check_vma=True the result is varying over `axis_name` (like
    `lax.pcast(x, axis_name, to="varying")`), so column-parallel weights can consume it.
    Under check_vma=False (and under vmap) it is the identity both ways: JAX's convention
    there already sums the cotangents of replicated values (at the shard_map boundary, and
    through psum's transpose), so an all-reduce here would count them P times."""
    op = Call.make("pvary", axis_name, codec, min_bytes)

    def leaf(v):
        v = jnp.asarray(v)
        if not op.vma:
            return v
        if axes_lib.varying(v, op.axes):
            raise ValueError(f"taco_jax.pvary: x is already varying over {op.axis!r}")
        if op.decide(v):
            y = _pvary(v, op.axis, op.codec, op.p, op.vma)
        else:
            y = lax.pcast(v, op.axis, to="varying")
        if telemetry.capturing() and op.taps(v):   # backward all-reduces y's cotangent
            y = telemetry.capture_cotangent(y, "pvary", op.axis)
        return y
    return jax.tree.map(leaf, x)
