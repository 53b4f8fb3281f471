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
            "commit": commit}


def time_loop(fn, x, iters: int = 20, repeats: int = 5) -> float:
    """Median µs per call of fn(x), timed inside one jitted fori_loop so dispatch overhead
    (~100 µs per call) does not hide small kernels. Each iteration writes one element of the
    input from the previous output, so XLA cannot hoist the call out of the loop; the update
    is in place on the carried buffer (a few bytes)."""
    def body(_, carry):
        x, _ = carry
        out = fn(x)
        leaf = jax.tree.leaves(out)[0]
        poke = leaf.reshape(-1)[0].astype(x.dtype) * 0
        idx = (0,) * x.ndim
        x = lax.dynamic_update_slice(x, (x[idx] + poke).reshape((1,) * x.ndim), idx)
        return x, out

    @jax.jit
    def loop(x):
        out0 = jax.eval_shape(fn, x)
        init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out0)
        return lax.fori_loop(0, iters, body, (x, init))

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
