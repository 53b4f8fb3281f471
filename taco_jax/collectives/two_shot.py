"""The compressed all-reduce schedules and their halves, over P devices of one or more axes.

Two-shot (`two_shot`):

  1. compress x as P segments (segment j is owned by device j);
  2. all-to-all the compressed segments (the reduce-scatter half);
  3. the owner decodes the P − 1 copies it received and adds its own segment unquantized,
     in fp32 (`scatter_sum`), or, fused in one kernel, also compresses that sum
     (`kernels.triton.reduce`);
  4. all-gather the compressed sums and decode them (`gather_decoded`); every device
     decodes the same bytes, so the result is bit-identical on every device.
Every element is quantized at most twice for any P: by its sender and by its owner.

One-shot (`one_shot`, for P = 2): every device compresses its whole tensor, all-gathers the
codes and decodes the P buffers, summing them in device order: one quantization per element
and one exchange.

`move(send, axis, p, gather=..., vma=...)` carries the bytes: `lax_exchange` (XLA's
all-gather / all-to-all, the "xla" transport) or `fused.exchange` (in-kernel stores into
the peers' memory, the "fused" transport).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from taco_jax import codecs, telemetry
from taco_jax.collectives import axes as axes_lib, members
from taco_jax.kernels import dispatch


def lax_exchange(send, axis, p: int, *, gather: bool, vma: bool):
    """gather: (…) → (P, …), row j from device j (identical on every device). Else send
    (P, …) → (P, …), row j = device j's send[me]."""
    if gather:
        shared = vma and not axes_lib.emulated(axes_lib.as_tuple(axis))   # vmap: no types
        return lax.all_gather(send, axis, to="invarying" if shared else "varying")
    return lax.all_to_all(send, axis, 0, 0)


def segments(x, p: int, block: int):
    """x → ((P·nb, B) blocks, nb): P segments of nb whole blocks, zero-padded at the end."""
    flat = x.reshape(-1)
    nb = max(1, -(-flat.size // (p * block)))
    if p * nb * block != flat.size:
        flat = jnp.pad(flat, (0, p * nb * block - flat.size))
    return flat.reshape(p * nb, block), nb                           # (rows, B)


def _segment(blocks, nb: int, axis):
    """This device's segment of blocks (P·nb, …): its nb rows, at me·nb (statically under
    jax.vmap: `members`)."""
    return members.take(blocks, axes_lib.as_tuple(axis), lambda me: me * nb, nb, 0)


def scatter_sum(blocks, nb: int, axis, codec, p: int, move=lax_exchange):
    """Steps 1–3 unfused: (this device's fp32 sum of its segment (nb, B), the decoded form
    of what it sent (P·nb, B))."""
    wire = dispatch.compress(blocks, codec)                          # (rows, row_bytes)
    own = _segment(blocks, nb, axis).astype(jnp.float32)
    return owner_sum(wire, own, nb, axis, codec, p, move), wire


def owner_sum(wire, own, nb: int, axis, codec, p: int, move=lax_exchange):
    """Steps 2–3: segment j of every device's wire (P·nb, row_bytes) goes to device j,
    which adds the peers' decoded segments to its own fp32 part `own` (nb, B). Its own
    segment of `wire` is never read."""
    row = codec.row_bytes
    me = lax.axis_index(axis)
    recv = move(wire.reshape(p, nb, row), axis, p, gather=False, vma=False)  # [j]: from j
    got = dispatch.decompress(recv.reshape(p * nb, row), codec, jnp.float32).reshape(p, nb, -1)
    peers = jnp.where((jnp.arange(p) != me)[:, None, None], got, 0.0)
    return own + jnp.sum(peers, axis=0)


def gather_decoded(wire, axis, codec, p: int, out_dtype, vma: bool, move=lax_exchange):
    """Step 4: all-gather every device's (nb, row_bytes) codes, decode → (P·nb, B)."""
    everyone = move(wire, axis, p, gather=True, vma=vma)
    return dispatch.decompress(everyone.reshape(-1, codec.row_bytes), codec, out_dtype)


def two_shot(x, axis, codec, p: int, vma: bool, *, move=lax_exchange):
    """The compressed psum of x over `axis` (a name or tuple of names, P devices)."""
    b, row = codec.block_size, codec.row_bytes
    blocks, nb = segments(x, p, b)
    me = lax.axis_index(axis)
    # the own segment is never sent, so its codes need not be computed
    wire = dispatch.compress(blocks, codec, skip_start=me * nb, skip_rows=nb)
    recv = move(wire.reshape(p, nb, row), axis, p, gather=False, vma=False)
    if members.static(axes_lib.as_tuple(axis)):     # the own segment, sliced statically
        mine = dispatch.reduce(recv, _segment(blocks, nb, axis), me, codec)
    else:                                           # read in place by the kernel
        mine = dispatch.reduce(recv, blocks, me, codec, own_row0=me * nb)
    out = gather_decoded(mine, axis, codec, p, x.dtype, vma, move)   # (rows, B)
    y = axes_lib.per_member(codecs.from_blocks(out, x.shape), axes_lib.as_tuple(axis))
    if telemetry.enabled():
        telemetry.report("psum", x, y, axis, codec, wire_bytes=2 * p * nb * row)
    return y


def two_shot_feedback(x, r, axis, codec, p: int, vma: bool, *, move=lax_exchange):
    """The step of error feedback: (y, e), y the compressed psum of z = x − r (cast to
    x.dtype) and e this device's share of its error, Σ_devices e = y − Σ z: the first
    quantization of the segments it sent and the second of the one it owns (as returned,
    after the cast); r is float32, x's shape. The subtraction and the senders' error
    shares are done by the compress (`dispatch.compress_feedback`: one kernel pass over x
    and r for Echo's codecs); the owner's step is unfused (decode, fp32 sum, compress) so
    that its fp32 sum s̃ is at hand for the second error."""
    b, row = codec.block_size, codec.row_bytes
    xb, nb = segments(x, p, b)
    rb, _ = segments(r, p, b)
    me = lax.axis_index(axis)
    # the own segment is never sent: its codes and first error need not be computed
    wire, err = dispatch.compress_feedback(xb, rb, codec, skip_start=me * nb, skip_rows=nb)
    own = _segment(xb, nb, axis).astype(jnp.float32) - _segment(rb, nb, axis)
    s_tilde = owner_sum(wire, own, nb, axis, codec, p, move)
    out = gather_decoded(dispatch.compress(s_tilde, codec), axis, codec, p, x.dtype, vma,
                         move)                                       # (rows, B)
    y = axes_lib.per_member(codecs.from_blocks(out, x.shape), axes_lib.as_tuple(axis))
    if telemetry.enabled():
        telemetry.report("psum", x.astype(jnp.float32) - r, y, axis, codec,
                         wire_bytes=2 * p * nb * row)
    own_err = _segment(out, nb, axis).astype(jnp.float32) - s_tilde
    err = members.put(err, own_err, axes_lib.as_tuple(axis), lambda me: me * nb, 0)
    return y, codecs.from_blocks(err, x.shape)


def one_shot(x, axis, codec, p: int, vma: bool, move=lax_exchange):
    """Σ_j decode(encode(x_j)), j in device order, from one all-gather of the codes. With
    an identity codec: the exact sum, in f32, of the gathered values."""
    b = codec.block_size
    blocks = codecs.to_blocks(x, b)                                  # (nb, B)
    if codec.is_identity:
        vals = move(blocks, axis, p, gather=True, vma=vma)           # (P, nb, B)
        acc = vals[0].astype(jnp.float32)
        for j in range(1, p):
            acc = acc + vals[j].astype(jnp.float32)
        out = acc.astype(x.dtype)
    else:
        recv = move(dispatch.compress(blocks, codec), axis, p, gather=True, vma=vma)
        out = dispatch.decode_sum(recv, codec, x.dtype)
    y = axes_lib.per_member(codecs.from_blocks(out, x.shape), axes_lib.as_tuple(axis))
    if telemetry.enabled():
        telemetry.report("psum", x, y, axis, codec,
                         wire_bytes=(p - 1) * blocks.shape[0] * codec.row_bytes)
    return y
