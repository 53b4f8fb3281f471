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
SCHEDULES = ("gpipe", "1f1b")


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


def telemetry_times(n: int, differentiated: bool = True) -> Callable:
    """Decorator: the taco_jax sites traced in fn count n times (a loop body's branch that
    runs n times per call; `telemetry.repeated`)."""
    def wrap(fn):
        def counted(*args):
            with telemetry.repeated(n, differentiated):
                return fn(*args)
        return counted
    return wrap


def fit(grads, primals):
    """Gradients typed like their primals under check_vma: summed over the axes they vary
    over and their primal does not (what autodiff's transpose of the broadcast does)."""
    def one(g, p):
        extra = tuple(sorted(vma(g) - vma(p), key=str))
        return lax.psum(g, extra) if extra else g
    return jax.tree.map(one, grads, primals)


def one_f_one_b_ticks(stages: int, microbatches: int) -> int:
    """Ticks of a 1F1B step: every stage runs M forwards and M backwards, one per tick."""
    return 2 * (microbatches + stages - 1)


def _swap(stages: int, parity: int) -> list[tuple[int, int]]:
    """The tick's hand-offs: stages s ≡ parity (mod 2) send forward to s + 1 while s + 1
    sends its cotangent back to s; one permutation carries both directions."""
    pairs = [(s, s + 1) for s in range(parity, stages - 1, 2)]
    return [p for a, b in pairs for p in ((a, b), (b, a))]


def one_f_one_b(stage_fn: Callable[[Any, jax.Array], jax.Array], params, microbatches,
                loss_fn: Callable[[Any, jax.Array, Any], jax.Array], loss_params, targets,
                *, axis: str = PIPE, codec="none", min_bytes: int | None = None,
                scale=1.0):
    """Loss and gradients of a pipelined model with the 1F1B schedule, over `axis`.

    The model: x_i = microbatches[i] enters stage 0, each stage applies
    `stage_fn(params, x)` (its own `params`), and the last stage's output y_i is scored by
    `loss_fn(loss_params, y_i, targets[i])` (a scalar). Returns (Σ_i loss_i · scale on the
    last stage, 0 elsewhere; d/d params; d/d loss_params, nonzero on the last stage only;
    d/d microbatches (M, ...), nonzero on stage 0 only), all scaled by `scale`.

    Stage s runs the forward of micro-batch i at tick s + 2i and its backward at tick
    2S − 1 − s + 2i, so a stage alternates forward and backward ticks and holds at most
    S − s micro-batches in flight (their stage inputs; the backward recomputes the stage's
    forward from it): activation memory is bounded by the stage count, not by M as with
    `gpipe`. At each tick the stages of one parity hand their output forward while their
    neighbours hand their cotangent back: one `taco_jax.ppermute` per tick (compressed
    with `codec`, exact with "none"), 2(M + S − 1) ticks, the same bytes as `gpipe`'s
    forward and backward hand-offs. The bubble is the same (S − 1)/(M + S − 1) of a
    stage's ticks. The last stage skips the forward tick (its backward recomputes it with
    the loss). Under check_vma the hand-offs vary over `axis` and the axes `microbatches`
    varies over, as with `gpipe`."""
    n_stages, stage = lax.axis_size(axis), lax.axis_index(axis)
    m = microbatches.shape[0]
    slots = n_stages
    last = stage == n_stages - 1
    carry_axes = tuple(sorted(vma(microbatches) | vma(stage), key=str))
    zero = vary(jnp.zeros(microbatches.shape[1:], microbatches.dtype), carry_axes)

    def like(tree, axes=()):
        """Zeros shaped and varying like `tree` (the gradient accumulators)."""
        return jax.tree.map(
            lambda a: vary(jnp.zeros_like(a), tuple(sorted(vma(a) | set(axes), key=str))), tree)

    def up(tree, ref):
        """tree's leaves varying over what ref's leaves vary over (check_vma)."""
        return jax.tree.map(lambda a, r: vary(a, tuple(sorted(vma(r), key=str))), tree, ref)

    @telemetry_times(m, differentiated=False)     # the backward tick recomputes it
    def forward(c, i):
        recv, buf, acc_p, acc_l, loss, dxs = c
        first = lax.dynamic_index_in_dim(microbatches, i, 0, keepdims=False)
        x = jnp.where(stage == 0, first, recv)
        buf = lax.dynamic_update_index_in_dim(buf, x, i % slots, 0)
        y = lax.cond(last, lambda: zero, lambda: vary(stage_fn(params, x), carry_axes))
        return y, (recv, buf, acc_p, acc_l, loss, dxs)

    @telemetry_times(m)
    def backward(c, i):
        recv, buf, acc_p, acc_l, loss, dxs = c
        x = lax.dynamic_index_in_dim(buf, i % slots, 0, keepdims=False)
        tgt = jax.tree.map(lambda t: lax.dynamic_index_in_dim(t, i, 0, keepdims=False),
                           targets)

        y, pull = jax.vjp(stage_fn, params, x)

        def scored(y):      # the last stage: the loss, and its gradient as the cotangent
            li, lpull = jax.vjp(lambda lp, y: loss_fn(lp, y, tgt), loss_params, y)
            gl, gy = lpull(vary(jnp.asarray(scale, li.dtype), tuple(vma(li))))
            return up(li.astype(loss.dtype) * scale, loss), up(gl, acc_l), up(gy, y)

        def inner(y):       # the others: the cotangent the next stage sent back
            return (up(jnp.zeros((), loss.dtype), loss), up(like(loss_params), acc_l),
                    up(recv.astype(y.dtype), y))

        li, gl, gy = lax.cond(last, scored, inner, y)
        gp, gx = pull(gy)
        gp, gx = up(gp, acc_p), up(gx.astype(zero.dtype), zero)
        acc_p = jax.tree.map(jnp.add, acc_p, gp)
        acc_l = jax.tree.map(jnp.add, acc_l, gl)
        kept = lax.dynamic_index_in_dim(dxs, i, 0, keepdims=False)
        dxs = lax.dynamic_update_index_in_dim(dxs, jnp.where(stage == 0, gx, kept), i, 0)
        return gx, (recv, buf, acc_p, acc_l, loss + li, dxs)

    def hop(perm):
        def go(x):
            # M + S − 1 ticks of each parity; a hand-off's transpose never runs
            with telemetry.repeated(m + n_stages - 1, differentiated=False):
                return taco_jax.ppermute(x, axis, perm, codec=codec, min_bytes=min_bytes)
        return go

    def tick(c, t):
        f, b = t - stage, t - (2 * n_stages - 1 - stage)
        do_f = (f >= 0) & (f % 2 == 0) & (f // 2 < m)
        do_b = (b >= 0) & (b % 2 == 0) & (b // 2 < m)
        which = jnp.where(do_f, 1, jnp.where(do_b, 2, 0))
        i = jnp.clip(jnp.where(do_f, f // 2, b // 2), 0, m - 1)
        send, c = lax.switch(which, [lambda c, i: (zero, c), forward, backward], c, i)
        # the same parity on every device: one hand-off pattern per tick
        recv = lax.cond(t % 2 == 0, hop(_swap(n_stages, 0)), hop(_swap(n_stages, 1)), send)
        return (recv, *c[1:]), None

    init = (zero, vary(jnp.zeros((slots, *microbatches.shape[1:]), microbatches.dtype),
                       carry_axes),
            like(params, carry_axes), like(loss_params, carry_axes),
            vary(jnp.zeros((), jnp.float32), carry_axes),
            vary(jnp.zeros_like(microbatches), carry_axes))
    (_, _, acc_p, acc_l, loss, dxs), _ = lax.scan(tick, init,
                                                  jnp.arange(one_f_one_b_ticks(n_stages, m)))
    return loss, fit(acc_p, params), fit(acc_l, loss_params), dxs
