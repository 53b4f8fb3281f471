"""Argument handling shared by the collectives: mesh axes, their size, check_vma."""
from __future__ import annotations

import contextlib
from typing import Hashable

import jax
import jax.numpy as jnp
from jax import lax

from taco_jax import _jax_private


class UnboundAxisError(NameError):
    """An axis name that is not bound where the collective runs. A NameError, as lax's own
    error is, so code that catches lax's error keeps working."""


def resolve(axis_name, op: str) -> tuple[Hashable, ...]:
    """axis_name (one name or a tuple/list of names, as lax takes) → a tuple of names."""
    axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    if not axes:
        raise ValueError(f"taco_jax.{op}: axis_name={axis_name!r} names no axis")
    if len(set(axes)) != len(axes):
        raise ValueError(f"taco_jax.{op}: axis_name={axis_name!r} repeats an axis")
    return axes


def as_tuple(axis) -> tuple:
    """The inverse of `name`."""
    return axis if isinstance(axis, tuple) else (axis,)


def name(axes: tuple) -> Hashable:
    """The form lax collectives take: the name itself for one axis, else the tuple."""
    return axes[0] if len(axes) == 1 else axes


def size(axes: tuple, op: str) -> int:
    """Number of devices over `axes` (their product); a clear error if one is unbound."""
    p = 1
    for a in axes:
        try:
            p *= lax.axis_size(a)
        except NameError:
            raise UnboundAxisError(
                f"{_lax_unbound_message(op, axes, a)} taco_jax.{op}: axis_name={a!r} is not "
                f"a mesh axis bound here; call it inside jax.shard_map over a mesh with that "
                f"axis (or jax.vmap with axis_name={a!r})") from None
    return p


# The lax collective of the same name as a taco_jax op, called on a probe value (a jax
# array: lax.psum answers a NumPy constant by another path, with another message).
_LAX_PROBES = {
    "psum": lambda axis: lax.psum(jnp.zeros((), jnp.float32), axis),
    "all_gather": lambda axis: lax.all_gather(jnp.zeros(1, jnp.float32), axis),
    "psum_scatter": lambda axis: lax.psum_scatter(jnp.zeros(1, jnp.float32), axis, tiled=True),
    "ppermute": lambda axis: lax.ppermute(jnp.zeros((), jnp.float32), axis, [(0, 0)]),
}
# the collective matmuls: what their collective says (their plain route calls it)
_LAX_PROBES["all_gather_matmul"] = _LAX_PROBES["all_gather"]
_LAX_PROBES["matmul_reduce_scatter"] = _LAX_PROBES["psum_scatter"]


def _lax_unbound_message(op: str, axes: tuple, a) -> str:
    """What jax says for an unbound axis where `op`'s lax namesake is called here, whole, so
    code matching jax's message keeps matching; its wording differs by context and jax
    version, so it is asked, not copied. Where jax says only "unbound axis name: a" (or
    fails otherwise, or op has no lax namesake): lax.psum's first sentence, which holds it."""
    sentence = f"Found an unbound axis name: {a}."
    probe = _LAX_PROBES.get(op)
    try:
        if probe is not None:
            probe(name(axes))
    except NameError as e:
        message = str(e)
        if message and message not in sentence:
            return message if message.endswith(".") else message + "."
    except Exception:    # noqa: BLE001 (inside shard_map lax.psum fails an assertion)
        pass
    return sentence


def _mat(x):
    return getattr(jax.typeof(x), "manual_axis_type", None)


def check_vma(axes: tuple) -> bool:
    """Is shard_map's check_vma in effect for `axes`? Under it, axis_index varies over its
    axis; with check_vma=False nothing is marked varying. Under vmap: the recipe's
    `vmap_check_vma`."""
    if emulated(axes):
        from taco_jax import recipe
        return recipe.current().vmap_check_vma
    # Asked in a throwaway trace of its own: an axis_index in the caller's trace would stay
    # in its jaxpr, and the plain route must trace to exactly the lax collective.
    index = jax.make_jaxpr(lambda: lax.axis_index(name(axes)))().out_avals[0]
    mat = getattr(index, "manual_axis_type", None)
    return mat is not None and bool(set(axes) & set(mat.varying))


def varying(x, axes: tuple) -> bool:
    """Does x vary over every one of `axes` (check_vma=True)? Under vmap every input is
    treated as varying (vmap does not tell)."""
    if emulated(axes):
        return True
    mat = _mat(x)
    return mat is not None and set(axes) <= set(mat.varying)


def reduced_or_unreduced(x) -> bool:
    """Does x carry jax's reduced / unreduced sharding types (they go to lax as they are)?"""
    mat = _mat(x)
    return mat is not None and bool(mat.reduced or mat.unreduced)


def bound(axes: tuple, p):
    """Context for a custom_vjp backward rule that calls collectives over `axes`.

    Under `jax.vmap(..., axis_name=...)` JAX traces a custom_vjp's backward rule after the
    vmap has returned, where the axis name is no longer bound (lax's own collectives are
    batched before that and do not meet this). Re-binding the named axes with their sizes
    lets the backward's collectives batch as the forward's did. Under shard_map the axes
    are still bound and nothing changes. JAX exposes no public API for this
    (`taco_jax._jax_private.extend_axis_env`). p: the axis's size (one axis), or a tuple
    of each axis's size (any number)."""
    try:
        for a in axes:
            lax.axis_size(a)
        return contextlib.nullcontext()
    except NameError:
        sizes = p if isinstance(p, tuple) else (p,) if len(axes) == 1 else None
        if sizes is None:
            raise UnboundAxisError(f"axes {axes} are unbound in a backward pass; under "
                                   f"jax.vmap use one named axis") from None
        stack = contextlib.ExitStack()
        for a, n in zip(axes, sizes):
            stack.enter_context(_jax_private.extend_axis_env(a, n))
        return stack


def emulated(axes: tuple) -> bool:
    """Are `axes` bound by `jax.vmap(..., axis_name=...)` rather than by a shard_map mesh
    (tensor parallelism emulated on one device)?"""
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    return not set(axes) <= manual


def per_member(y, axes: tuple, force: bool = False):
    """Under vmap (with vmap's own convention, or `force`), make y (equal on every member)
    batched over the axis: vmap treats the unbatched result of an all-gather as one value
    shared by all members, so cotangents would reach a backward rule already summed over
    them, and the backward all-reduce, compressed on a mesh, would be skipped. With a
    batched result each member's cotangent arrives on its own, as on a mesh. Under the
    check_vma convention a psum's result stays shared: its cotangent is the total, which
    its backward passes through. Identity elsewhere."""
    if not emulated(axes) or (check_vma(axes) and not force):
        return y
    idx = lax.axis_index(name(axes))
    return y + (idx * 0).astype(y.dtype)
