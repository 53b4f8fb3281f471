"""`ppermute`, compressed: the pipeline stages' send/receive of activations and cotangents.

Each device encodes its tensor once, lax.ppermute moves the wire bytes, the receiver decodes
them: one quantization per element. Devices that receive nothing get zeros, as with lax.
The backward pass is the compressed permutation of the cotangent in reverse."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from taco_jax import codecs, telemetry
from taco_jax.collectives import axes as axes_lib, members
from taco_jax.collectives.call import Call
from taco_jax.kernels import dispatch


def _receivers(perm, p: int) -> list[bool]:
    got = [False] * p
    for _, dst in perm:
        got[dst] = True
    return got


def _complete(perm, p: int) -> tuple:
    """A full permutation that extends a partial one (lax.ppermute under jax.vmap takes only
    full ones); what the added pairs deliver is masked to zeros."""
    free_src = [i for i in range(p) if i not in {s for s, _ in perm}]
    free_dst = [i for i in range(p) if i not in {d for _, d in perm}]
    return tuple(perm) + tuple(zip(free_src, free_dst))


def _lax_ppermute(v, axis, perm, p: int, emulated: bool):
    if not emulated:
        return lax.ppermute(v, axis, perm)
    # under vmap: the members' rows in the permutation's order, static (lax.ppermute's
    # batching rule would gather them), lax's zeros where nothing arrives
    return members.permute(v, axes_lib.as_tuple(axis), perm)


def _permute(x, axis, codec, p, perm):
    axes = axes_lib.as_tuple(axis)
    blocks = codecs.to_blocks(x, codec.block_size)                   # (nb, B)
    wire = members.permute(dispatch.compress(blocks, codec), axes, _complete(perm, p))
    y = codecs.from_blocks(dispatch.decompress(wire, codec, x.dtype), x.shape)
    # an all-zero wire row decodes to 0/0 for α: keep lax's zeros where nothing arrives
    got = members.pick(_receivers(perm, p), axes)
    y = jnp.where(got, y, jnp.zeros_like(y))
    if telemetry.enabled():      # against the exact send of the same tensor, in f32
        exact = members.permute(x.astype(jnp.float32), axes, _complete(perm, p))
        telemetry.report_send("ppermute", jnp.where(got, exact, 0.0), y, axis, codec,
                              wire_bytes=wire.size, bf16_bytes=2 * x.size)
    return y


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _ppermute(x, axis, codec, p, perm):
    return _permute(x, axis, codec, p, perm)


def _ppermute_fwd(x, axis, codec, p, perm):
    return _ppermute(x, axis, codec, p, perm), None


def _ppermute_bwd(axis, codec, p, perm, _, g):
    back = tuple((dst, src) for src, dst in perm)
    with axes_lib.bound(axes_lib.as_tuple(axis), p):
        return (_ppermute(g, axis, codec, p, back),)


_ppermute.defvjp(_ppermute_fwd, _ppermute_bwd)


# why `ppermute` takes no fused transport (its error message)
NO_FUSED = ("the fused kernels carry the all-reduce's all-to-all and all-gather, not a "
            "permutation")


def ppermute(x, axis_name, perm, *, codec=None, min_bytes: int | None = None,
             transport: str | None = None):
    """Permutation of each device's tensor over `axis_name` with compressed payloads: a
    drop-in for `jax.lax.ppermute` (pipeline stages' hand-offs).

    Each sender encodes its leaf once, `lax.ppermute` moves the codes, the receiver
    decodes them: one quantization per element. Devices that receive nothing get zeros,
    as with lax. Leaves on the plain route (codec "none", below `min_bytes`, not float,
    axis of size 1, or under check_vma=True invariant over the axis, which every device
    holds already) take `lax.ppermute` and trace to exactly its jaxpr (under jax.vmap: the
    members' values in the permutation's order, statically, as `lax.ppermute`'s batching
    rule would gather them).

    Telemetry: the site is noted once, in the forward pass; `telemetry.wire_bytes(site,
    backward=True)` adds the reverse send a training step makes. Under
    `telemetry.collect()` every compressed send, forward and backward, records its error
    against the exact send over all receivers; `telemetry.capture()` hands each device's
    sent tensor ("fwd", every device, senders or not) and the cotangent of what it
    received ("bwd": what its reverse send carries) to the host.

    Args:
      x: an array, or a pytree of arrays.
      axis_name: a mesh axis name, or a tuple/list of names.
      perm: pairs (source, destination) of indices along the axis, sources distinct and
        destinations distinct, as lax's.
      codec, min_bytes: as `taco_jax.psum`'s (each None by default: the recipe's).
      transport: "xla" or "auto" (the same here: the codes move by `lax.ppermute`); None
        (default): the recipe's, whose "fused" means "xla" for this op. "fused" given here
        is an error: the fused kernels carry the all-reduce's all-to-all and all-gather,
        not a permutation.

    Returns:
      `x`'s structure, each leaf what this device received (zeros if nothing). Gradient:
      the compressed reverse permutation of the cotangent.

    Raises:
      UnboundAxisError: (a NameError) a name in `axis_name` is not bound here.
      ValueError: `perm` repeats a source or destination or leaves [0, axis size);
        transport="fused"; an unknown codec name, a bad `axis_name`, `min_bytes` or
        `transport` (as `taco_jax.psum`).
      TypeError: a codec that is neither a name nor a Codec.
    """
    op = Call.make("ppermute", axis_name, codec, min_bytes, transport, xla_only=NO_FUSED)
    perm = tuple((int(s), int(d)) for s, d in perm)
    srcs, dsts = [s for s, _ in perm], [d for _, d in perm]
    if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts) or any(
            not 0 <= i < op.p for i in srcs + dsts):
        raise ValueError(f"taco_jax.ppermute: perm={perm!r} must pair distinct sources with "
                         f"distinct destinations in [0, {op.p})")

    def leaf(v):
        v = jnp.asarray(v)
        # check_vma: an input invariant over the axis (every device holds it) goes to lax,
        # which makes it varying first; the compressed op's cotangent, the reverse send,
        # varies over the axis and cannot be the cotangent of an invariant input
        invariant = op.vma and not axes_lib.varying(v, op.axes)
        tap = telemetry.capturing() and op.taps(v)
        if tap:       # fidelity study: the tensor this device sends, whatever the route
            telemetry.capture_value("fwd", "ppermute", v, op.axis)
        if op.route(v, invariant=invariant) == "lax":
            y = _lax_ppermute(v, op.axis, perm, op.p, axes_lib.emulated(op.axes))
        else:
            y = _ppermute(v, op.axis, op.codec, op.p, perm)
        if tap:       # the reverse send carries y's cotangent back
            y = telemetry.capture_cotangent(y, "ppermute", op.axis)
        return y
    return jax.tree.map(leaf, x)
