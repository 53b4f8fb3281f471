"""Measure, on this machine, from which tensor size compression beats `lax.psum`.

`taco_jax.DEFAULT_MIN_BYTES` (512 MiB) suits two NVLink-connected H200s, where halving the
bytes barely pays for the kernels. On slower links (PCIe, between hosts) the break-even is
far lower. `calibrate_min_bytes` finds it for the mesh at hand:

    cal = taco_jax.calibrate.calibrate_min_bytes(mesh, "tp")
    print(cal.table())
    y = taco_jax.psum(x, "tp", min_bytes=cal.min_bytes)       # or GPTConfig(min_bytes=…)

Each size is timed the way a model sees it, on a freshly computed input. The input is
`x · one`, with `one` a runtime scalar, so lax.psum's in-place all-reduce does not pay for
a copy of a reused buffer, and the time of that multiply alone is subtracted (the
benchmarks' `fresh_ratio`). Calls are timed back to back (`time_calls`).
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

# calibrate_min_bytes' answer when compression won at no measured size: larger than any
# tensor, so psum(min_bytes=NEVER) always takes lax.psum
NEVER = 1 << 62


def jit_calls(fn):
    """jit(xs -> [fn(x) for x in xs]) for a list of inputs: the calls back to back in
    straight-line code, every output returned. Each call has its own input buffer (a
    barrier on one shared input does not stop XLA from merging identical calls: it expands
    barriers into control edges before CSE; seen on CPU), so none can be merged or
    dropped."""
    return jax.jit(lambda xs: [fn(x) for x in xs])


def time_calls(fn, x, iters: int = 10, repeats: int = 5, batches: int = 3) -> float:
    """Median µs per call of fn(x), from `batches` executions of `jit_calls` queued back to
    back (the host dispatches the next while the device runs one), over `repeats`.

    No while loop: XLA's GPU while loop adds ~16 µs per trip on the H200, which a 120 µs
    kernel would carry as 13% of its time. Memory: `iters` copies of x, and iters × batches
    outputs (every output stays live): lower `iters` for the largest sizes."""
    xs = [jax.tree.map(jnp.copy, x) for _ in range(iters)]
    calls = jit_calls(fn)
    jax.block_until_ready(calls(xs))                    # compile + warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = [calls(xs) for _ in range(batches)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - t0) / (iters * batches) * 1e6)
        del outs
    return statistics.median(times)


def fresh_times(lax_fn, taco_fn, x, *, timer=time_calls, **timer_kw) -> tuple:
    """(prep, lax, taco) µs per call on an input computed inside the loop (x · one, `one` a
    runtime scalar): lax.psum pays no copy of a reused buffer, as in a model. `prep` is that
    multiply alone; subtract it from the other two."""
    arg = (x, jnp.ones((), x.dtype))
    return (timer(lambda a: a[0] * a[1], arg, **timer_kw),
            timer(lambda a: lax_fn(a[0] * a[1]), arg, **timer_kw),
            timer(lambda a: taco_fn(a[0] * a[1]), arg, **timer_kw))


@dataclasses.dataclass(frozen=True)
class Calibration:
    """rows: one dict per size {"mib", "lax_us", "taco_us", "ratio"} (ratio = taco/lax on
    fresh inputs); min_bytes: the value to pass as `min_bytes` (NEVER if compression won at
    no size)."""
    axis_name: str
    codec: str
    margin: float
    rows: tuple
    min_bytes: int

    def table(self) -> str:
        lines = [f"{'MiB/device':>10}  {'lax.psum µs':>11}  {'taco µs':>9}  {'ratio':>6}"]
        lines += [f"{r['mib']:>10g}  {r['lax_us']:>11.1f}  {r['taco_us']:>9.1f}  "
                  f"{r['ratio']:>6.3f}" for r in self.rows]
        where = ("never (lax.psum at every size)" if self.min_bytes == NEVER
                 else f"from {self.min_bytes / 2**20:g} MiB per device")
        lines.append(f"compress ({self.codec}, ratio ≤ {self.margin}): {where}")
        return "\n".join(lines)


def decide_min_bytes(rows, margin: float) -> int:
    """The smallest measured size (bytes per device) from which taco's ratio is ≤ margin at
    that size and every larger one; NEVER if the largest size already loses. A win at a
    small size followed by a loss at a larger one is treated as noise: the threshold only
    moves down from the top."""
    best = NEVER
    for r in sorted(rows, key=lambda r: -r["mib"]):
        if not (r["ratio"] <= margin):           # NaN ratios lose too
            break
        best = int(r["mib"] * 2**20)
    return best


def calibrate_min_bytes(mesh, axis_name: str, *, codec: str = "taco",
                        sizes_mib=(1, 4, 16, 64, 256, 1024), dtype=jnp.bfloat16,
                        margin: float = 0.97, iters: int = 10, repeats: int = 3,
                        timer=time_calls) -> Calibration:
    """Time lax.psum and taco_jax.psum (min_bytes=0) over `axis_name` of `mesh` at each size
    (MiB per device, of `dtype`) and return the threshold from which compression wins by
    `margin` (default: 3% faster, above run-to-run noise). The data is sharded over
    `axis_name` and replicated over the mesh's other axes. Sizes are rounded to whole
    blocks. `timer(fn, x, iters=, repeats=) -> µs` is replaceable (tests).

    Costs a compile per size and codec (seconds each on GPU); do it once per machine and
    keep the number."""
    from taco_jax import codecs
    from taco_jax.collectives.allreduce import psum
    if axis_name not in mesh.axis_names:
        raise ValueError(f"calibrate_min_bytes: axis_name={axis_name!r} is not an axis of the "
                         f"mesh {tuple(mesh.axis_names)}")
    c = codecs.get(codec)        # unknown names fail here, with the list of codecs
    if c.name == "none":
        raise ValueError("calibrate_min_bytes: codec='none' never compresses; nothing to "
                         "calibrate")
    if not sizes_mib or any(not (s > 0) for s in sizes_mib):
        raise ValueError(f"calibrate_min_bytes: sizes_mib={sizes_mib!r} must be positive sizes")
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"calibrate_min_bytes: dtype={dtype!r} must be a float type")
    if not (0 < margin <= 1.5):
        raise ValueError(f"calibrate_min_bytes: margin={margin!r} should be a ratio like 0.97")
    p = mesh.shape[axis_name]
    if p == 1:      # psum over one device is the identity: never worth compressing
        return Calibration(axis_name, c.name, margin, (), NEVER)
    spec = P(axis_name)

    def sharded(fn):   # the sum is replicated: out_specs P()
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=P()))

    lax_fn = sharded(lambda v: lax.psum(v, axis_name))
    taco_fn = sharded(lambda v: psum(v, axis_name, codec=codec, min_bytes=0))
    itemsize = jnp.dtype(dtype).itemsize
    rows = []
    for mib in sorted(sizes_mib):
        per_dev = max(c.block_size, int(mib * 2**20) // itemsize // c.block_size * c.block_size)
        x = jax.device_put(jnp.ones((p * per_dev,), dtype), NamedSharding(mesh, spec))
        prep, lax_us, taco_us = fresh_times(lax_fn, taco_fn, x, timer=timer, iters=iters,
                                            repeats=repeats)
        net_lax, net_taco = lax_us - prep, taco_us - prep
        rows.append({"mib": per_dev * itemsize / 2**20, "lax_us": net_lax, "taco_us": net_taco,
                     "ratio": net_taco / net_lax if net_lax > 0 else math.nan})
    return Calibration(axis_name, c.name, margin, tuple(rows), decide_min_bytes(rows, margin))
