"""The kernels' plain-jnp references, for every codec: compress and decompress (the codec's
own definition of its wire format), the two-shot owner's reduce, the one-shot's
decode-and-sum and error feedback's compress. The dispatcher runs them off GPU and where
no kernel covers a call; the tests compare the kernels with them. They import no Pallas
backend."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def compress_reference(x, codec):
    """Any codec's compress: (rows, B) float → (rows, row_bytes) uint8, its definition."""
    return codec.compress_reference(x)


def decompress_reference(w, codec, out_dtype=jnp.float32):
    """Any codec's decompress: (rows, row_bytes) uint8 → (rows, B) out_dtype."""
    return codec.decompress_reference(w, out_dtype)


def reduce_reference(recv, own, me, codec, own_row0=0):
    """Plain-jnp owner step, for every codec: same sum order as the kernel (own, then
    peers 0..P-1)."""
    n = recv.shape[1]
    # a static start slices statically: under jax.vmap a dynamic slice is a gather
    acc = (jax.lax.slice_in_dim(own, own_row0, own_row0 + n) if isinstance(own_row0, int)
           else jax.lax.dynamic_slice_in_dim(own, own_row0, n)).astype(jnp.float32)
    for p in range(recv.shape[0]):
        acc = acc + jnp.where(me == p, 0.0, codec.decompress_reference(recv[p]))
    return codec.compress_reference(acc)


def decode_sum_reference(recv, codec, out_dtype=jnp.float32):
    """Plain-jnp decode-and-sum, for every codec, in the kernel's order."""
    acc = None
    for p in range(recv.shape[0]):
        dec = codec.decompress_reference(recv[p])
        acc = dec if acc is None else acc + dec
    return acc.astype(out_dtype)


def compress_feedback_reference(x, r, codec):
    """The unfused error-feedback compress: z = x − r, its wire and decode(wire) − z."""
    z = x.astype(jnp.float32) - r
    wire = codec.compress_reference(z)
    return wire, codec.decompress_reference(wire, jnp.float32) - z
