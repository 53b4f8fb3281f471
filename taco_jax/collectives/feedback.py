"""Error feedback for compressed all-reduces along a residual stream (Echo).

A residual block adds psum(·) into the stream h; a compressed psum adds its output plus an
error δ_k. The summation reveals each injected error, and feeding it into later calls makes
old errors cancel instead of accumulate. If the *next* all-reduce
into the same stream sums x − δ_k instead of x, the stream carries δ_{k+1} + (what the
blocks make of δ_k) instead of δ_1 + … + δ_{k+1}.

Who knows δ_k? No single device: δ_k = Σ_i e_i, where device i's share e_i is
  * on the segments it sends: decode(encode(x_i[j])) − x_i[j] (its own first quantization);
  * on the segment it owns: y[i] − s̃_i, the second quantization of its fp32 sum s̃_i.
So each device keeps e_i (fp32, the stream's shape) and subtracts it from its own input at
the next site; by linearity the psum then sees Σ x − δ_k. Nothing extra crosses the wire.

State is explicit (`FeedbackState`, one buffer per device, carried from site to site:
memory one stream-sized fp32 array, see docs/echo.md). Backward: the same channel runs in
reverse through the *cotangent* of the carried residual — the custom_vjp of each site
reads the backward residual left by the later site from ct(residual_out) and returns its
own as ct(residual_in). So `jax.grad` with respect to a FeedbackState gives the leftover
backward residual, not a derivative: the state is not a differentiable input.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from taco_jax.collectives import axes as axes_lib
from taco_jax.collectives.allreduce import psum
from taco_jax.collectives.call import Call
from taco_jax.collectives.two_shot import two_shot_feedback


class FeedbackState(NamedTuple):
    """This device's share of the error the last site injected into the stream (fp32,
    the stream's shape, varying over the axis). A pytree: thread it through the blocks,
    keep it in a train state, save it with Orbax."""
    residual: jax.Array


def zeros(shape, axis_name) -> FeedbackState:
    """Initial state, inside `jax.shard_map` (varying over `axis_name` under check_vma)."""
    axes = axes_lib.resolve(axis_name, "feedback.zeros")
    r = jnp.zeros(shape, jnp.float32)
    if axes_lib.emulated(axes):         # under vmap: one state per member
        r = axes_lib.per_member(r, axes, force=True)
    elif axes_lib.check_vma(axes):
        r = lax.pcast(r, axes_lib.name(axes), to="varying")
    return FeedbackState(r)


def zeros_like(x, axis_name) -> FeedbackState:
    """Initial state for the stream x: varying over `axis_name` and over every axis x varies
    over (e.g. "data"), as a custom_vjp needs the state's cotangent to vary like the state."""
    state = zeros(x.shape, axis_name)
    mat = getattr(jax.typeof(x), "manual_axis_type", None)       # None outside check_vma
    axes = set(axes_lib.resolve(axis_name, "feedback.zeros_like"))
    other = tuple(sorted(set(mat.varying) - axes)) if mat is not None else ()
    if other:
        state = FeedbackState(lax.pcast(state.residual, other, to="varying"))
    return state


def _exact_err(z, axis, out_dtype):
    """lax.psum; the only error is the cast to out_dtype, credited to device 0."""
    s = lax.psum(z, axis)
    y = s.astype(out_dtype)
    return y, jnp.where(lax.axis_index(axis) == 0, y.astype(jnp.float32) - s, 0.0)


def _reduce_err(x, r, axis, codec, p, vma, compress):
    if compress:          # psum(x − r): r is the previous site's share, fused into compress
        return two_shot_feedback(x, r, axis, codec, p, vma)
    return _exact_err(x.astype(jnp.float32) - r, axis, x.dtype)


# -- sites as custom_vjps ----------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _psum_fb(x, r, axis, codec, p, vma, compress):
    return _reduce_err(x, r, axis, codec, p, vma, compress)


def _psum_fb_fwd(x, r, axis, codec, p, vma, compress):
    return _psum_fb(x, r, axis, codec, p, vma, compress), None


def _psum_fb_bwd(axis, codec, p, vma, compress, _, cts):
    g, g_r = cts            # g_r: backward residual left by the later site, passed on
    if vma:                 # lax.psum's transpose under check_vma: broadcast to varying
        if axes_lib.emulated(axes_lib.as_tuple(axis)):   # vmap: the shared cotangent as is
            return g, g_r
        return lax.pcast(g, axis, to="varying"), g_r
    # check_vma=False: the transpose is psum(g) (as taco_jax.psum). Its error enters the
    # stream through the block's weights, not directly, so it cannot be cancelled by
    # subtraction at the next site: compressed, without feedback (docs/echo.md).
    with axes_lib.bound(axes_lib.as_tuple(axis), p):
        ct = psum(g, axis, codec=codec, min_bytes=0) if compress else lax.psum(g, axis)
    return ct, g_r


_psum_fb.defvjp(_psum_fb_fwd, _psum_fb_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _pvary_fb(x, r, axis, codec, p, compress):
    axes = axes_lib.as_tuple(axis)
    if axes_lib.emulated(axes):       # vmap: each member's cotangent must reach the backward
        return axes_lib.per_member(x, axes, force=True), r
    return lax.pcast(x, axis, to="varying"), r


def _pvary_fb_fwd(x, r, axis, codec, p, compress):
    return _pvary_fb(x, r, axis, codec, p, compress), None


def _pvary_fb_bwd(axis, codec, p, compress, _, cts):
    g, g_r = cts            # g: this device's partial cotangent; g_r: later site's residual
    axes = axes_lib.as_tuple(axis)
    if not axes_lib.emulated(axes):
        return _reduce_err(g, g_r, axis, codec, p, True, compress)
    with axes_lib.bound(axes, p):
        ct, e = _reduce_err(g, g_r, axis, codec, p, True, compress)
        # vmap sums the members' cotangents of the shared input: the total goes to one
        return jnp.where(lax.axis_index(axis) == 0, ct, jnp.zeros_like(ct)), e


_pvary_fb.defvjp(_pvary_fb_fwd, _pvary_fb_bwd)


# -- public API -----------------------------------------------------------------------
# why the feedback sites take no fused transport (its error message)
NO_FUSED = "the error-feedback all-reduce runs over XLA's collectives only"


def _setup(x, axis_name, state, codec, min_bytes, op, transport=None):
    call = Call.make(op, axis_name, codec, min_bytes, transport, xla_only=NO_FUSED)
    if not isinstance(state, FeedbackState):
        raise TypeError(f"taco_jax.{op}: state must be a FeedbackState, got "
                        f"{type(state).__name__}")
    x = jnp.asarray(x)
    if state.residual.shape != x.shape:
        raise ValueError(f"taco_jax.{op}: {state.residual.shape=} does not match "
                         f"{x.shape=}; one FeedbackState per residual stream")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"taco_jax.{op}: x has dtype {x.dtype}; feedback needs floats")
    return x, call, call.route(x) != "lax"


def psum_with_feedback(x, axis_name, state: FeedbackState, *, codec=None,
                       min_bytes: int | None = None, transport: str | None = None):
    """Compressed `lax.psum` of `x - (this device's share of the last error)` (Megatron's
    `g` with error feedback).

    Thread the returned state into the next all-reduce that adds into the same residual
    stream (forward: the next block's psum); the old error then cancels instead of
    accumulating. Below `min_bytes` (or with codec "none") the sum is exact and the state
    drains to zero. Under check_vma=True the backward residual rides on the cotangents
    (see the module doc); under check_vma=False the backward all-reduce has no feedback.

    Args:
      x: a float array, this device's partial sum.
      axis_name: a mesh axis name, or a tuple/list of names.
      state: the `FeedbackState` of this residual stream (`zeros_like(x, axis_name)` at
        its start), fp32, of x's shape.
      codec, min_bytes: as `taco_jax.psum`'s (each None by default: the recipe's).
      transport: "xla" or "auto" (the same here); None (default): the recipe's, whose
        "fused" means "xla" here. "fused" given here is an error: the error-feedback
        all-reduce runs over XLA's collectives only.

    Returns:
      (y, new_state): y the sum over `axis_name` in x's dtype, replicated as lax.psum's;
      new_state this device's share of the error y − psum(x) − (old error) just injected.

    Raises:
      UnboundAxisError: (a NameError) a name in `axis_name` is not bound here.
      TypeError: `state` is not a FeedbackState; x is not a float array; a codec that is
        neither a name nor a Codec.
      ValueError: state.residual's shape differs from x's; transport="fused"; an unknown
        codec name, a bad `axis_name`, `min_bytes` or `transport` (as `taco_jax.psum`).
    """
    x, c, compress = _setup(x, axis_name, state, codec, min_bytes, "psum_with_feedback",
                            transport)
    y, e = _psum_fb(x, state.residual, c.axis, c.codec, c.p, c.vma, compress)
    return y, FeedbackState(e)


def pvary_with_feedback(x, axis_name, state: FeedbackState, *, codec=None,
                        min_bytes: int | None = None, transport: str | None = None):
    """Megatron's `f` with backward error feedback: identity forward (varying over
    `axis_name` under check_vma=True); backward, a compressed psum of the cotangent that
    subtracts the backward residual the later site left and leaves its own. Under
    check_vma=False it is the identity both ways, like `taco_jax.pvary`.

    Args:
      x: a float array, invariant over `axis_name`.
      axis_name: a mesh axis name, or a tuple/list of names.
      state: the stream's `FeedbackState` (its forward value passes unchanged; the
        backward residual rides on its cotangent).
      codec, min_bytes, transport: as `psum_with_feedback`'s, for the backward all-reduce
        (each None by default: the recipe's).

    Returns:
      (x, state): x varying over `axis_name` under check_vma=True, else unchanged; state
      unchanged.

    Raises:
      UnboundAxisError: (a NameError) a name in `axis_name` is not bound here.
      TypeError: `state` is not a FeedbackState; x is not a float array; a codec that is
        neither a name nor a Codec.
      ValueError: x already varies over `axis_name` (check_vma=True); state.residual's
        shape differs from x's; transport="fused"; an unknown codec name, a bad
        `axis_name`, `min_bytes` or `transport` (as `taco_jax.psum`).
    """
    x, c, compress = _setup(x, axis_name, state, codec, min_bytes, "pvary_with_feedback",
                            transport)
    if not c.vma:
        return x, state
    if axes_lib.varying(x, c.axes) and not axes_lib.emulated(c.axes):
        raise ValueError(f"taco_jax.pvary_with_feedback: x is already varying over "
                         f"{c.axis!r}")
    y, r = _pvary_fb(x, state.residual, c.axis, c.codec, c.p, compress)
    return y, FeedbackState(r)


def allreduce(x, axis_name, residual, *, codec=None, min_bytes: int | None = None,
              transport: str | None = None):
    """The bare step, without autodiff rules: (psum(x − residual) compressed, new residual).
    For reference loops and for code that runs its own backward. Arguments, errors and
    defaults (None: the recipe's) as `psum_with_feedback`'s, with the residual array in
    place of the state."""
    x, c, compress = _setup(x, axis_name, FeedbackState(residual), codec, min_bytes,
                            "allreduce", transport)
    return _reduce_err(x, residual, c.axis, c.codec, c.p, c.vma, compress)
