"""Shared helpers for the benchmark programs: environment facts and timing."""
from __future__ import annotations

import glob
import gzip
import hashlib
import json
import os
import re
import subprocess
import tempfile

import jax

# The host timer is the library's (calibration uses it too): calls back to back in
# straight-line code, each on its own input buffer.
from taco_jax.calibrate import host_us, jit_calls, time_calls, warm_calls  # noqa: F401


def load_rows_doc(path: str, what: str, missing: str = "") -> dict:
    """A results JSON with a list of "rows", or SystemExit naming `what` (the program and
    input) and the path: missing (with the `missing` hint), unreadable, or without rows."""
    if not os.path.exists(path):
        raise SystemExit(f"{what} ({path}) is missing{missing}")
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"{what} ({path}) unreadable: {e}")
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
        raise SystemExit(f"{what} ({path}) has no list of rows")
    return doc


def sources_hash() -> str:
    """12 hex digits of sha256 over the taco_jax package's Python sources (paths and
    bytes): two runs with the same hash ran the same library, whatever else the commits
    between them changed (docs, benchmarks, results). (The fused transport's checked table
    is keyed by what the kernels emit instead: `kernels.fused.checked.fingerprint`.)"""
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "taco_jax")
    h = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        h.update(os.path.relpath(path, root).encode() + b"\0")
        with open(path, "rb") as f:
            h.update(f.read() + b"\0")
    return h.hexdigest()[:12]


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
            "commit": commit, "sources": sources_hash(),
            "xla_flags": os.environ.get("XLA_FLAGS", "")}


def write_json(path: str, payload: dict) -> str:
    """Write payload as JSON; returns the path written. A run off the GPU (payload
    "platform" not "gpu") never replaces GPU results: it goes beside them, as
    <name>.<platform>.json."""
    path = str(path)
    platform = payload.get("platform")
    if platform not in (None, "gpu") and os.path.exists(path):
        try:
            with open(path) as f:
                old = json.load(f).get("platform")
        except (OSError, ValueError, AttributeError):
            old = None
        if old == "gpu":
            root, ext = os.path.splitext(path)
            print(f"{path} holds GPU results: this {platform} run goes to "
                  f"{root}.{platform}{ext}")
            path = f"{root}.{platform}{ext}"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    print(f"wrote {path}")
    return path


def child_rows(cmd: list[str], limit: float, cwd) -> tuple[list[dict], str | None]:
    """Run one isolated child under a timeout -> (the `ROW {json}` lines it printed, why it
    failed or None). A hang or a crash costs only that child; what it printed before
    stopping is kept."""
    why = None
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=limit, cwd=cwd)
        text = proc.stdout
        if proc.returncode != 0:
            why = f"exit {proc.returncode}: " + " | ".join(
                text.strip().splitlines()[-3:])[-300:]
    except subprocess.TimeoutExpired as e:
        text = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        why = f"timed out after {limit:.0f} s"
    return [json.loads(ln[4:]) for ln in text.splitlines() if ln.startswith("ROW ")], why


def print_table(rows: list[dict], cols: list[str]) -> None:
    widths = [max(len(c), *(len(f"{r.get(c, '')}") for r in rows)) for c in cols]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(f"{r.get(c, '')}".rjust(w) for c, w in zip(cols, widths)))


# -- device time: the kernels' own durations from a profiler trace --------------------------
def gpu_kernel_events(events: list[dict], device: int = 0) -> list[dict]:
    """Complete ('X') events on the stream threads of '/device:GPU:<device>' in a chrome /
    perfetto trace: one per kernel the device ran (the 'XLA Ops' and step threads repeat
    them at op level and are left out)."""
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e.get("tid"))] = e["args"]["name"]
    pat = re.compile(rf"/device:GPU:{device}(\D|$)")
    pids = {p for p, n in procs.items() if pat.search(n)}
    if not pids:
        raise ValueError(f"no '/device:GPU:{device}' process in the trace; processes: "
                         f"{sorted(set(procs.values()))}")
    streams = {k for k, n in threads.items() if k[0] in pids and n.lower().startswith("stream")}
    # a trace without 'Stream …' threads: the device's events less the op-level threads
    keep = (lambda e: (e["pid"], e.get("tid")) in streams) if streams else \
        (lambda e: e["pid"] in pids and not re.search(r"XLA|Steps|TraceMe",
                                                      threads.get((e["pid"], e.get("tid")), "")))
    return [e for e in events if e.get("ph") == "X" and e.get("dur") is not None and keep(e)]


def read_trace(log_dir: str) -> list[dict]:
    """Events of the trace that jax.profiler.trace(log_dir, create_perfetto_trace=True)
    wrote (perfetto_trace.json.gz, else the trace viewer's *.trace.json.gz)."""
    files = []
    for pattern in ("perfetto_trace.json.gz", "*.trace.json.gz"):
        files = sorted(glob.glob(os.path.join(log_dir, "plugins/profile/*", pattern)),
                       key=os.path.getmtime)
        if files:
            break
    if not files:
        raise FileNotFoundError(f"no *.trace.json.gz under {log_dir}/plugins/profile")
    with gzip.open(files[-1]) as f:
        d = json.load(f)
    return d["traceEvents"] if isinstance(d, dict) else d


def kernel_time(events: list[dict], calls: int, device: int = 0) -> dict:
    """µs per call summed over every kernel of the trace (the program is the only work
    traced), and per kernel name."""
    per_name: dict[str, float] = {}
    for e in gpu_kernel_events(events, device):
        per_name[e["name"]] = per_name.get(e["name"], 0.0) + float(e["dur"])
    if not per_name:
        raise ValueError("no GPU kernels in the trace")
    return {"us": sum(per_name.values()) / calls,
            "kernels": {k: round(v / calls, 3) for k, v in
                        sorted(per_name.items(), key=lambda kv: -kv[1])}}


def device_time(fn, x, iters: int = 10, batches: int = 3, repeats: int = 5,
                trace: bool | None = None) -> dict:
    """fn(x) timed two ways on one compiled program: `iters` copies of x (so a call does
    not find its input in L2) through `jit_calls`. "host_us": the host timer, median over
    `repeats` of `batches` executions queued back to back (as `time_calls`); "us": device
    time, the GPU kernel events of `batches` executions under jax.profiler.trace, summed,
    per call; "kernels": that per kernel name. The host timer adds launch gaps and
    dispatch; device time does not. Where the trace has no GPU, "us" is None and "error"
    says why. `trace` None: trace only where the default backend is a GPU (a trace of a
    CPU run costs about a second and can hold no GPU kernel)."""
    calls, xs = warm_calls(fn, x, iters)
    out = {"host_us": host_us(calls, xs, repeats, batches)}
    if trace is None:
        trace = jax.default_backend() == "gpu"
    if not trace:
        return {**out, "us": None, "error": "no GPU kernels: not traced on the "
                                            f"{jax.default_backend()} backend"}
    with tempfile.TemporaryDirectory(prefix="taco_devtime_") as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            outs = [calls(xs) for _ in range(batches)]
            jax.block_until_ready(outs)
        del outs
        events = read_trace(d)
    try:
        out.update(kernel_time(events, iters * batches))
    except ValueError as e:
        out.update(us=None, error=str(e)[:300])
    return out
