"""The compressed two-shot all-reduce and its halves, over P devices of one or more axes.

  1. compress x as P segments (segment j is owned by device j);
  2. all-to-all the compressed segments (the reduce-scatter half);
  3. the owner decodes the P − 1 copies it received and adds its own segment unquantized,
     in fp32 (`scatter_sum`), or, fused in one kernel, also compresses that sum
     (`kernels.reduce`);
  4. all-gather the compressed sums and decode them (`gather_decoded`); every device
     decodes the same bytes, so the result is bit-identical on every device.
Every element is quantized at most twice for any P: by its sender and by its owner.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from taco_jax import codecs, telemetry
from taco_jax.collectives import axes as axes_lib
from taco_jax.kernels import dispatch


def segments(x, p: int, block: int):
    """x → ((P·nb, B) blocks, nb): P segments of nb whole blocks, zero-padded at the end."""
    flat = x.reshape(-1)
    nb = max(1, -(-flat.size // (p * block)))
    if p * nb * block != flat.size:
        flat = jnp.pad(flat, (0, p * nb * block - flat.size))
    return flat.reshape(p * nb, block), nb                           # (rows, B)


def scatter_sum(blocks, nb: int, axis, codec, p: int):
    """Steps 1–3 unfused: (this device's fp32 sum of its segment (nb, B), the decoded form
    of what it sent (P·nb, B))."""
    row = codec.row_bytes
    me = lax.axis_index(axis)
    wire = dispatch.compress(blocks, codec)                          # (rows, row_bytes)
    recv = lax.all_to_all(wire.reshape(p, nb, row), axis, 0, 0)      # recv[j]: from device j
    got = dispatch.decompress(recv.reshape(p * nb, row), codec, jnp.float32)
    got = got.reshape(p, nb, -1)
    own = lax.dynamic_slice_in_dim(blocks, me * nb, nb).astype(jnp.float32)
    peers = jnp.where((jnp.arange(p) != me)[:, None, None], got, 0.0)
    return own + jnp.sum(peers, axis=0), wire


def gather_decoded(wire, axis, codec, out_dtype, vma: bool):
    """Step 4: all-gather every device's (nb, row_bytes) codes, decode → (P·nb, B)."""
    everyone = lax.all_gather(wire, axis, to="invarying" if vma else "varying")
    return dispatch.decompress(everyone.reshape(-1, codec.row_bytes), codec, out_dtype)


def two_shot(x, axis, codec, p: int, vma: bool, *, with_error: bool = False,
             out_dtype=None):
    """The compressed psum of x over `axis` (a name or tuple of names, P devices).

    with_error: also return this device's share e of the error, Σ_devices e = y − Σ x:
    the first quantization of the segments it sent and the second of the one it owns
    (as returned, after the cast to out_dtype, default x.dtype); error feedback subtracts
    it downstream."""
    b, row = codec.block_size, codec.row_bytes
    blocks, nb = segments(x, p, b)
    me = lax.axis_index(axis)
    if with_error:
        s_tilde, wire = scatter_sum(blocks, nb, axis, codec, p)
        mine = dispatch.compress(s_tilde, codec)
    else:
        # the own segment is never sent, so its codes need not be computed
        wire = dispatch.compress(blocks, codec, skip_start=me * nb, skip_rows=nb)
        recv = lax.all_to_all(wire.reshape(p, nb, row), axis, 0, 0)
        mine = dispatch.reduce(recv, blocks, me, codec, own_row0=me * nb)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    out = gather_decoded(mine, axis, codec, out_dtype, vma)          # (rows, B)
    y = axes_lib.per_member(codecs.from_blocks(out, x.shape), axes_lib.as_tuple(axis))
    if telemetry.enabled():
        telemetry.report("psum", x, y, axis, codec, wire_bytes=2 * p * nb * row)
    if not with_error:
        return y
    sent = dispatch.decompress(wire, codec, jnp.float32)
    own_err = lax.dynamic_slice_in_dim(out, me * nb, nb).astype(jnp.float32) - s_tilde
    err = lax.dynamic_update_slice_in_dim(sent - blocks, own_err, me * nb, 0)
    return y, codecs.from_blocks(err, x.shape)
