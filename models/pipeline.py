"""Pipeline parallelism over a mesh axis ("pipe"), GPipe schedule, inside `jax.shard_map`.

Each device along the axis holds one stage (its own parameters: stacked per-stage arrays
split over "pipe"). The M micro-batches enter stage 0 one per tick; after each tick every
stage hands its output to the next through `taco_jax.ppermute` (compressed with `codec`,
exact with "none"), so at tick t stage s works on micro-batch t − s. After M + S − 1 ticks
the last stage holds every output. Autodiff of the scan runs the schedule backwards: the
cotangents travel from stage s + 1 to s through ppermute's transpose (the reverse
permutation, compressed alike). Idle ticks (the bubble: (S − 1)/(M + S − 1) of the
ticks) compute on zeros and are masked out of the result.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

import taco_jax

PIPE = "pipe"


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Share of a GPipe step's stage-ticks that do no useful work."""
    return (stages - 1) / (microbatches + stages - 1)


def _varying(x, axis: str):
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    if mat is None or axis in mat.varying:       # check_vma off, or already varying
        return x
    return lax.pcast(x, axis, to="varying")


def gpipe(stage_fn: Callable[[Any, jax.Array], jax.Array], params, microbatches: jax.Array,
          *, axis: str = PIPE, codec="none", min_bytes: int | None = None) -> jax.Array:
    """Run `stage_fn(params, x) -> y` (y shaped like x) as a pipeline over `axis`.

    microbatches: (M, *shape), read by stage 0 (every stage may hold them). Returns
    (M, *shape): the last stage's outputs on the last stage, zeros on the others (so a
    psum over `axis` of anything computed from it counts it once)."""
    n_stages, stage = lax.axis_size(axis), lax.axis_index(axis)
    m = microbatches.shape[0]
    perm = [(i, i + 1) for i in range(n_stages - 1)]
    last = stage == n_stages - 1
    zero = jnp.zeros(microbatches.shape[1:], microbatches.dtype)

    def tick(carry, t):
        arriving, outs = carry
        mb = t - stage                                        # the micro-batch here
        first_in = lax.dynamic_index_in_dim(microbatches, jnp.clip(t, 0, m - 1), 0,
                                            keepdims=False)
        x = jnp.where(stage == 0, first_in, arriving)
        y = stage_fn(params, x)
        valid = (mb >= 0) & (mb < m)
        slot = jnp.clip(mb, 0, m - 1)
        kept = lax.dynamic_index_in_dim(outs, slot, 0, keepdims=False)
        outs = lax.dynamic_update_index_in_dim(outs, jnp.where(valid & last, y, kept), slot, 0)
        sent = taco_jax.ppermute(jnp.where(valid, y, zero), axis, perm, codec=codec,
                                 min_bytes=min_bytes)
        return (sent, outs), None

    init = (_varying(zero, axis), _varying(jnp.zeros_like(microbatches), axis))
    (_, outs), _ = lax.scan(tick, init, jnp.arange(m + n_stages - 1))
    return outs
