"""What the compressed collectives did: sites, errors, bytes, captured tensors.

`sites()` lists every collective call site traced so far (shape, dtype, axes, codec, bytes
per device, and whether it was compressed or went to lax, with the reason). It is recorded
at trace time, always, at no run-time cost; `site_report()` formats it, and each new site
is logged once to the "taco_jax" logger (INFO). The rest is opt-in: off by default and free
when off, as the flag is read when a function is traced.

    with taco_jax.telemetry.collect() as log:
        y = jitted_step(...)          # traced (or re-traced) inside the block
    log.records  # [{"op", "axis", "codec", "rel_error", "wire_bytes", "bf16_bytes", "nonfinite"}]

Each record costs one exact lax.psum in f32 (to measure the error) and a host callback.

`capture()` (below) hands the tensors at the all-reduce sites themselves to the host, for
the fidelity study (experiments/fidelity.py); same rule: off by default, free when off.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_state = threading.local()
_log = logging.getLogger("taco_jax")


# -- call sites (trace time, always on) -----------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Site:
    op: str
    shape: tuple
    dtype: str
    axes: tuple
    codec: str
    compressed: bool
    reason: str          # why not compressed ("" when compressed)
    p: int = 1           # devices over the axes
    transport: str = ""  # "xla" or "fused" when compressed

    @property
    def bytes_per_device(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    def describe(self) -> str:
        route = (f"compressed ({self.codec}, {self.transport})" if self.compressed
                 else f"plain: {self.reason}")
        axes = ",".join(map(str, self.axes))
        return (f"{self.op}[{axes}] {self.dtype}{list(self.shape)} "
                f"{self.bytes_per_device / 2**20:.3g} MiB: {route}")


_sites: dict = {}          # Site -> times traced
_sites_lock = threading.Lock()


def note_site(op, shape, dtype, axes, codec: str, reason: str | None, p: int = 1,
              route: str = "lax") -> None:
    """Record one traced collective call (called by the collectives)."""
    site = Site(op, tuple(shape), str(np.dtype(dtype)), tuple(map(str, axes)), codec,
                reason is None, reason or "", p, route if reason is None else "")
    with _sites_lock:
        new = site not in _sites
        _sites[site] = _sites.get(site, 0) + 1
    if new:
        _log.info("taco_jax site %s", site.describe())


def sites() -> list[tuple[Site, int]]:
    """[(site, times traced)] for every distinct collective call site traced so far."""
    with _sites_lock:
        return list(_sites.items())


def clear_sites() -> None:
    with _sites_lock:
        _sites.clear()


def site_report() -> str:
    """One line per distinct site: what it sends, and compressed or plain and why."""
    rows = sites()
    if not rows:
        return "no taco_jax collective traced"
    return "\n".join(f"{n:>4} × {s.describe()}" for s, n in rows)


def wire_bytes(site: Site) -> int:
    """Bytes one device sends for one call of this site. Compressed: the two-shot sends
    P − 1 of its P segments in the all-to-all and its own segment to P − 1 peers in the
    all-gather (psum, and pvary's backward); all_gather and psum_scatter are one half each.
    Plain: what a ring collective sends, (P − 1)/P of the tensor per half."""
    from taco_jax import codecs
    p = site.p
    if p <= 1:
        return 0
    n = math.prod(site.shape)
    halves = 2 if site.op in ("psum", "pvary", "psum_with_feedback", "pvary_with_feedback",
                              "allreduce") else 1
    if not site.compressed:
        if site.op == "ppermute":
            return site.bytes_per_device
        per_half = site.bytes_per_device * (p - 1)
        return halves * (per_half if site.op == "all_gather" else per_half // p)
    c = codecs.get(site.codec)
    if site.op == "all_gather":
        return (p - 1) * c.wire_bytes(n)
    if site.op == "ppermute":
        return c.wire_bytes(n)
    seg_rows = max(1, -(-n // (p * c.block_size)))
    return halves * (p - 1) * seg_rows * c.row_bytes


# -- per-call error records (opt-in) ---------------------------------------------------------


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


# -- tensor capture -------------------------------------------------------------------------
# Hands the real tensors at the all-reduce sites to the host, for the fidelity study
# (experiments/fidelity.py). Off by default and free when off: like `collect`, the flag is read at
# trace time, so programs traced outside the block contain no callback.
#
#     with taco_jax.telemetry.capture() as cap:
#         jax.jit(loss_and_grad)(params, x, y)    # traced inside the block
#     jax.effects_barrier()
#     cap.records  # [{"kind": "fwd"|"bwd", "site", "call", "op", "axis", "device", "value"}]
#
# Trace a fresh function inside the block (a new jax.jit / shard_map closure): JAX caches
# traces by function identity, and a cached trace from outside the block has no callbacks.
# Sites: "fwd" is the input of every taco_jax.psum (this device's partial sum, before any
# quantization); "bwd" is the cotangent whose all-reduce is psum's or pvary's backward
# (check_vma=True: the cotangent reaching pvary; check_vma=False: the one reaching psum).
# Captured whatever the route (compressed two-shot or lax.psum below min_bytes, any codec):
# the tensor is the one the all-reduce sums, so any codec can be evaluated on it offline.


@dataclasses.dataclass
class Capture:
    all_devices: bool = False
    records: list = dataclasses.field(default_factory=list)
    _sites: dict = dataclasses.field(default_factory=dict)    # kind -> sites traced so far
    _calls: dict = dataclasses.field(default_factory=dict)    # (kind, site, device) -> runs
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def by_kind(self, kind: str) -> list:
        return [r for r in self.records if r["kind"] == kind]


_capture_state = threading.local()


def capturing() -> bool:
    return getattr(_capture_state, "cap", None) is not None


@contextlib.contextmanager
def capture(all_devices: bool = False):
    """Capture the per-device tensors at the all-reduce sites of functions traced inside the
    block. all_devices=False keeps the first device of the axis only (like `report`);
    True keeps every device's tensor (record["device"] = index along the axis). With other
    mesh axes (data parallelism) each replica along them sends its own record."""
    old = getattr(_capture_state, "cap", None)
    _capture_state.cap = Capture(all_devices=all_devices)
    try:
        yield _capture_state.cap
    finally:
        _capture_state.cap = old


def capture_value(kind: str, op: str, x, axis) -> None:
    """Trace-time: add a host callback handing `x` (this device's tensor) to the capture."""
    cap = _capture_state.cap
    with cap._lock:
        site = cap._sites.get(kind, 0)
        cap._sites[kind] = site + 1
    meta = {"kind": kind, "site": site, "op": op, "axis": str(axis)}

    def sink(value, idx):
        idx = int(idx)
        if idx != 0 and not cap.all_devices:
            return
        with cap._lock:
            key = (kind, site, idx)
            call = cap._calls.get(key, 0)
            cap._calls[key] = call + 1
            cap.records.append({**meta, "call": call, "device": idx,
                                "value": np.array(value, copy=True)})
    jax.debug.callback(sink, x, lax.axis_index(axis))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def capture_cotangent(x, op: str, axis):
    """Identity; its backward captures the cotangent (kind "bwd") and passes it on."""
    return x


def _cc_fwd(x, op, axis):
    return x, None


def _cc_bwd(op, axis, _, g):
    capture_value("bwd", op, g, axis)
    return (g,)


capture_cotangent.defvjp(_cc_fwd, _cc_bwd)
