"""Shared helpers for the benchmark programs: environment facts and timing."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp
from jax import lax


def env_facts() -> dict:
    commit = os.environ.get("GIT_COMMIT")       # the device machine's copy has no usable git
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--verify", "HEAD"], text=True,
                                    capture_output=True, cwd=os.path.dirname(__file__)
                                    ).stdout.strip() or None
        except OSError:
            commit = None
    dev = jax.devices()[0]
    return {"device": getattr(dev, "device_kind", dev.platform), "platform": dev.platform,
            "n_devices": jax.device_count(), "jax": jax.__version__,
            "commit": commit, "xla_flags": os.environ.get("XLA_FLAGS", "")}


def _zeros_like(s):
    """Zeros for a ShapeDtypeStruct, with its sharding type (explicit-sharding meshes)."""
    return jnp.zeros(s.shape, s.dtype, out_sharding=jax.typeof(s).sharding)


def jit_loop(fn, x, iters: int):
    """jit(x -> fn applied `iters` times in one fori_loop). An optimization barrier ties
    the input to the loop index, so XLA cannot hoist the loop-invariant call out of the
    loop, without touching the data."""
    @jax.jit
    def loop(x):
        def body(i, carry):
            xi, _ = lax.optimization_barrier((x, i))
            return carry[0] + 1, fn(xi)
        out0 = jax.eval_shape(fn, x)
        init = jax.tree.map(_zeros_like, out0)
        return lax.fori_loop(0, iters, body, (0, init))
    return loop


def time_loop(fn, x, iters: int = 20, repeats: int = 5) -> float:
    """Median µs per call of fn(x), timed inside one jitted loop (`jit_loop`) so dispatch
    overhead (~100 µs per call) does not hide small kernels."""
    loop = jit_loop(fn, x, iters)
    jax.block_until_ready(loop(x))                      # compile + warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(x))
        times.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(times)


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    print(f"wrote {path}")


def print_table(rows: list[dict], cols: list[str]) -> None:
    widths = [max(len(c), *(len(f"{r.get(c, '')}") for r in rows)) for c in cols]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(f"{r.get(c, '')}".rjust(w) for c, w in zip(cols, widths)))
