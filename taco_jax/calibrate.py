"""Measure, on this machine, where compression beats `lax.psum`, and remember it.

    python -m taco_jax.calibrate            # all local devices as one axis; writes the cache

times lax.psum against taco_jax.psum over each transport ("xla": XLA's all-to-all and
all-gather around the kernels; "fused": in-kernel stores into the peers' memory, GPUs of
one process) per tensor size, and writes a cache keyed by device kind, device count and
link (`machine_key`). `taco_jax.psum` with `min_bytes=None` and `transport="auto"` reads it
at trace time (`route`): per size, the fastest of lax.psum and the transports, where
compression must win by `margin`. Without a cache the conservative default holds: the xla
transport from `taco_jax.DEFAULT_MIN_BYTES`. A corrupt cache, or one written for another
machine or codec, is reported once and ignored, never trusted.

Each size is timed the way a model sees it, on a freshly computed input: `x · one`, with
`one` a runtime scalar, so lax.psum's in-place all-reduce does not pay for a copy of a
reused buffer, and the time of that multiply alone is subtracted. Calls are timed back to
back (`time_calls`).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from taco_jax import codecs
from taco_jax.collectives import fused
from taco_jax.collectives.allreduce import psum
from taco_jax.routes import (CACHE_ENV, CACHE_VERSION, NEVER, TRANSPORTS,  # noqa: F401
                             Calibration, _loaded, _warned, best_route, cache_path,
                             decide_min_bytes, link, lookup, machine_key, save)


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


def fresh_times(fns, x, *, timer=time_calls, **timer_kw) -> tuple:
    """(prep, [t(fn) for fn in fns]) µs per call on an input computed inside the call
    (x · one, `one` a runtime scalar): lax.psum pays no copy of a reused buffer, as in a
    model. `prep` is that multiply alone; subtract it from the others."""
    arg = (x, jnp.ones((), x.dtype))
    prep = timer(lambda a: a[0] * a[1], arg, **timer_kw)
    return prep, [timer(lambda a, fn=fn: fn(a[0] * a[1]), arg, **timer_kw) for fn in fns]


# -- measuring ------------------------------------------------------------------------------
def calibrate(mesh, axis_name: str, *, codec: str = "taco", transports=("xla", "fused"),
              sizes_mib=(1, 4, 16, 64, 256, 1024), dtype=jnp.bfloat16, margin: float = 0.97,
              iters: int = 10, repeats: int = 3, timer=time_calls) -> Calibration:
    """Time lax.psum and taco_jax.psum over each transport that can run here, over
    `axis_name` of `mesh`, at each size (MiB per device, of `dtype`, rounded to whole
    blocks). The data is sharded over `axis_name` and replicated over the mesh's other
    axes. `timer(fn, x, iters=, repeats=) -> µs` is replaceable (tests). Costs a compile per
    size and transport (seconds each on GPU): do it once per machine, then `save` it."""
    if axis_name not in mesh.axis_names:
        raise ValueError(f"calibrate: axis_name={axis_name!r} is not an axis of the "
                         f"mesh {tuple(mesh.axis_names)}")
    c = codecs.get(codec)        # unknown names fail here, with the list of codecs
    if c.is_identity:
        raise ValueError("calibrate: codec='none' never compresses; nothing to calibrate")
    if not sizes_mib or any(not (s > 0) for s in sizes_mib):
        raise ValueError(f"calibrate: sizes_mib={sizes_mib!r} must be positive sizes")
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"calibrate: dtype={dtype!r} must be a float type")
    if not (0 < margin <= 1.5):
        raise ValueError(f"calibrate: margin={margin!r} should be a ratio like 0.97")
    bad = set(transports) - set(TRANSPORTS)
    if bad:
        raise ValueError(f"calibrate: transports {sorted(bad)} not in {TRANSPORTS}")
    p = mesh.shape[axis_name]
    key = machine_key(p, getattr(mesh.devices.flat[0], "device_kind", None))
    if p == 1:      # psum over one device is the identity: never worth compressing
        return Calibration(axis_name, c.name, margin, (), NEVER, p, key)
    usable = [t for t in transports
              if t != "fused" or fused.mesh_unavailable_reason(mesh) is None]
    spec = P(axis_name)

    def sharded(fn):   # the sum is replicated: out_specs P()
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=P()))

    fns = [sharded(lambda v: lax.psum(v, axis_name))] + [
        sharded(lambda v, t=t: psum(v, axis_name, codec=codec, min_bytes=0, transport=t))
        for t in usable]
    itemsize = jnp.dtype(dtype).itemsize
    rows = []
    for mib in sorted(sizes_mib):
        per_dev = max(c.block_size, int(mib * 2**20) // itemsize // c.block_size * c.block_size)
        x = jax.device_put(jnp.ones((p * per_dev,), dtype), NamedSharding(mesh, spec))
        prep, times = fresh_times(fns, x, timer=timer, iters=iters, repeats=repeats)
        net = [t - prep for t in times]
        row = {"mib": per_dev * itemsize / 2**20, "lax_us": net[0]}
        for t, us in zip(usable, net[1:]):
            row[f"{t}_us"] = us
            row[f"{t}_ratio"] = us / net[0] if net[0] > 0 else math.nan
        rows.append(row)
    return Calibration(axis_name, c.name, margin, tuple(rows),
                       decide_min_bytes(rows, margin, "xla_ratio"), p, key)


def calibrate_min_bytes(mesh, axis_name: str, **kw) -> Calibration:
    """`calibrate` over the xla transport only: its `min_bytes` is the threshold to pass."""
    return calibrate(mesh, axis_name, transports=("xla",), **kw)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m taco_jax.calibrate",
                                 description="Time lax.psum against taco_jax.psum per "
                                             "transport and size; write the cache.")
    ap.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    ap.add_argument("--codec", default="taco")
    ap.add_argument("--transports", nargs="+", default=list(TRANSPORTS), choices=TRANSPORTS)
    ap.add_argument("--margin", type=float, default=0.97)
    ap.add_argument("--cache", default=None, help=f"cache file (default ${CACHE_ENV} or "
                                                  f"~/.cache/taco_jax/calibration.json)")
    ap.add_argument("--json", default=None, help="also write this table as JSON here")
    a = ap.parse_args(argv)
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("tp",))
    cal = calibrate(mesh, "tp", codec=a.codec, transports=a.transports, sizes_mib=a.sizes_mib,
                    margin=a.margin)
    print(cal.table())
    print(f"wrote {save(cal, a.cache)} ({cal.key})")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"device": jax.devices()[0].device_kind,
                                            "link": link(), **cal.to_json()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
