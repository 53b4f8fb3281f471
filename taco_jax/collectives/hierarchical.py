"""A two-level all-reduce for data-parallel gradients across hosts.

    y = taco_jax.psum_two_level(g, "data_local", "data_hosts",
                                inner_codec="taco-int8", outer_codec="tah4")

Reduce-scatter within a host (fast links: 8-bit codes), all-reduce of the 1/P_inner shard
across hosts (slow links: 4-bit codes after a Hadamard rotation, which smooths gradient
outliers), all-gather within the host: the two-level gradient quantization of SDP4Bit. Each
element is quantized at most four times (once in each half of the inner level, at most
twice across hosts); the result is identical on every device."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from taco_jax.collectives import axes as axes_lib
from taco_jax.collectives.allreduce import psum
from taco_jax.collectives.gather import all_gather, psum_scatter


def psum_two_level(x, inner_axis, outer_axis, *, inner_codec="taco-int8",
                   outer_codec="tah4", min_bytes: int | None = None,
                   transport: str | None = None):
    """All-reduce sum over (inner_axis, outer_axis) in two levels (see the module doc):
    for `lax.psum(x, (inner_axis, outer_axis))` across hosts.

    Args:
      x: an array, or a pytree of arrays; leaves are flattened and zero-padded to a
        multiple of the inner axis size.
      inner_axis: the mesh axis (or tuple of axes) within a host.
      outer_axis: the mesh axis (or tuple of axes) across hosts; no axis in both.
      inner_codec: codec of the inner reduce-scatter and all-gather, default "taco-int8"
        (8-bit codes on fast links); a name or a Codec, None: the recipe's.
      outer_codec: codec of the all-reduce across hosts, default "tah4" (4-bit codes
        after a Hadamard rotation on slow links); None: the recipe's.
      min_bytes, transport: as `taco_jax.psum`'s, for each of the three steps (each None
        by default: the recipe's).

    Returns:
      `x`'s structure, each leaf the sum over both axes in its dtype, identical on every
      device.

    Raises:
      UnboundAxisError: (a NameError) a name in either axis is not bound here.
      ValueError: the two axes share a name; an unknown codec name, a bad axis name,
        `min_bytes` or `transport` (as `taco_jax.psum`).
      TypeError: a codec that is neither a name nor a Codec.
    """
    inner = axes_lib.resolve(inner_axis, "psum_two_level")
    outer = axes_lib.resolve(outer_axis, "psum_two_level")
    if set(inner) & set(outer):
        raise ValueError(f"psum_two_level: {inner_axis=} and {outer_axis=} share an axis")
    p_in = axes_lib.size(inner, "psum_two_level")
    vma = axes_lib.check_vma(inner)
    kw = {"min_bytes": min_bytes, "transport": transport}

    def leaf(v):
        v = jnp.asarray(v)
        flat = v.reshape(-1)
        pad = (-flat.size) % p_in
        rows = jnp.pad(flat, (0, pad)).reshape(p_in, -1)             # (P_inner, m)
        part = psum_scatter(rows, inner_axis, scatter_dimension=0, codec=inner_codec, **kw)
        part = psum(part, outer_axis, codec=outer_codec, **kw)
        full = all_gather(part, inner_axis, tiled=False, codec=inner_codec,
                          to="invarying" if vma else "varying", **kw)  # (P_inner, m)
        return full.reshape(-1)[:flat.size].reshape(v.shape)
    return jax.tree.map(leaf, x)
