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

Before a transport is timed at a size, its result on random inputs is checked against
lax.psum's (`check_transport`: within the codec's own error, exactly for an exact codec):
the timings run on all-ones inputs, where a transport that delivers segments to the wrong
place would look correct and fast. A transport that fails the check is never cached, at
any size. A size whose buffers do not fit in the devices' free memory (`memory_budget`) is
skipped, and said so: its input, copies and live outputs, and XLA's temporaries as its
memory analysis of each compiled program gives them (`held_bytes`), per device, and on CPU
for all the simulated devices together, as they share the host's memory. On CPU the
devices are simulated: the timings are the CPU backend's, and the routes are for this
machine alone.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from taco_jax import codecs
from taco_jax.collectives import fused
from taco_jax.collectives.allreduce import psum
from taco_jax.routes import (CACHE_ENV, CACHE_VERSION, NEVER, TRANSPORTS,  # noqa: F401
                             Calibration, best_route, cache_path, decide_min_bytes, forget,
                             link, lookup, machine_key, save)


def jit_calls(fn):
    """jit(xs -> [fn(x) for x in xs]) for a list of inputs: the calls back to back in
    straight-line code, every output returned. Each call has its own input buffer (a
    barrier on one shared input does not stop XLA from merging identical calls: it expands
    barriers into control edges before CSE; seen on CPU), so none can be merged or
    dropped."""
    return jax.jit(lambda xs: [fn(x) for x in xs])


def warm_calls(fn, x, iters: int):
    """(`jit_calls(fn)`, `iters` copies of x), compiled and run once."""
    calls = jit_calls(fn)
    return calls, warm_program(calls, x, iters)


def warm_program(calls, x, iters: int) -> list:
    """`iters` copies of x, on which the program `calls` (`jit_calls`) has run once."""
    xs = [jax.tree.map(jnp.copy, x) for _ in range(iters)]
    jax.block_until_ready(calls(xs))
    return xs


def host_us(calls, xs, repeats: int, batches: int) -> float:
    """Median µs per call of `calls(xs)` (`warm_calls`), from `batches` executions queued
    back to back (the host dispatches the next while the device runs one), over
    `repeats`."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = [calls(xs) for _ in range(batches)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - t0) / (len(xs) * batches) * 1e6)
        del outs
    return statistics.median(times)


def time_calls(fn, x, iters: int = 10, repeats: int = 5, batches: int = 3) -> float:
    """Median µs per call of fn(x), from `batches` executions of `jit_calls` queued back to
    back (the host dispatches the next while the device runs one), over `repeats`.

    No while loop: XLA's GPU while loop adds ~16 µs per trip on the H200, which a 120 µs
    kernel would carry as 13% of its time. Memory: `iters` copies of x, iters × batches
    outputs (every output stays live) and the temporaries of iters calls (`held_bytes`):
    lower `iters` for the largest sizes."""
    return host_us(*warm_calls(fn, x, iters), repeats, batches)


def time_program(calls, x, iters: int = 10, repeats: int = 5, batches: int = 3) -> float:
    """`time_calls` of a program already made, `calls = jit_calls(fn)`: its compiled form
    (from `program_bytes`, say) is reused."""
    return host_us(calls, warm_program(calls, x, iters), repeats, batches)


def fresh(fn):
    """(x, one) -> fn(x · one): the input computed inside the call, with `one` a runtime
    scalar, so lax.psum pays no copy of a reused buffer, as in a model."""
    return lambda a: fn(a[0] * a[1])


def fresh_times(fns, x, *, timer=time_calls, **timer_kw) -> tuple:
    """(prep, [t(fn) for fn in fns]) µs per call on an input computed inside the call
    (`fresh`). `prep` is that multiply alone; subtract it from the others."""
    arg = (x, jnp.ones((), x.dtype))
    prep = timer(fresh(lambda v: v), arg, **timer_kw)
    return prep, [timer(fresh(fn), arg, **timer_kw) for fn in fns]


# -- what a size needs ---------------------------------------------------------------------
# Without device memory statistics (CPU), the share of the host's available memory a
# calibration may hold: the simulated devices all live in it, beside everything else.
HOST_SHARE = 0.5
# On a host backend the process's resident memory exceeds XLA's figure: the C allocator
# keeps some of one program's freed buffers while the next runs, and compiling holds memory
# of its own (measured on 2 and 4 CPU devices, 2-32 MiB per device: 1.04-1.19 × the
# figure, beyond ~0.12 GiB; tests/collectives/test_calibrate.py checks the bound).
HOST_FACTOR, HOST_FIXED = 1.25, 256 << 20


def program_bytes(calls, x, iters: int) -> tuple[int, int]:
    """(outputs, temporaries): bytes per device of one execution of the program
    `calls = jit_calls(fn)` on `iters` inputs like x, from XLA's memory analysis of it,
    compiled here (jit keeps it: `time_program` does not compile it again).

    Args:
      calls: `jit_calls(fn)`.
      x: one input: an array, a `jax.ShapeDtypeStruct` (nothing is allocated), or a tuple
        of them.
      iters: how many inputs the program takes.

    Raises:
      RuntimeError: the backend gives no memory analysis of a compiled program.
    """
    stats = calls.lower([x] * iters).compile().memory_analysis()
    if stats is None:
        raise RuntimeError(f"calibrate: the {jax.default_backend()} backend gives no memory "
                           "analysis of a compiled program, which the memory budget needs")
    return stats.output_size_in_bytes, stats.temp_size_in_bytes


def held_bytes(nbytes: int, itemsize: int, programs, iters: int, batches: int,
               host_devices: int = 0) -> int:
    """The most a size holds while it is measured, from XLA's analysis of the programs
    timed.

    Timing a program (`time_program`) holds, per device: the input, its `iters` copies,
    the program's outputs for each of the `batches` executions (kept live until the batches
    finish) and one execution's temporaries: the queued executions run one at a time on a
    device. Checking a transport (`check_transport`) holds the random input, a result and
    one call's share of the temporaries, per device, and on the host the float64 copies of
    one device's result that the error is computed on.

    Args:
      nbytes, itemsize: one device's input, and its element's size.
      programs: (outputs, temporaries) bytes per device of one execution of each program
        timed (`program_bytes`), each of `iters` calls.
      iters, batches: as `time_calls`.
      host_devices: 0 where each device has its own memory: the figure is per device.
        Else the devices sharing the host's memory (CPU): the figure is for all of them,
        with the host copies, times HOST_FACTOR plus HOST_FIXED.

    Returns:
      Bytes.
    """
    timing = max(nbytes * (1 + iters) + batches * out + temp for out, temp in programs)
    checking = nbytes + max(out + temp for out, temp in programs) // iters
    if not host_devices:
        return max(timing, checking)
    # one result in its dtype, then float64: it, lax.psum's, their difference
    host = nbytes + 3 * 8 * (nbytes // itemsize)
    need = max(timing * host_devices, checking * host_devices + host)
    return int(HOST_FACTOR * need) + HOST_FIXED


def memory_budget(devices) -> tuple[int, bool, str]:
    """(bytes, per_device, where): what a calibration may hold. Devices with memory
    statistics (GPUs): the smallest free memory of any, per device. Otherwise (CPU): a
    share HOST_SHARE of the host's available memory, for all devices together."""
    free = []
    for d in devices:
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if not stats or "bytes_limit" not in stats:
            free = None
            break
        free.append(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    if free:
        return min(free), True, "free device memory (device.memory_stats())"
    available = _host_available()
    return (int(HOST_SHARE * available), False,
            f"{HOST_SHARE:g} of the host's available memory ({available / 2**30:.1f} GiB)")


def _host_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def fits(need: int, budget: tuple[int, bool, str], devices: int) -> tuple[bool, str]:
    """(does `need` bytes (`held_bytes`, for `devices` devices where the budget is the
    host's) fit the budget, the figures as words)."""
    limit, per_device, where = budget
    who = "per device" if per_device else f"for {devices} devices"
    return need <= limit, f"needs {_size(need)} {who}, {where}: {_size(limit)}"


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


# -- is each transport right? -----------------------------------------------------------
def check_transport(fn, reference, x, codec) -> tuple[bool, float, float]:
    """(ok, rel_error, bound): fn(x) against reference(x) (lax.psum) on the same input.
    An exact codec must match bit for bit (bound 0). A compressing one quantizes each
    element at most twice, so its error stays near that of one round trip through the
    codec (two-shot: ~1.4 ×): the bound is 3 × the codec's round-trip error on these
    inputs, plus the output dtype's rounding. A misdelivered segment errs by ~1 (one of P
    segments: ~(2/P)^½)."""
    y = np.asarray(fn(x), np.float64)
    ref = np.asarray(reference(x), np.float64)
    if codec.is_identity:
        ok = y.shape == ref.shape and np.array_equal(y, ref)
        return ok, (0.0 if ok else _rel(y, ref)), 0.0
    err = _rel(y, ref)
    # the codec's error on (up to 2^20 values of) one device's input
    sample = jnp.asarray(x.addressable_shards[0].data).reshape(-1)[: 1 << 20]
    trip = np.asarray(jax.jit(codec.roundtrip)(sample), np.float64)   # one compile, not ~40
    bound = 3 * _rel(trip, np.asarray(sample, np.float64)) + 2 * float(jnp.finfo(x.dtype).eps)
    return bool(np.all(np.isfinite(y)) and err <= bound), err, bound


def _rel(a, b) -> float:
    return float(np.linalg.norm((a - b).ravel()) / max(np.linalg.norm(b.ravel()), 1e-30))


# -- measuring ------------------------------------------------------------------------------
def calibrate(mesh, axis_name: str, *, codec: str = "taco", transports=("xla", "fused"),
              sizes_mib=(1, 4, 16, 64, 256, 1024), dtype=jnp.bfloat16, margin: float = 0.97,
              iters: int = 10, repeats: int = 3, batches: int = 3, timer=time_program,
              budget: tuple[int, bool, str] | None = None,
              log: Callable[[str], None] | None = None) -> Calibration:
    """Time lax.psum and taco_jax.psum over each transport that can run here, over
    `axis_name` of `mesh`, at each size (MiB per device, of `dtype`, rounded to whole
    blocks). The data is sharded over `axis_name` and replicated over the mesh's other
    axes. Costs a compile per size and transport (seconds each on GPU): do it once per
    machine, then `save` it.

    Per size, in increasing order: a size whose buffers (`held_bytes`) do not fit `budget`
    is skipped, and so is every larger one; each transport is first checked against
    lax.psum on random inputs (`check_transport`), and one that fails is dropped from every
    row (never cached); then the others are timed.

    Args:
      timer: `timer(calls, x, iters=, repeats=, batches=) -> µs` of a program
        `calls = jit_calls(fn)` on input x, replaceable (tests); default `time_program`.
      budget: (bytes, per_device, where) the measured calls may hold; None:
        `memory_budget(mesh devices)`.
      log: called with one line per size (and per skipped size or rejected transport);
        None: silent.
    """
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
    if min(iters, repeats, batches) < 1:
        raise ValueError(f"calibrate: {iters=}, {repeats=} and {batches=} must be >= 1")
    if not (0 < margin <= 1.5):
        raise ValueError(f"calibrate: margin={margin!r} should be a ratio like 0.97")
    bad = set(transports) - set(TRANSPORTS)
    if bad:
        raise ValueError(f"calibrate: transports {sorted(bad)} not in {TRANSPORTS}")
    say = log or (lambda line: None)
    p = mesh.shape[axis_name]
    key = machine_key(p, getattr(mesh.devices.flat[0], "device_kind", None))
    if p == 1:      # psum over one device is the identity: never worth compressing
        return Calibration(axis_name, c.name, margin, (), NEVER, p, key)
    usable = [t for t in transports
              if t != "fused" or fused.mesh_unavailable_reason(mesh) is None]
    if "fused" in transports and "fused" not in usable:
        say(f"fused transport: not timed here ({fused.mesh_unavailable_reason(mesh)})")
    spec = P(axis_name)
    budget = memory_budget(list(mesh.devices.flat)) if budget is None else budget

    def sharded(fn):   # the sum is replicated: out_specs P()
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=P()))

    reference = sharded(lambda v: lax.psum(v, axis_name))
    taco = {t: sharded(lambda v, t=t: psum(v, axis_name, codec=codec, min_bytes=0,
                                            transport=t)) for t in usable}
    # the programs timed, made once: each size compiles them once (`program_bytes`)
    programs = {"prep": jit_calls(fresh(lambda v: v)), "lax": jit_calls(fresh(reference)),
                **{t: jit_calls(fresh(taco[t])) for t in usable}}
    itemsize = jnp.dtype(dtype).itemsize
    sharding = NamedSharding(mesh, spec)
    host_devices = 0 if budget[1] else mesh.devices.size    # every device holds its copy
    rows, rejected, too_large = [], {}, None
    for k, mib in enumerate(sorted(sizes_mib)):
        per_dev = max(c.block_size, int(mib * 2**20) // itemsize // c.block_size * c.block_size)
        size = per_dev * itemsize / 2**20
        if too_large:        # what a size holds grows with it: no need to compile this one
            say(f"{size:g} MiB/device: skipped, does not fit ({too_large:g} MiB/device did "
                "not)")
            continue
        shape = jax.ShapeDtypeStruct((p * per_dev,), dtype, sharding=sharding)
        arg = (shape, jax.ShapeDtypeStruct((), dtype))
        timed = ["prep", "lax"] + [t for t in usable if t not in rejected]
        need = held_bytes(per_dev * itemsize, itemsize,
                          [program_bytes(programs[n], arg, iters) for n in timed],
                          iters, batches, host_devices)
        ok, why = fits(need, budget, host_devices)
        if not ok:
            say(f"{size:g} MiB/device: skipped, does not fit ({why})")
            too_large = size
            continue
        noise = jax.jit(lambda key: jax.random.normal(key, shape.shape, dtype),
                        out_shardings=sharding)(jax.random.key(k))
        for t in [t for t in usable if t not in rejected]:
            good, err, bound = check_transport(taco[t], reference, noise, c)
            if not good:
                rejected[t] = (f"{t} transport rejected at {size:g} MiB/device: its sum on "
                               f"random inputs differs from lax.psum's (relative error "
                               f"{err:.3g} > {bound:.3g}); not timed and not cached")
                say(rejected[t])
        del noise
        live = [t for t in usable if t not in rejected]
        x = (jax.jit(lambda: jnp.ones(shape.shape, dtype), out_shardings=sharding)(),
             jnp.ones((), dtype))
        prep, *times = [timer(programs[n], x, iters=iters, repeats=repeats, batches=batches)
                        for n in ["prep", "lax"] + live]
        del x
        net = [t - prep for t in times]
        row = {"mib": size, "lax_us": net[0]}
        for t, us in zip(live, net[1:]):
            row[f"{t}_us"] = us
            row[f"{t}_ratio"] = us / net[0] if net[0] > 0 else math.nan
        rows.append(row)
        say(f"{size:g} MiB/device: lax.psum {net[0]:.1f} µs" + "".join(
            f", {t} {row[f'{t}_us']:.1f} µs ({row[f'{t}_ratio']:.3f})" for t in live)
            + f" -> {best_route(row, margin)}")
    for row in rows:      # a transport rejected at any size is trusted at none
        for t in rejected:
            row.pop(f"{t}_us", None)
            row.pop(f"{t}_ratio", None)
    return Calibration(axis_name, c.name, margin, tuple(rows),
                       decide_min_bytes(rows, margin, "xla_ratio"), p, key,
                       tuple(rejected.values()))


def calibrate_min_bytes(mesh, axis_name: str, **kw) -> Calibration:
    """`calibrate` over the xla transport only: its `min_bytes` is the threshold to pass."""
    return calibrate(mesh, axis_name, transports=("xla",), **kw)


def _print(line: str) -> None:
    print(f"[taco_jax.calibrate] {line}", flush=True)


CPU_NOTE = ("these are the CPU backend's timings: the devices are simulated, sharing this "
            "host's cores and memory, so the routes say where compression pays for the CPU "
            "backend on this machine only (a GPU machine's cache entry is keyed apart and "
            "must be measured there)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m taco_jax.calibrate",
                                 description="Time lax.psum against taco_jax.psum per "
                                             "transport and size; write the cache.")
    ap.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    ap.add_argument("--codec", default="taco")
    ap.add_argument("--transports", nargs="+", default=list(TRANSPORTS), choices=TRANSPORTS)
    ap.add_argument("--margin", type=float, default=0.97)
    ap.add_argument("--iters", type=int, default=10, help="calls per timed batch")
    ap.add_argument("--batches", type=int, default=3,
                    help="batches queued back to back per timing (their outputs stay live)")
    ap.add_argument("--repeats", type=int, default=3, help="timings per size (the median)")
    ap.add_argument("--memory-gib", type=float, default=None,
                    help="memory the measured calls may hold (per device with device "
                         "memory statistics, else for all devices); default: the free "
                         f"device memory, else {HOST_SHARE:g} of the host's available memory")
    ap.add_argument("--cache", default=None, help=f"cache file (default ${CACHE_ENV} or "
                                                  f"~/.cache/taco_jax/calibration.json)")
    ap.add_argument("--json", default=None, help="also write this table as JSON here")
    a = ap.parse_args(argv)
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("tp",))
    budget = memory_budget(list(mesh.devices.flat))
    if a.memory_gib is not None:
        budget = (int(a.memory_gib * 2**30), budget[1], "--memory-gib")
    if jax.default_backend() == "cpu":
        _print(CPU_NOTE)
    _print(f"{n} {jax.devices()[0].device_kind} devices, codec {a.codec}, sizes "
           f"{' '.join(f'{s:g}' for s in sorted(a.sizes_mib))} MiB per device; memory: "
           f"{budget[2]}, {budget[0] / 2**30:.2f} GiB")
    cal = calibrate(mesh, "tp", codec=a.codec, transports=a.transports, sizes_mib=a.sizes_mib,
                    margin=a.margin, iters=a.iters, repeats=a.repeats, batches=a.batches,
                    budget=budget, log=_print)
    print(cal.table(), flush=True)
    if not cal.rows:
        _print("no size was measured: nothing cached")
        return 1
    print(f"wrote {save(cal, a.cache)} ({cal.key})", flush=True)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"device": jax.devices()[0].device_kind,
                                            "link": link(), **cal.to_json()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
