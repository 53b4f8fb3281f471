"""Shared helpers for the benchmark programs: environment facts and timing."""
from __future__ import annotations

import json
import os
import subprocess

import jax

# The host timer is the library's (calibration uses it too): calls back to back in
# straight-line code, each on its own input buffer.
from taco_jax.calibrate import time_calls  # noqa: F401


def env_facts() -> dict:
    commit = os.environ.get("GIT_COMMIT")       # a copied tree on a GPU machine has no git
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
