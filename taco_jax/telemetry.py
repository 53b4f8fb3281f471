"""Opt-in telemetry for compressed collectives. Off by default and free when off: the flag
is read when a function is traced, so nothing is added to programs traced while it is off.

    with taco_jax.telemetry.collect() as log:
        y = jitted_step(...)          # traced (or re-traced) inside the block
    log.records  # [{"op", "axis", "codec", "rel_error", "wire_bytes", "bf16_bytes", "nonfinite"}]

Each record costs one exact lax.psum in f32 (to measure the error) and a host callback.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading

import jax
import jax.numpy as jnp
from jax import lax

_state = threading.local()


@dataclasses.dataclass
class Log:
    records: list = dataclasses.field(default_factory=list)


def enabled() -> bool:
    return getattr(_state, "log", None) is not None


@contextlib.contextmanager
def collect():
    old = getattr(_state, "log", None)
    _state.log = Log()
    try:
        yield _state.log
    finally:
        _state.log = old


def report(op: str, x, y, axis, codec, wire_bytes: int) -> None:
    """Record error vs the exact fp32 psum, bytes on the wire and non-finite count."""
    log = _state.log
    exact = lax.psum(x.astype(jnp.float32), axis)
    err = jnp.linalg.norm((y.astype(jnp.float32) - exact).ravel())
    rel = err / jnp.maximum(jnp.linalg.norm(exact.ravel()), 1e-30)
    nonfinite = jnp.sum(~jnp.isfinite(y))
    meta = {"op": op, "axis": str(axis), "codec": codec.name,
            "wire_bytes": int(wire_bytes), "bf16_bytes": int(2 * 2 * x.size)}

    def sink(rel, nonfinite, idx):
        if int(idx) == 0:       # one record per call, from the first device of the axis
            log.records.append({**meta, "rel_error": float(rel), "nonfinite": int(nonfinite)})
    jax.debug.callback(sink, rel, nonfinite, lax.axis_index(axis))
