"""What the compressed collectives did: sites, errors, bytes, captured tensors.

`sites()` lists every collective call site traced so far (shape, dtype, axes, codec, bytes
per device, and whether it was compressed or went to lax, with the reason). It is recorded
at trace time, always, at no run-time cost; `site_report()` formats it, `traced_sites(fn,
*args)` returns the sites that one call of fn traced, and each new site is logged once to
the "taco_jax" logger (INFO). The rest is opt-in: off by default and free when off, as the
flag is read when a function is traced.

What a count is: one per trace of the call, in the forward pass. A site inside a loop body
(`lax.scan`, `fori_loop`, `while_loop`) is traced once and runs once per iteration, and
JAX's public API does not tell the collectives how many iterations they are in; declare it
around the loop with `repeated(n)`, which counts each site traced inside n times (a caller
that counts the iterations itself may instead note the other ones with `note_site`, with
the site's own fields, `vma` included). `check_loops(fn, *args)` traces a function once and
warns about the loops that hold collectives and that no site counts per iteration. The
backward halves are not separate sites:
`wire_bytes(site, backward=True)` adds what a site's transpose sends. A site in a
`lax.cond` / `switch` branch counts as if its branch ran. `collect()` (below) records at
run time, once per executed call, loops and branches included.

    with taco_jax.telemetry.collect() as log:
        y = jitted_step(...)          # traced (or re-traced) inside the block
    log.records  # [{"op", "axis", "codec", "rel_error", "wire_bytes", "bf16_bytes", "nonfinite"}]

One record per executed compressed all-reduce ("psum": psum, pvary's backward) and per
compressed send ("ppermute", "all_gather", "psum_scatter", "all_gather_matmul",
"matmul_reduce_scatter", forward and backward), each
against the exact collective in f32: an exact lax.psum (a send: the exact lax collective
and a psum of three scalars) and a host callback.

`capture()` (below) hands the tensors at the all-reduce and send sites themselves to the
host, for the fidelity study (experiments/fidelity.py); same rule: off by default, free when off.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import threading
from typing import Any, Callable

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
    # when compressed: "xla", "fused" (one launch), "fused (separate kernels): <why>",
    # under jax.vmap "fused (loopback)" or "fused (exchange emulated)"
    transport: str = ""
    vma: bool = True     # traced under check_vma=True (False: psum's transpose all-reduces)

    @property
    def bytes_per_device(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    @property
    def encoded(self) -> bool:
        """Codes on the wire: compressed with a codec that is not the identity (a
        collective matmul with codec "none" runs its steps, the values on the wire)."""
        from taco_jax import codecs
        return self.compressed and not codecs.get(self.codec).is_identity

    def describe(self) -> str:
        if self.compressed and not self.encoded:
            route = f"uncompressed, in steps ({self.codec}, {self.transport})"
        else:
            route = (f"compressed ({self.codec}, {self.transport})" if self.compressed
                     else f"plain: {self.reason}")
        axes = ",".join(map(str, self.axes))
        return (f"{self.op}[{axes}] {self.dtype}{list(self.shape)} "
                f"{self.bytes_per_device / 2**20:.3g} MiB: {route}")


_sites: dict = {}          # Site -> times traced
_sites_lock = threading.Lock()


_repeats = threading.local()      # the active `repeated` counts, outermost first


@contextlib.contextmanager
def repeated(times: int, differentiated: bool = True):
    """Sites traced inside the block run `times` times per call of the traced function (a
    loop body: wrap the `lax.scan` / `fori_loop` call). Nested blocks multiply; each one
    declares one loop level.

        with taco_jax.telemetry.repeated(n_layers):
            x, _ = lax.scan(block, x, stacked_params)   # its psums counted n_layers times

    differentiated=False: the block's calls run forward only, whatever differentiates the
    function around it (a pipeline schedule that computes its backward itself, in another
    block): `pvary`'s sites are not counted (their all-reduce runs in the backward), and
    the calls of ops whose transpose sends (ppermute, all_gather, psum_scatter) are
    counted by `undifferentiated(site)` too, so that a step's bytes leave their backward
    out."""
    if isinstance(times, bool) or not isinstance(times, int) or times < 1:
        raise ValueError(f"telemetry.repeated: times={times!r} must be an int >= 1")
    stack = getattr(_repeats, "stack", ())
    forward = getattr(_repeats, "forward_only", False)
    _repeats.stack = stack + (times,)
    _repeats.forward_only = forward or not differentiated
    try:
        yield
    finally:
        _repeats.stack = stack
        _repeats.forward_only = forward


_undiff: dict = {}          # Site -> calls counted in `sites()` that run no backward
BACKWARD_ONLY = ("pvary", "pvary_with_feedback")   # their collective runs in the backward


def undifferentiated(site: Site) -> int:
    """Calls of `site` (among those `sites()` counts) traced in a
    `repeated(..., differentiated=False)` block: their transpose does not run."""
    with _sites_lock:
        return _undiff.get(site, 0)


def note_site(op, shape, dtype, axes, codec: str, reason: str | None, p: int = 1,
              route: str = "lax", vma: bool = True) -> None:
    """Record one traced collective call, counted once times the active `repeated` blocks.
    The collectives call it; so does a caller that counts a loop body's iterations itself,
    noting the other iterations of the body's sites."""
    site = Site(op, tuple(shape), str(np.dtype(dtype)), tuple(map(str, axes)), codec,
                reason is None, reason or "", p, route if reason is None else "", bool(vma))
    times = math.prod(getattr(_repeats, "stack", ()))
    forward_only = getattr(_repeats, "forward_only", False)
    if forward_only and op in BACKWARD_ONLY:
        return              # nothing is sent: the backward that would send does not run
    with _sites_lock:
        new = site not in _sites
        _sites[site] = _sites.get(site, 0) + times
        if forward_only and op in SENDS_BACK:
            _undiff[site] = _undiff.get(site, 0) + times
    if new:
        _log.info("taco_jax site %s", site.describe())


# the primitives a collective traces to (taco_jax's compressed routes move their codes with
# all_to_all / all_gather; the plain route is lax's own)
COLLECTIVE_PRIMITIVES = frozenset({
    "psum", "psum_invariant", "all_gather", "all_gather_invariant", "all_to_all", "ppermute",
    "reduce_scatter", "psum_scatter"})


def _loops_with_collectives(jaxpr, outer=()) -> list[tuple[tuple, frozenset]]:
    """[(loop nest, collective primitives in its body)] for each innermost-to-the-collective
    loop of `jaxpr`: a nest is ((kind, length or None), ...), outermost first."""
    from jax.extend import core as jex_core
    found = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in ("scan", "while"):
            nest = outer + ((("lax.scan", eqn.params["length"]) if name == "scan"
                             else ("lax.while_loop", None)),)
        else:
            nest = outer
        for sub in jex_core.jaxprs_in_params(eqn.params):
            found += _loops_with_collectives(sub, nest)
        if outer and name in COLLECTIVE_PRIMITIVES:
            found.append((outer, frozenset({name})))
    merged: dict = {}
    for nest, prims in found:
        merged[nest] = merged.get(nest, frozenset()) | prims
    return list(merged.items())


def check_loops(fn, *args, **kwargs) -> list[str]:
    """Trace fn(*args, **kwargs) once (`jax.make_jaxpr`, nothing runs) and warn about loop
    bodies whose collectives the sites do not count per iteration: a `lax.scan` (or
    `fori_loop`) of length n whose body holds a collective while no taco_jax site traced by
    fn counts a multiple of n calls, or a `while_loop` whose body holds one while none
    counts more than one. Declare such a loop with `repeated(n)` around it (or note the
    other iterations with `note_site`). Returns the warnings, each also logged (WARNING,
    "taco_jax" logger). Call it once per function (a trainer at start-up, or a test); fn
    must trace afresh (a jitted function traced before is cached: its sites are not seen,
    and no warning is given for its loops)."""
    closed, traced = traced_sites(jax.make_jaxpr(fn), *args, **kwargs)
    counts = [n for _, n in traced]
    if not counts:
        return []
    warned = []
    for nest, prims in _loops_with_collectives(closed.jaxpr):
        lengths = [n for _, n in nest]
        runs = None if None in lengths else math.prod(lengths)
        if (runs is not None and any(c % runs == 0 for c in counts)) or (
                runs is None and any(c > 1 for c in counts)):
            continue
        loops = " > ".join(k if n is None else f"{k}(length={n})" for k, n in nest)
        times = "an unknown number of times" if runs is None else f"{runs} times"
        warned.append(f"taco_jax: a {loops} body holds collectives ({', '.join(sorted(prims))})"
                      f" and runs {times} per call, but no taco_jax site traced here counts "
                      f"{'more than one call' if runs is None else f'a multiple of {runs} calls'}"
                      f": sites() and wire_bytes count its sites once per trace. Declare "
                      f"the loop with taco_jax.telemetry.repeated(n) around it")
    for message in warned:
        _log.warning(message)
    return warned


def sites() -> list[tuple[Site, int]]:
    """[(site, calls)] for every distinct collective call site traced so far: the calls one
    run of the traced functions makes, as far as the trace tells (each trace counts once,
    times its `repeated` blocks)."""
    with _sites_lock:
        return list(_sites.items())


def traced_sites(fn: Callable, *args, **kwargs) -> tuple[Any, list[tuple[Site, int]]]:
    """Call fn(*args, **kwargs) and return (its result, [(site, calls)] of the taco_jax
    collectives that call traced): the difference of `sites()` around it, so sites traced
    earlier in the process (an earlier run, another function) do not count. Empty when fn
    was traced before (a jitted function's cached trace records no site)."""
    before = dict(sites())
    out = fn(*args, **kwargs)
    return out, [(site, n - before.get(site, 0)) for site, n in sites()
                 if n > before.get(site, 0)]


def clear_sites() -> None:
    with _sites_lock:
        _sites.clear()
        _undiff.clear()


def site_report(rows: list[tuple[Site, int]] | None = None) -> str:
    """One line per distinct site: its calls, what it sends, and compressed or plain and
    why. rows: [(site, calls)], e.g. from `traced_sites`; default every site traced so far
    (`sites()`)."""
    rows = sites() if rows is None else rows
    if not rows:
        return "no taco_jax collective traced"
    return "\n".join(f"{n:>4} × {s.describe()}" for s, n in rows)


def wire_bytes(site: Site, backward: bool = False) -> int:
    """Bytes one device sends for one call of this site. Compressed: the two-shot sends
    P − 1 of its P segments in the all-to-all and its own segment to P − 1 peers in the
    all-gather (psum, and pvary's backward); all_gather and psum_scatter are one half each;
    ppermute sends its codes once; all_gather_matmul and matmul_reduce_scatter what
    all_gather and psum_scatter send (with codec "none", their values). Plain: what a ring
    collective sends, (P − 1)/P of the tensor per half; a plain ppermute the tensor.

    backward: also what the call's transpose sends when the function is differentiated (a
    training step): ppermute's reverse send, all_gather's reduce-scatter of the gathered
    cotangent, psum_scatter's all-gather of its part, all through the site's codec;
    all_gather_matmul's second gather of x for dw too (unless its site's transport says
    it kept the gathered x, GATHERED_KEPT); psum's
    all-reduce of the cotangent where it was traced under check_vma=False (or jax.vmap),
    where JAX transposes psum to psum. Under check_vma=True psum's transpose sends nothing
    and pvary counts its one all-reduce, which runs in the backward pass (under
    check_vma=False pvary is the identity both ways and records no site)."""
    from taco_jax import codecs
    p = site.p
    if p <= 1:
        return 0
    n = math.prod(site.shape)
    halves = 2 if site.op in ("psum", "pvary", "psum_with_feedback", "pvary_with_feedback",
                              "allreduce") else 1
    # the transposes send what the forward sends: the reverse permutation the same codes;
    # all_gather ↔ psum_scatter the same segments of n (resp. n/P) values each way
    back = 2 if backward and (site.op in SENDS_BACK or (site.op in PSUM_OPS and not site.vma)
                              ) else 1
    if backward and site.op == "all_gather_matmul" and site.compressed and \
            site.transport != GATHERED_KEPT:
        back = 3
    op = MATMUL_SENDS.get(site.op, site.op)
    # a collective matmul with codec "none" sends the values themselves, as lax's would
    if not site.compressed or (op != site.op and codecs.get(site.codec).is_identity):
        if op == "ppermute":
            return back * site.bytes_per_device
        per_half = site.bytes_per_device * (p - 1)
        return back * halves * (per_half if op == "all_gather" else per_half // p)
    c = codecs.get(site.codec)
    if op == "all_gather":
        return back * (p - 1) * c.wire_bytes(n)
    if op == "ppermute":
        return back * c.wire_bytes(n)
    seg_rows = max(1, -(-n // (p * c.block_size)))
    return back * halves * (p - 1) * seg_rows * c.row_bytes


# all_gather_matmul's transport where its backward keeps the gathered x (no second gather)
GATHERED_KEPT = "xla, gathered x kept"
# the ops whose transpose is a send of its own through the same codec (`wire_bytes`)
SENDS_BACK = ("ppermute", "all_gather", "psum_scatter", "all_gather_matmul",
              "matmul_reduce_scatter")
# the collective matmuls send what their collective sends (their site's shape is the
# communicated tensor: x, resp. x @ w), and each transposes to the other
MATMUL_SENDS = {"all_gather_matmul": "all_gather", "matmul_reduce_scatter": "psum_scatter"}
# ... and those whose transpose is one only under check_vma=False (psum's is psum there)
PSUM_OPS = ("psum", "psum_with_feedback")


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


def report_send(op: str, exact, y, axis, codec, wire_bytes: int, bf16_bytes: int) -> None:
    """Record a send's error (ppermute, all_gather, psum_scatter): ‖y − exact‖ / ‖exact‖
    over every device of the axis (one value per call; devices that receive nothing add
    zeros to both), bytes on the wire per sender and non-finite values received. A send of zeros only, decoded as
    zeros (a pipeline's bubble ticks), records nothing: it has no relative error."""
    log = _state.log
    diff = (y.astype(jnp.float32) - exact).ravel()
    err2, ref2, nonfinite = lax.psum(
        (jnp.sum(diff * diff), jnp.sum(jnp.square(exact.ravel())),
         jnp.sum(~jnp.isfinite(y)).astype(jnp.int32)), axis)
    rel = jnp.sqrt(err2) / jnp.maximum(jnp.sqrt(ref2), 1e-30)
    meta = {"op": op, "axis": str(axis), "codec": codec.name,
            "wire_bytes": int(wire_bytes), "bf16_bytes": int(bf16_bytes)}

    def sink(rel, empty, nonfinite, idx):
        if int(idx) == 0 and not bool(empty):
            log.records.append({**meta, "rel_error": float(rel), "nonfinite": int(nonfinite)})
    jax.debug.callback(sink, rel, (ref2 == 0) & (err2 == 0), nonfinite, lax.axis_index(axis))


# -- tensor capture -------------------------------------------------------------------------
# Hands the real tensors at the all-reduce and ppermute sites to the host, for the fidelity
# study (experiments/fidelity.py, experiments/pp_codecs.py). Off by default and free when
# off: like `collect`, the flag is read at trace time, so programs traced outside the block
# contain no callback.
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
# taco_jax.ppermute (op "ppermute"): "fwd" the tensor each device sends (devices the
# permutation gives no destination included), "bwd" the cotangent of what it received,
# which its reverse send carries back.
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
    """Capture the per-device tensors at the all-reduce and send sites of functions traced
    inside the block. all_devices=False keeps the first device of the axis only (like `report`);
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
