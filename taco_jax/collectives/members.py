"""A device's own part and its peers' parts, at offsets that stay static under jax.vmap.

On a mesh a device reads its part of an array at an offset computed from `lax.axis_index`
(a dynamic slice), writes its chunks at such offsets (a dynamic update slice) and receives a
peer's tensor by `lax.ppermute`. Under `jax.vmap(axis_name=...)` (tensor parallelism
emulated on one device) each of these becomes a gather or a scatter over every member's
array at once, which a real device never runs, and `lax.ppermute` a gather by the
permutation. So where every axis is a vmap axis (`static`), the members' values are laid
side by side as one (P, …) array (`lax.all_gather` under vmap is a transpose of the
batched array, at most), each member's offset is a Python int, and the result goes back to
the members by `to_members`, which XLA folds into a reshape. The values are those of the
mesh form, bit for bit: the same slices, the same products, summed in the same order.

Each function takes `me -> offset` callables that are plain integer arithmetic, so that the
same callable serves a traced `lax.axis_index` on a mesh and a Python int per member under
vmap.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from taco_jax.collectives import axes as axes_lib


def static(axes: tuple) -> bool:
    """Is every one of `axes` bound by jax.vmap (none by a shard_map mesh)? Then the
    members' values lie side by side on this device and are indexed statically here."""
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    return not set(axes) & manual


def gather(v, axes: tuple):
    """Under vmap over `axes`: every member's v as one (P, …) array, member i at row i (in
    the order of `lax.axis_index` over `axes`), the same on every member."""
    out = v
    for a in reversed(axes):                   # the minor axis first: rows major-to-minor
        out = lax.all_gather(out, a)
    return out.reshape(-1, *v.shape)


def to_members(y, axes: tuple):
    """Under vmap over `axes`: y (P, …), the same on every member -> member i's y[i]. An
    all-to-all of y held by every member hands member i row i of each; XLA folds the
    broadcast, the transpose and the slice away."""
    sizes = [lax.axis_size(a) for a in axes]
    y = y.reshape(*sizes, *y.shape[1:])
    for a in axes:                             # the major axis first
        held = y + (lax.axis_index(a) * 0).astype(y.dtype)          # every member's copy
        y = lax.all_to_all(held, a, 0, 0, tiled=True)[0]
    return y


def take(v, axes: tuple, start: Callable, size: int, dim: int):
    """Member me's `v[start(me) : start(me) + size]` along `dim`."""
    if not static(axes):
        return lax.dynamic_slice_in_dim(v, start(lax.axis_index(axes_lib.name(axes))), size,
                                        dim)
    everyone = gather(v, axes)                                       # (P, *v.shape)
    return to_members(jnp.stack([lax.slice_in_dim(everyone[i], start(i), start(i) + size,
                                                  axis=dim)
                                 for i in range(everyone.shape[0])]), axes)


def shift(v, axes: tuple, p: int, s: int):
    """Member me receives member (me − s) mod P's v: the ring's hop by s (`lax.ppermute`
    on a mesh)."""
    if not static(axes):
        name = axes_lib.name(axes)
        return lax.ppermute(v, name, tuple((i, (i + s) % p) for i in range(p)))
    return to_members(jnp.roll(gather(v, axes), s, axis=0), axes)


def place(chunks: list, axes: tuple, p: int, at: Callable, dim: int):
    """The chunks laid along `dim`: chunks[s] (member me's) at position at(me, s), each
    position a chunk's length; at(me, ·) is a permutation of range(p) for every member."""
    if not static(axes):
        me = lax.axis_index(axes_lib.name(axes))
        n = chunks[0].shape[dim]
        # the buffer grows from the first chunk rather than from zeros: a constant would
        # have no operand to wait for, so XLA may make it long before its chunks and hold
        # it meanwhile (in a backward pass: one per layer, from its start)
        widths = [(0, 0)] * chunks[0].ndim
        widths[dim] = (0, (p - 1) * n)
        out = jnp.pad(chunks[0], widths)
        for s, c in enumerate(chunks):
            out = lax.dynamic_update_slice_in_dim(out, c, at(me, s) * n, dim)
        return out
    everyone = [gather(c, axes) for c in chunks]                     # [s]: (P, *chunk)
    source = [{at(i, s): s for s in range(p)} for i in range(p)]     # [me][position]: s
    return to_members(jnp.stack([
        jnp.concatenate([everyone[source[i][j]][i] for j in range(p)], axis=dim)
        for i in range(p)]), axes)


def put(v, part, axes: tuple, start: Callable, dim: int):
    """Member me's v with `part` written over it at start(me) along `dim` (a dynamic update
    slice on a mesh)."""
    if not static(axes):
        me = lax.axis_index(axes_lib.name(axes))
        return lax.dynamic_update_slice_in_dim(v, part, start(me), dim)
    everyone, parts = gather(v, axes), gather(part, axes)
    n, size = v.shape[dim], part.shape[dim]

    def put_one(i):            # static slices: a dynamic update slice would batch as a scatter
        a = start(i)
        return jnp.concatenate([lax.slice_in_dim(everyone[i], 0, a, axis=dim), parts[i],
                                lax.slice_in_dim(everyone[i], a + size, n, axis=dim)],
                               axis=dim)
    return to_members(jnp.stack([put_one(i) for i in range(everyone.shape[0])]), axes)


def pick(table, axes: tuple):
    """Member me's table[me], from a per-member table of Python values (an index into a
    constant on a mesh)."""
    table = jnp.asarray(table)
    if not static(axes):
        return table[lax.axis_index(axes_lib.name(axes))]
    return to_members(table, axes)


def permute(v, axes: tuple, perm):
    """`lax.ppermute(v, axes, perm)`: member dst receives member src's v for each (src, dst)
    of perm, zeros where none is sent to it."""
    if not static(axes):
        return lax.ppermute(v, axes_lib.name(axes), perm)
    everyone = gather(v, axes)
    source = {dst: src for src, dst in perm}
    return to_members(jnp.stack([everyone[source[i]] if i in source
                                 else jnp.zeros_like(everyone[i])
                                 for i in range(everyone.shape[0])]), axes)
