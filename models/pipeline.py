"""Pipeline parallelism over a mesh axis ("pipe"), GPipe schedule, inside `jax.shard_map`.

Each device along the axis holds one stage (its own parameters: stacked per-stage arrays
split over "pipe"). The M micro-batches enter stage 0 one per tick; after each tick every
stage hands its output to the next through `taco_jax.ppermute` (compressed with `codec`,
exact with "none"), so at tick t stage s works on micro-batch t − s. After M + S − 1 ticks
the last stage holds every output. Autodiff of the scan runs the schedule backwards: the
cotangents travel from stage s + 1 to s through ppermute's transpose (the reverse
permutation, compressed alike). Idle ticks (the bubble: (S − 1)/(M + S − 1) of the
ticks) compute on zeros and are masked out of the result.

The tick body is traced once and runs M + S − 1 times per call; the scan is declared with
`telemetry.repeated`, so the sites traced inside it are counted M + S − 1 times (the
call-site report and the bytes a step sends then count what really runs).
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

import taco_jax
from taco_jax import telemetry

PIPE = "pipe"


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Share of a GPipe step's stage-ticks that do no useful work."""
    return (stages - 1) / (microbatches + stages - 1)


def vma(x) -> frozenset:
    """The mesh axes x varies over (empty outside shard_map or with check_vma=False)."""
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset() if mat is None else frozenset(mat.varying)


def vary(x, axes) -> jax.Array:
    """x made varying over `axes` (those it does not vary over yet; identity with
    check_vma=False, where nothing is marked varying)."""
    if getattr(jax.typeof(x), "manual_axis_type", None) is None:
        return x
    missing = tuple(a for a in axes if a not in vma(x))
    return lax.pcast(x, missing, to="varying") if missing else x


def gpipe(stage_fn: Callable[[Any, jax.Array], jax.Array], params, microbatches: jax.Array,
          *, axis: str = PIPE, codec="none", min_bytes: int | None = None) -> jax.Array:
    """Run `stage_fn(params, x) -> y` (y shaped like x) as a pipeline over `axis`.

    microbatches: (M, *shape), read by stage 0 (every stage may hold them). Returns
    (M, *shape): the last stage's outputs on the last stage, zeros on the others (so a
    psum over `axis` of anything computed from it counts it once).

    Under check_vma the hand-offs vary over `axis` and over the axes `microbatches` varies
    over; `stage_fn`'s output may vary over fewer (a psum inside it: it is cast up), not
    over more (make the micro-batches vary over those axes first)."""
    n_stages, stage = lax.axis_size(axis), lax.axis_index(axis)
    m = microbatches.shape[0]
    perm = [(i, i + 1) for i in range(n_stages - 1)]
    last = stage == n_stages - 1
    carry_axes = tuple(sorted(vma(microbatches) | vma(stage), key=str))
    zero = vary(jnp.zeros(microbatches.shape[1:], microbatches.dtype), carry_axes)

    def tick(carry, t):
        arriving, outs = carry
        mb = t - stage                                        # the micro-batch here
        first_in = lax.dynamic_index_in_dim(microbatches, jnp.clip(t, 0, m - 1), 0,
                                            keepdims=False)
        x = jnp.where(stage == 0, first_in, arriving)
        y = stage_fn(params, x)
        extra = vma(y) - set(carry_axes)
        if extra:
            raise ValueError(f"gpipe: the stage's output varies over {sorted(extra)}, its "
                             f"input over {sorted(carry_axes)} only: make the micro-batches "
                             f"vary over those axes too (lax.pcast(..., to='varying'))")
        y = vary(y, carry_axes)
        valid = (mb >= 0) & (mb < m)
        slot = jnp.clip(mb, 0, m - 1)
        kept = lax.dynamic_index_in_dim(outs, slot, 0, keepdims=False)
        outs = lax.dynamic_update_index_in_dim(outs, jnp.where(valid & last, y, kept), slot, 0)
        sent = taco_jax.ppermute(jnp.where(valid, y, zero), axis, perm, codec=codec,
                                 min_bytes=min_bytes)
        return (sent, outs), None

    ticks = m + n_stages - 1
    init = (zero, vary(jnp.zeros_like(microbatches), carry_axes))
    with telemetry.repeated(ticks):
        (_, outs), _ = lax.scan(tick, init, jnp.arange(ticks))
    return outs
