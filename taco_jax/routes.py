"""This machine's measured routes: which of lax.psum and the transports is fastest per size.

`taco_jax.calibrate` measures them (`python -m taco_jax.calibrate`) and `save`s them in a
cache keyed by device kind, device count and link; the collectives `lookup` the entry for
the call at hand at trace time and follow `Calibration.route`. A corrupt cache, or an
entry written for another machine or codec, is reported once and ignored."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
import warnings
from pathlib import Path

import jax

# `Calibration.min_bytes` when compression won at no measured size: larger than any tensor,
# so psum(min_bytes=NEVER) always takes lax.psum
NEVER = 1 << 62
CACHE_ENV = "TACO_JAX_CALIBRATION"      # path of the cache file (default under ~/.cache)
CACHE_VERSION = 1
# How compressed bytes move: XLA's all-to-all / all-gather, or in-kernel stores into the
# peers' memory (`collectives.fused`); a call or recipe may also say "auto" (this cache's
# choice per size, else "xla").
TRANSPORTS = ("xla", "fused")


# -- the machine ------------------------------------------------------------------------
def link() -> str:
    """How this process's devices talk: "cpu", "network" (several processes), "pcie"
    (NCCL's peer-to-peer path disabled) or "nvlink"."""
    if jax.default_backend() != "gpu":
        return "cpu"
    if jax.process_count() > 1:
        return "network"
    if os.environ.get("NCCL_P2P_DISABLE", "0") not in ("", "0"):
        return "pcie"
    return "nvlink"


def machine_key(n_devices: int, device_kind: str | None = None) -> str:
    kind = device_kind or jax.devices()[0].device_kind
    return f"{kind}|{n_devices}|{link()}"


# -- decisions ----------------------------------------------------------------------------
def decide_min_bytes(rows, margin: float, key: str = "ratio") -> int:
    """The smallest measured size (bytes per device) from which the ratio `key` is ≤ margin
    at that size and every larger one; NEVER if the largest size already loses. A win at a
    small size followed by a loss at a larger one is treated as noise: the threshold only
    moves down from the top."""
    best = NEVER
    for r in sorted(rows, key=lambda r: -r["mib"]):
        if not (r.get(key, math.nan) <= margin):           # NaN and missing ratios lose
            break
        best = int(r["mib"] * 2**20)
    return best


def best_route(row: dict, margin: float, available=TRANSPORTS) -> str:
    """"lax", or the transport whose time is lowest, if it beats lax.psum by `margin`."""
    best, t_best = "lax", row["lax_us"] * margin
    for t in available:
        us = row.get(f"{t}_us")
        if us is not None and math.isfinite(us) and us < t_best:
            best, t_best = t, us
    return best


@dataclasses.dataclass(frozen=True)
class Calibration:
    """rows: one dict per size {"mib", "lax_us", "<transport>_us", "<transport>_ratio"}
    (times net of the input's preparation; ratio = transport / lax). min_bytes: the xla
    transport's threshold (NEVER if it won at no size). rejected: why each transport that
    failed its check against lax.psum has no times (it is never routed to)."""
    axis_name: str
    codec: str
    margin: float
    rows: tuple
    min_bytes: int
    n_devices: int = 0
    key: str = ""
    rejected: tuple = ()

    def route(self, nbytes: int, available=TRANSPORTS) -> str:
        """The route for a tensor of nbytes per device: the decision at the largest
        measured size ≤ nbytes ("lax" below the smallest)."""
        below = [r for r in self.rows if r["mib"] * 2**20 <= nbytes]
        if not below:
            return "lax"
        return best_route(max(below, key=lambda r: r["mib"]), self.margin, available)

    def table(self) -> str:
        ts = [t for t in TRANSPORTS if any(f"{t}_us" in r for r in self.rows)]
        head = f"{'MiB/device':>10}  {'lax.psum µs':>11}" + "".join(
            f"  {t + ' µs':>9}  {t + ' ratio':>11}" for t in ts) + "  route"
        lines = [head]
        for r in self.rows:
            lines.append(f"{r['mib']:>10g}  {r['lax_us']:>11.1f}" + "".join(
                f"  {r.get(t + '_us', math.nan):>9.1f}  {r.get(t + '_ratio', math.nan):>11.3f}"
                for t in ts) + f"  {best_route(r, self.margin)}")
        where = ("never (lax.psum at every size)" if self.min_bytes == NEVER
                 else f"from {self.min_bytes / 2**20:g} MiB per device")
        lines.append(f"xla transport ({self.codec}, ratio ≤ {self.margin}): {where}")
        lines += [f"not cached: {why}" for why in self.rejected]
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"version": CACHE_VERSION, "key": self.key, "n_devices": self.n_devices,
                "codec": self.codec, "margin": self.margin, "min_bytes": self.min_bytes,
                "jax": jax.__version__, "rows": list(self.rows),
                "rejected": list(self.rejected)}


# -- the cache ------------------------------------------------------------------------------
def cache_path() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "taco_jax" / \
        "calibration.json"


def save(cal: Calibration, path: str | Path | None = None) -> Path:
    """Add (or replace) this machine's entry in the cache file."""
    path = Path(path) if path else cache_path()
    entries = _read_entries(path, quiet=True) or {}
    entries[f"{cal.key}|{cal.codec}"] = cal.to_json()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"version": CACHE_VERSION, "entries": entries}, indent=1))
    tmp.replace(path)
    _loaded.clear()
    return path


_loaded: dict = {}
_warned: set = set()
_lock = threading.Lock()


def forget() -> None:
    """Forget the calibrations read and the warnings given: the next `lookup` reads the
    cache file again and warns again about what it finds wrong there."""
    _loaded.clear()
    _warned.clear()


def _warn_once(msg: str) -> None:
    with _lock:
        if msg in _warned:
            return
        _warned.add(msg)
    warnings.warn(msg, stacklevel=4)


def _read_entries(path: Path, quiet: bool = False) -> dict | None:
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
            raise ValueError(f"version {data.get('version') if isinstance(data, dict) else '?'}"
                             f", expected {CACHE_VERSION}")
        entries = data["entries"]
        if not isinstance(entries, dict):
            raise ValueError("entries is not a mapping")
        return entries
    except (OSError, ValueError, KeyError, TypeError) as e:
        if not quiet:
            _warn_once(f"taco_jax: ignoring the calibration cache {path}: unreadable ({e}); "
                       f"using the default (xla transport from DEFAULT_MIN_BYTES). "
                       f"Re-run python -m taco_jax.calibrate.")
        return None


def _valid(entry, key: str, codec: str) -> Calibration:
    rows = tuple(entry["rows"])
    for r in rows:
        if not (isinstance(r, dict) and r.get("mib", 0) > 0
                and isinstance(r.get("lax_us"), (int, float))):
            raise ValueError(f"bad row {r!r}")
    if entry.get("key") != key or entry.get("codec") != codec:
        raise ValueError(f"written for {entry.get('key')!r}/{entry.get('codec')!r}")
    return Calibration("", codec, float(entry["margin"]), rows, int(entry["min_bytes"]),
                       int(entry["n_devices"]), key)


def lookup(n_devices: int, codec: str, device_kind: str | None = None) -> Calibration | None:
    """This machine's calibration for `codec` over n_devices, or None (no cache, no entry,
    or an entry that does not validate: reported once)."""
    key = machine_key(n_devices, device_kind)
    path = cache_path()
    memo = (str(path), key, codec)
    if memo in _loaded:
        return _loaded[memo]
    entries = _read_entries(path)
    cal = None
    if entries is not None and f"{key}|{codec}" in entries:
        try:
            cal = _valid(entries[f"{key}|{codec}"], key, codec)
        except (ValueError, KeyError, TypeError) as e:
            _warn_once(f"taco_jax: ignoring the calibration cache entry {key}|{codec} in "
                       f"{path}: {e}")
    _loaded[memo] = cal
    return cal
