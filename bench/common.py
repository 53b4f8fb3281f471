"""Shared helpers for the benchmark programs: environment facts and timing."""
from __future__ import annotations

import json
import os
import subprocess

import jax

# The timers live in taco_jax.tuning. time_loop (a while loop: constant memory, but XLA's
# GPU while loop adds 16–20 µs per trip) serves the collectives and the library's
# calibration, where a psum takes ~1 ms and the cost is the same on both sides of a ratio.
# time_calls (straight-line calls, no loop overhead; memory grows with the number of calls)
# serves the kernel benchmark, whose fractions of the roofline it would otherwise inflate.
from taco_jax.calibrate import time_calls  # noqa: F401


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
