"""Error feedback for compressed all-reduces along a residual stream (Echo, seed 003).

Echo: "The summation reveals each injected error, and Echo feeds it back into later calls,
so old errors cancel instead of accumulating. We prove that the accumulated error stays
bounded independently of depth." A residual block adds psum(·) into the stream h; a
compressed psum adds its output plus an error δ_k (Echo Fig. 1). If the *next* all-reduce
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

from taco_jax import codecs, collectives, dispatch


class FeedbackState(NamedTuple):
    """This device's share of the error the last site injected into the stream (fp32,
    the stream's shape, varying over the axis). A pytree: thread it through the blocks,
    keep it in a train state, save it with Orbax."""
    residual: jax.Array


def zeros(shape, axis_name) -> FeedbackState:
    """Initial state, inside `jax.shard_map` (varying over `axis_name` under check_vma)."""
    r = jnp.zeros(shape, jnp.float32)
    if collectives._check_vma():
        r = lax.pcast(r, axis_name, to="varying")
    return FeedbackState(r)


def zeros_like(x, axis_name) -> FeedbackState:
    """Initial state for the stream x: varying over `axis_name` and over every axis x varies
    over (e.g. "data"), as a custom_vjp needs the state's cotangent to vary like the state."""
    state = zeros(x.shape, axis_name)
    mat = getattr(jax.typeof(x), "manual_axis_type", None)       # None outside check_vma
    other = tuple(sorted(set(mat.varying) - {axis_name})) if mat is not None else ()
    if other:
        state = FeedbackState(lax.pcast(state.residual, other, to="varying"))
    return state


# -- the all-reduce that also returns this device's share of its error ----------------------
def _two_shot_err(z, axis, codec, p: int, out_dtype):
    """collectives._two_shot (unchunked, reference ops) on f32 z, plus e with Σ_devices e =
    y − Σ_devices z on every element (up to fp32 rounding)."""
    b, row = codec.block_size, codec.row_bytes
    flat = z.reshape(-1)
    nb = max(1, -(-flat.size // (p * b)))
    total = p * nb
    if total * b != flat.size:
        flat = jnp.pad(flat, (0, total * b - flat.size))
    blocks = flat.reshape(total, b)                                  # (rows, B)
    me = lax.axis_index(axis)
    wire = dispatch.compress(blocks, codec)                          # (rows, row_bytes)
    sent = dispatch.decompress(wire, codec, jnp.float32)             # what the owners will see
    recv = lax.all_to_all(wire.reshape(p, nb, row), axis, 0, 0)      # recv[j]: from device j
    got = dispatch.decompress(recv.reshape(total, row), codec, jnp.float32).reshape(p, nb, b)
    own = lax.dynamic_slice_in_dim(blocks, me * nb, nb)              # (nb, B), unquantized
    mask = (jnp.arange(p) != me)[:, None, None]
    s_tilde = own + jnp.sum(jnp.where(mask, got, 0.0), axis=0)       # fp32 sum (Echo Fig. 2a)
    to = "invarying" if collectives._check_vma() else "varying"
    everyone = lax.all_gather(dispatch.compress(s_tilde, codec), axis, to=to)  # (P, nb, row)
    out = dispatch.decompress(everyone.reshape(total, row), codec, out_dtype)  # (rows, B)
    # error shares: first quantization on sent segments, second on the owned one (as returned,
    # after the cast to out_dtype, so a bf16 output's rounding is fed back too)
    own_err = lax.dynamic_slice_in_dim(out, me * nb, nb).astype(jnp.float32) - s_tilde
    err = lax.dynamic_update_slice_in_dim(sent - blocks, own_err, me * nb, 0)
    return codecs.from_blocks(out, z.shape), codecs.from_blocks(err, z.shape)


def _exact_err(z, axis, out_dtype):
    """lax.psum; the only error is the cast to out_dtype, credited to device 0."""
    s = lax.psum(z, axis)
    y = s.astype(out_dtype)
    return y, jnp.where(lax.axis_index(axis) == 0, y.astype(jnp.float32) - s, 0.0)


def _reduce_err(x, r, axis, codec, p, compress):
    z = x.astype(jnp.float32) - r                        # subtract the previous site's share
    if compress:
        return _two_shot_err(z, axis, codec, p, x.dtype)
    return _exact_err(z, axis, x.dtype)


# -- sites as custom_vjps ----------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _psum_fb(x, r, axis, codec, p, vma, compress):
    return _reduce_err(x, r, axis, codec, p, compress)


def _psum_fb_fwd(x, r, axis, codec, p, vma, compress):
    return _psum_fb(x, r, axis, codec, p, vma, compress), None


def _psum_fb_bwd(axis, codec, p, vma, compress, _, cts):
    g, g_r = cts            # g_r: backward residual left by the later site, passed on
    if vma:                 # lax.psum's transpose under check_vma: broadcast to varying
        return lax.pcast(g, axis, to="varying"), g_r
    # check_vma=False: the transpose is psum(g) (as collectives.psum). Its error enters the
    # stream through the block's weights, not directly, so it cannot be cancelled by
    # subtraction at the next site: compressed, without feedback (docs/echo.md).
    ct = collectives.psum(g, axis, codec=codec, min_bytes=0) if compress else lax.psum(g, axis)
    return ct, g_r


_psum_fb.defvjp(_psum_fb_fwd, _psum_fb_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _pvary_fb(x, r, axis, codec, p, compress):
    return lax.pcast(x, axis, to="varying"), r


def _pvary_fb_fwd(x, r, axis, codec, p, compress):
    return _pvary_fb(x, r, axis, codec, p, compress), None


def _pvary_fb_bwd(axis, codec, p, compress, _, cts):
    g, g_r = cts            # g: this device's partial cotangent; g_r: later site's residual
    ct, e = _reduce_err(g, g_r, axis, codec, p, compress)
    return ct, e


_pvary_fb.defvjp(_pvary_fb_fwd, _pvary_fb_bwd)


# -- public API -----------------------------------------------------------------------
def _setup(x, axis_name, state, codec, min_bytes, op):
    codec = codecs.get(codec)
    axis = collectives._single_axis(axis_name, op)
    p = collectives._axis_size(axis, op)
    if not isinstance(state, FeedbackState):
        raise TypeError(f"taco_jax.feedback.{op}: state must be a FeedbackState, got "
                        f"{type(state).__name__}")
    x = jnp.asarray(x)
    if state.residual.shape != x.shape:
        raise ValueError(f"taco_jax.feedback.{op}: {state.residual.shape=} does not match "
                         f"{x.shape=}; one FeedbackState per residual stream")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"taco_jax.feedback.{op}: x has dtype {x.dtype}; feedback needs floats")
    min_bytes = collectives.DEFAULT_MIN_BYTES if min_bytes is None else int(min_bytes)
    compress = (p > 1 and collectives._compressible(x, codec)
                and x.size * x.dtype.itemsize >= min_bytes)
    return x, axis, codec, p, compress


def psum_with_feedback(x, axis_name, state: FeedbackState, *, codec="echo4",
                       min_bytes: int | None = None):
    """Compressed `lax.psum` of `x - (this device's share of the last error)`.

    Returns (y, new_state): y is replicated, like lax.psum's; new_state holds this device's
    share of the error y − psum(x) − (old error) just injected. Thread new_state into the next
    all-reduce that adds into the same residual stream (forward: the next block's psum).
    Below `min_bytes` (default collectives.DEFAULT_MIN_BYTES) the sum is exact and the state
    drains to zero. Under check_vma=True the backward residual rides on the cotangents (see
    module doc); under check_vma=False the backward all-reduce has no feedback."""
    x, axis, codec, p, compress = _setup(x, axis_name, state, codec, min_bytes,
                                         "psum_with_feedback")
    y, e = _psum_fb(x, state.residual, axis, codec, p, collectives._check_vma(), compress)
    return y, FeedbackState(e)


def pvary_with_feedback(x, axis_name, state: FeedbackState, *, codec="echo4",
                        min_bytes: int | None = None):
    """Megatron's `f` with backward feedback: identity forward (varying under check_vma);
    backward, a compressed psum of the cotangent that subtracts the backward residual of the
    later site and leaves its own. Returns (x, state) — the forward state passes unchanged.
    Under check_vma=False it is the identity both ways, like `taco_jax.pvary`."""
    x, axis, codec, p, compress = _setup(x, axis_name, state, codec, min_bytes,
                                         "pvary_with_feedback")
    if not collectives._check_vma():
        return x, state
    if collectives._varying(x, axis):
        raise ValueError(f"taco_jax.feedback.pvary_with_feedback: x is already varying over "
                         f"{axis!r}")
    y, r = _pvary_fb(x, state.residual, axis, codec, p, compress)
    return y, FeedbackState(r)


def allreduce(x, axis_name, residual, *, codec="echo4", min_bytes: int | None = None):
    """The bare step, without autodiff rules: (psum(x − residual) compressed, new residual).
    For reference loops and for code that runs its own backward."""
    x, axis, codec, p, compress = _setup(x, axis_name, FeedbackState(residual), codec,
                                         min_bytes, "allreduce")
    return _reduce_err(x, residual, axis, codec, p, compress)
