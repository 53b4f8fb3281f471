"""The fused all-reduce kernel on one GPU, through a loopback: checks, device time, and a
projection for two GPUs.

    python -m bench.fused [--p 2 4 8] [--sizes 1KiB 1MiB+5 16MiB ...] [--dtypes bf16 f32 f16]
                          [--codec taco|echo4] [--time] [--out bench/results/fused_loopback.json]
                          [--update [--missing]] [--kernel two_shot] [--ablate [--variants ...]]
                          [--fail-fast]
    python -m bench.fused --write-checked

P virtual devices are P groups of programs of the one-launch kernel
(`kernels.fused.one_shot_loopback`): the kernel body, tile math and protocol of
the two-GPU kernel, with a peer's receive buffer a slice of one buffer. Each configuration
(P, size, dtype) runs in its own subprocess under a timeout (a hang costs only itself;
`--isolate group` shares one process per (P, dtype) to save start-ups) and
makes `--calls` back-to-back calls, each on fresh random inputs with a NaN block and an Inf
block (from 8 blocks up), and checks every call:

  * same_on_every_device: the P results are the same bits;
  * the non-finite blocks, and only they, are NaN, as the xla transport's;
  * rel_err (vs the exact f32 sum of the inputs, finite blocks) ≤ xla_rel_err: the xla
    transport (`taco_jax.psum(transport="xla")` under `jax.vmap` with the same P) on the
    same input.

Any failure, timeout or crash: the program exits non-zero with a one-line reason (the
first), after writing what it measured; a row failed on its error lists the kernel tiles
whose error exceeds the gate's most (`worst_tiles`: tile, two-shot segment, tile within it). With --time, per configuration: the loopback's
device time, per virtual device, beside the Triton compress + decode_sum device time of
one device at that size ("separate"), and at P = 2 a projection for two GPUs (labelled
as one): fixed + max(per-device compute, wire bytes / link bandwidth), divided by the
2×H200 lax.psum of bench/results/collectives.json. The same kind of projection for the xla
transport (its kernels' device times plus the all-to-all and all-gather at the link rate,
in series) is set beside what two GPUs measured for it there ("method_check").

`--kernel two_shot` checks the one-launch two-shot kernel (`two_shot_loopback`, P ≥ 3;
rows "one_launch_two_shot") the same way, its error gated on its jnp reference's
(`two_shot_reference`: the same segments and owners) within TWO_SHOT_SLACK, the xla
transport's reported beside it. `--fail-fast` runs nothing more after a hang or crash.
`--update` keeps the --out file's rows of what this run does not measure (another codec,
kernel, P, size, dtype or config), so one file holds both codecs' rows; every row names its
codec, commit and library sources hash, and a loopback check row at the default launch the
fingerprint of the module it ran (`kernels.fused.checked.fingerprint`); `--missing` runs only
what has no passing row at the current fingerprint.

`--write-checked` runs nothing: it writes the fused transport's checked table
(taco_jax/kernels/fused/checked.py) from the loopback check rows of bench/results/fused*.json
and of the row-parallel GEMMs' bench/results/gemm_codec_checks*.json (`python -m
bench.gemm_codec`) whose fingerprints are the modules this checkout emits (`check_rows`,
`checked_table`): the collectives select a one-launch kernel (or GEMM) for a codec and
dtype only where those pass.

`--ablate` times the one-shot kernel's VARIANTS side by side (P = 2, bf16, 16/64/256 MiB
by default): measurement knobs (`FusedConfig.ablate`: a stage left out or done twice;
timed, not checked, as their results are wrong on purpose) and the launch shape's levers
(checked), then prints each variant's per-device time and its difference to the `--base`
variant's ("ablation" in the JSON).

On CPU (tests) `--impl emulated` stands a jnp model of the kernel's exchange in for the
kernel, and `--wrong-exchange slot|stale` breaks that exchange, so the checks can be seen
failing; times there are the host timer's (rows "timer": "host").
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import glob
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import child_rows, env_facts, print_table, write_json

MIB = 1 << 20
DEFAULT_SIZES = ["1KiB", "1MiB+5", "16MiB", "64MiB", "256MiB", "1024MiB"]
DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32, "f16": jnp.float16}
LINK_GBPS = 350.0            # 2×H200 NVLink, per direction, as lax.psum's wire rate allows
FIXED_US = 15.0              # launch, XLA's barrier and the last signal's round trip
# What lax.psum and the xla transport's NCCL calls reached on 2×H200 (256 MiB: 1077 µs for
# 256 MiB each way; profile_psum.json: 554 µs for 2 × 69 MB): the projection at this rate too.
MEASURED_GBPS = 250.0
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLLECTIVES = os.path.join(ROOT, "bench", "results", "collectives.json")


def parse_size(text: str) -> int:
    """'1KiB', '16MiB', '1MiB+5', '4096' → bytes."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(KiB|MiB|GiB)?(?:\+(\d+))?", text)
    if not m:
        raise argparse.ArgumentTypeError(f"size {text!r}: expected e.g. 1KiB, 16MiB, 1MiB+5")
    unit = {"KiB": 1 << 10, "MiB": MIB, "GiB": 1 << 30, None: 1}[m.group(2)]
    return int(float(m.group(1)) * unit) + int(m.group(3) or 0)


# -- implementations --------------------------------------------------------------------
def emulated_loopback(xs, codec, wrong: str | None = None):
    """The kernel's protocol in jnp: every device encodes, its wire reaches slot `me` of
    every device's receive buffer, each device decodes its P slots in order. wrong="slot":
    the last device finds its own wire in slot 0 (a store to the wrong place); "stale":
    slot P − 1 holds, on every device, the wire of other values of the same scale (what a
    receive buffer keeps from an earlier call when a store never lands)."""
    from taco_jax import codecs
    from taco_jax.kernels import references, tile_codec
    p = xs.shape[0]
    encoded = tile_codec.for_codec(codec).encoded    # what the kernel encodes of v
    enc = lambda v: codec.compress_reference(    # noqa: E731
        codecs.to_blocks(encoded(v), codec.block_size))
    wires = [enc(xs[j]) for j in range(p)]
    out = []
    for d in range(p):
        recv = list(wires)
        if wrong == "slot" and d == p - 1:
            recv[0] = wires[d]
        if wrong == "stale":
            recv[p - 1] = enc(xs[p - 1][::-1])
        y = references.decode_sum_reference(jnp.stack(recv), codec, xs.dtype)
        out.append(codecs.from_blocks(y, xs.shape[1:]))
    return jnp.stack(out)


def _mesh(p: int):
    """Devices 0..P−1 on one axis; Auto (not Explicit) so the checks can index the result."""
    return jax.make_mesh((p,), ("tp",), (jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:p])


def on_mesh(p: int, codec):
    """taco_jax.psum(transport="fused") over P GPUs of this process: xs (P, n), row d on
    device d → (P, n), row d what device d computed."""
    import taco_jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = _mesh(p)

    def body(v):
        return taco_jax.psum(v[0], "tp", min_bytes=0, transport="fused", codec=codec)[None]
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"),
                              check_vma=False))
    return lambda xs: f(jax.device_put(xs, NamedSharding(mesh, P("tp"))))


def fused_config(pairs, codec=None, p: int = 2, dtype=None, kernel: str = "one_shot"):
    """["decode=sum_first", "programs=32"] → kernels.fused.FusedConfig: those
    fields over the kernel's own default for this call (`kernels.fused.default_config`;
    the two-shot's: `two_shot_config`); none → None (the kernel's default, as the collectives
    call it)."""
    from taco_jax.kernels import fused as fused_kernels
    fields = {f.name: f.type for f in dataclasses.fields(fused_kernels.FusedConfig)}
    kw = {}
    for item in pairs or ():
        key, _, value = item.partition("=")
        if key not in fields:
            raise SystemExit(f"bench.fused: --config {item!r}: not a FusedConfig field "
                             f"({', '.join(fields)})")
        ftype = str(fields[key])
        if "bool" in ftype:
            if value not in ("0", "1", "true", "false", "True", "False"):
                raise SystemExit(f"bench.fused: --config {item!r}: {key} takes true or false")
            kw[key] = value in ("1", "true", "True")
        else:
            kw[key] = value if "str" in ftype else int(value)
    if not kw:
        return None
    if codec is None:
        base = fused_kernels.FusedConfig()
    elif kernel == "one_shot":
        base = fused_kernels.default_config(codec, p, dtype)
    else:
        base = fused_kernels.two_shot_config(codec, dtype)
    try:
        return dataclasses.replace(base, **kw)
    except ValueError as e:
        raise SystemExit(f"bench.fused: --config {' '.join(pairs)} at P={p}: {e}") from None


def emulated_two_shot(xs, codec, wrong: str | None = None):
    """The two-shot kernel's result on every device, from its jnp reference
    (`kernels.fused.two_shot_reference`). wrong="slot": the last device decodes
    sums built with device 0's data in place of its own (a store to the wrong place);
    "stale": every device's sums hold other values of the same scale in place of the last
    device's data (a store that never landed)."""
    from taco_jax.kernels import fused as fused_kernels
    p = xs.shape[0]
    y = fused_kernels.two_shot_reference(xs, codec)
    out = [y] * p
    if wrong == "slot":
        out[p - 1] = fused_kernels.two_shot_reference(xs.at[p - 1].set(xs[0]), codec)
    if wrong == "stale":
        out = [fused_kernels.two_shot_reference(xs.at[p - 1].set(xs[p - 1][::-1]),
                                                 codec)] * p
    return jnp.stack(out)


def implementation(name: str, codec, wrong: str | None, p: int, config=None,
                   kernel: str = "one_shot", dtype=jnp.bfloat16):
    """The all-reduce under test: (P, n) → (P, n), row d what device d computed."""
    if name == "kernel":
        from taco_jax.kernels import fused as fused_kernels
        fused_config(config, codec, p, dtype, kernel)   # a bad --config fails here, not traced
        fn = {"one_shot": fused_kernels.one_shot_loopback,
              "two_shot": fused_kernels.two_shot_loopback}[kernel]
        return jax.jit(lambda xs: fn(xs, codec, fused_config(config, codec, p, xs.dtype,
                                                             kernel)))
    if name == "mesh":
        return on_mesh(p, codec)
    model = {"one_shot": emulated_loopback, "two_shot": emulated_two_shot}[kernel]
    return jax.jit(lambda xs: model(xs, codec, wrong))


def xla_transport(p: int, codec=None):
    """taco_jax.psum(transport="xla") with `codec` (None: the default) under jax.vmap."""
    import taco_jax
    return jax.jit(jax.vmap(lambda v: taco_jax.psum(v, "tp", codec=codec, min_bytes=0,
                                                    transport="xla"), axis_name="tp"))


# -- one configuration (the child process) ----------------------------------------------
def make_input(key, p: int, n: int, dtype, block: int):
    """(P, n) normal values with per-device scales; from 8 blocks up, device 0 has a NaN in
    block 1 and device P − 1 an Inf in block n_blocks // 2."""
    k1, k2 = jax.random.split(key)
    scale = jnp.exp(jax.random.normal(k2, (p, 1)))
    xs = (jax.random.normal(k1, (p, n), jnp.float32) * scale).astype(dtype)
    bad = []
    if n >= 8 * block:
        b_nan, b_inf = 1, (n // block) // 2
        xs = xs.at[0, b_nan * block + 3].set(jnp.nan)
        xs = xs.at[p - 1, b_inf * block + 7].set(jnp.inf)
        bad = [b_nan, b_inf]
    return xs, bad


@jax.jit
def _same_bits(y):
    u = jax.lax.bitcast_convert_type(y, jnp.uint16 if y.dtype.itemsize == 2 else jnp.uint32)
    return jnp.all(u == u[:1])


@jax.jit
def _rel_err(y, exact, finite):
    d = jnp.where(finite, y.astype(jnp.float32) - exact, 0.0)
    e = jnp.where(finite, exact, 0.0)
    return jnp.sqrt(jnp.sum(d * d)) / jnp.sqrt(jnp.sum(e * e))


# The two-shot kernel's error is gated on its jnp reference's (the same segments, owners
# and sum order: `kernels.fused.two_shot_reference`) on the same input, within
# this factor (the encoders differ in rounding); the xla transport's is reported beside it
# (its segments are whole blocks, not whole tiles, so on small inputs its owners differ).
TWO_SHOT_SLACK = 1.05


def check_call(fn, ref, xs, bad, block, model=None, slack: float = 1.0):
    """One call's checks → (dict of figures, failure reason or None). The error must be
    at most slack × that of `model` (xs → the (n,) result every device should get; None:
    the xla transport `ref`)."""
    y = fn(xs)
    same = bool(_same_bits(y))
    y_xla = ref(xs)
    exact = jnp.sum(xs.astype(jnp.float32), axis=0)
    n = xs.shape[1]
    blk = jnp.arange(n) // block
    want_nan = jnp.isin(blk, jnp.asarray(bad, jnp.int32)) if bad else jnp.zeros(n, bool)
    nan_ok = bool(jnp.array_equal(jnp.isnan(y[0]), want_nan))
    xla_nan_ok = bool(jnp.array_equal(jnp.isnan(y_xla[0]), want_nan))
    finite = ~want_nan
    rel = float(_rel_err(y[0], exact, finite))
    xla_rel = float(_rel_err(y_xla[0], exact, finite))
    figures = {"same_on_every_device": same, "nan_blocks_ok": nan_ok,
               "rel_err": rel, "xla_rel_err": xla_rel}
    gate, gate_name = xla_rel, "the xla transport's"
    if model is not None:
        gate = figures["reference_rel_err"] = float(_rel_err(model(xs), exact, finite))
        gate_name = "its reference's"
    why = None
    if not same:
        why = "results differ between virtual devices"
    elif not nan_ok:
        why = "NaN where the input was finite, or a non-finite block not NaN"
    elif not xla_nan_ok:
        why = "the xla transport's NaN blocks are not the non-finite ones (reference broken)"
    elif not rel <= slack * gate:        # also catches NaN
        why = (f"rel_err {rel:.4g} > {gate_name} {gate:.4g}"
               + (f" × {slack}" if slack != 1.0 else ""))
        gold = model(xs) if model is not None else y_xla[0]
        figures["worst_tiles"] = worst_tiles(y[0], gold, exact, finite, xs.shape[0])
    return figures, why


TILE = 64 * 256          # values per kernel tile (kernels.fused: ROWS × BLOCK)


def worst_tiles(y, gold, exact, finite, p: int, k: int = 8) -> list[dict]:
    """Where a result's error comes from, for a failed check: the k kernel tiles whose
    error against the exact sum exceeds the gate's (`gold`: the reference or the xla
    transport) the most, each with its segment and tile within it for the two-shot's P
    segments of whole tiles (a wrong slot, owner or program shows as a pattern)."""
    d = np.asarray(jnp.where(finite, y.astype(jnp.float32) - exact, 0.0))
    g = np.asarray(jnp.where(finite, gold.astype(jnp.float32) - exact, 0.0))
    n_tiles = -(-d.size // TILE)
    pad = n_tiles * TILE - d.size
    e = np.sqrt(np.nansum(np.pad(d, (0, pad)).reshape(n_tiles, TILE) ** 2, axis=1))
    eg = np.sqrt(np.sum(np.pad(g, (0, pad)).reshape(n_tiles, TILE) ** 2, axis=1))
    seg_tiles = -(-n_tiles // p)
    order = np.argsort(-(e - eg))[:k]
    return [{"tile": int(t), "segment": int(t // seg_tiles), "in_segment": int(t % seg_tiles),
             "err": float(e[t]), "gate_err": float(eg[t])} for t in order if e[t] > eg[t]]


def read_rows(path: str) -> dict | None:
    """--update, --missing: the --out file as it is now (None: missing or unreadable);
    read under `locked`, so never half-written by a run beside this one."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def locked(path: str):
    """An exclusive lock beside `path` (path + ".lock") while its rows are read and
    written, so that --update runs side by side (other codecs, dtypes or P) merge into one
    file instead of the last writer's rows replacing the others'."""
    with open(path + ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def row_label(impl: str, kernel: str = "one_shot") -> str:
    """A row's "kernel": what ran ("one_launch": the one-shot loopback on one GPU, "one_launch
    on GPUs": the collectives over P GPUs, "emulated": the jnp model), "_two_shot" added
    for the two-shot kernel."""
    label = {"kernel": "one_launch", "mesh": "one_launch on GPUs"}.get(impl, "emulated")
    return label + "_two_shot" if kernel == "two_shot" else label


def row_key(r: dict) -> tuple:
    """(P, bytes, dtype name): what a row measured."""
    dt = DTYPES.get(r.get("dtype"))
    return r.get("p"), r.get("bytes"), jnp.dtype(dt).name if dt is not None else None


def kept_rows(old: dict | None, codec: str, measured: set, config: str,
              label: str | None = None) -> list[dict]:
    """--update: the rows of the earlier file `old` that this run has not measured again:
    another codec (a row without one is the file's codec's), another --config, another
    kernel (`row_label`; label None: any), or a `row_key` outside `measured` (what the run
    has measured so far, so a run cut short keeps the earlier rows of what it did not
    reach)."""
    out = []
    for r in (old or {}).get("rows", []):
        r = {**r, "codec": r.get("codec", old.get("codec")),
             "commit": r.get("commit", old.get("commit"))}
        if r["codec"] != codec or r.get("config", "default") != config or \
                row_key(r) not in measured or \
                label is not None and r.get("kernel", label) != label:
            out.append(r)
    return out


def passed_rows(old: dict | None, codec: str, config: str, fingerprints: dict,
                calls: int, label: str | None = None) -> set:
    """--missing: the `row_key`s of `old`'s rows of this codec, config and kernel
    (`row_label`; None: any) that passed their checks on at least `calls` calls at the
    fingerprint that `fingerprints` gives for their (P, dtype name) (`row_fingerprint`;
    None, for what has none, matches a row without one)."""
    return {row_key(r) for r in (old or {}).get("rows", [])
            if r.get("codec", old.get("codec")) == codec and r.get("ok") and
            r.get("config", "default") == config and
            r.get("fingerprint") == fingerprints.get((r.get("p"), r.get("dtype"))) and
            (label is None or r.get("kernel") == label) and
            r.get("calls", 0) >= max(calls, 1)}


def row_fingerprint(impl: str, kernel: str, codec, p: int, dtype: str,
                    config=None) -> str | None:
    """The fingerprint of the module a loopback check row runs (`kernels.fused.checked.
    fingerprint`; dtype a name of DTYPES): for the kernel on a GPU (--impl kernel) at its
    default launch; None for anything else (a --config, the mesh, the jnp model)."""
    if impl != "kernel" or config:
        return None
    from taco_jax.kernels.fused import checked
    return checked.fingerprint(kernel, codec, DTYPES[dtype], p)


def run_config(a) -> dict:
    from taco_jax import codecs
    codec = codecs.get(a.codec)
    p, nbytes, dtype = a.one_p, a.one_bytes, DTYPES[a.one_dtype]
    n = max(1, nbytes // jnp.dtype(dtype).itemsize)
    kernel = getattr(a, "kernel", "one_shot")
    two = kernel == "two_shot"
    fn = implementation(a.impl, codec, a.wrong_exchange, p, a.config, kernel, dtype)
    ref = xla_transport(p, codec)
    model = None
    if two:
        from taco_jax.kernels import fused as fused_kernels
        model = jax.jit(lambda xs: fused_kernels.two_shot_reference(xs, codec))
    row = {"p": p, "mib": round(nbytes / MIB, 6), "bytes": nbytes, "dtype": a.one_dtype,
           "config": " ".join(a.config or ()) or "default",
           "variant": getattr(a, "variant", None) or "default",
           "kernel": row_label(a.impl, kernel)}
    # a measurement knob makes the results wrong on purpose: such a variant is timed only
    checked = getattr(fused_config(a.config, codec, p, dtype, kernel), "ablate",
                      "none") == "none"
    row["checked"] = checked
    fp = row_fingerprint(a.impl, kernel, codec, p, a.one_dtype, a.config) if checked else None
    if fp is not None:
        row["fingerprint"] = fp
    if not checked:
        row.update(ok=True, reason=None, calls=0)
        row.update(time_config(fn, p, n, dtype, codec, separate=None) if a.time else {})
        return row
    worst, why = None, None
    for call in range(a.calls):              # back to back, fresh inputs each time
        xs, bad = make_input(jax.random.key(1000 * p + call), p, n, dtype, codec.block_size)
        figures, why = check_call(fn, ref, xs, bad, codec.block_size, model,
                                  TWO_SHOT_SLACK if two else 1.0)
        if worst is None or figures["rel_err"] > worst["rel_err"] or why:
            worst = figures
        if why:
            why = f"call #{call + 1} of {a.calls}: {why}"
            break
    row.update(worst, calls=a.calls, ok=why is None, reason=why)
    if why is None and a.time:
        row.update(time_mesh(fn, p, n, dtype, codec) if a.impl == "mesh" else
                   time_config(fn, p, n, dtype, codec,
                               separate="two_shot" if two else "one_shot"))
    return row


def time_mesh(fn, p, n, dtype, codec) -> dict:
    """On P GPUs: the fused psum and lax.psum, host timer, on the same sharded input."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from taco_jax.calibrate import time_calls
    mesh = _mesh(p)
    xs, _ = make_input(jax.random.key(7), p, n, dtype, codec.block_size)
    xs = jax.device_put(jnp.nan_to_num(xs), NamedSharding(mesh, P("tp")))
    lax_fn = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "tp"), mesh=mesh,
                                   in_specs=P("tp"), out_specs=P(), check_vma=False))
    iters = 3 if n * jnp.dtype(dtype).itemsize >= 1 << 28 else 10
    fused_us, lax_us = time_calls(fn, xs, iters=iters), time_calls(lax_fn, xs, iters=iters)
    return {"fused_us": round(fused_us, 2), "lax_psum_us": round(lax_us, 2),
            "measured_ratio": round(fused_us / lax_us, 3)}


def _us(t: dict) -> tuple[float, str]:
    """A device_time result → (µs, timer): the device's kernel time, or, where the trace
    has no device (CPU), the host timer's, labelled as such."""
    return (t["us"], "device") if t.get("us") is not None else (t["host_us"], "host")


def time_config(fn, p, n, dtype, codec, separate: str | None = "one_shot") -> dict:
    """Device time of the loopback (all P virtual devices), and (separate) of the
    three-launch path's kernels for one device: "one_shot", Triton compress of its tensor +
    decode_sum of P wires; "two_shot", compress of the P − 1 segments it sends + the owner's
    reduce of P copies of one segment + decompress of the P segments' sums."""
    from bench.common import device_time
    from taco_jax import codecs
    from taco_jax.kernels import references
    xs, _ = make_input(jax.random.key(7), p, n, dtype, codec.block_size)
    iters = 3 if n * jnp.dtype(dtype).itemsize * p >= 1 << 30 else 10
    loop = device_time(fn, xs, iters=iters)
    us, timer = _us(loop)
    out = {"timer": timer, "device_us": round(us, 2), "per_device_us": round(us / p, 2),
           "kernel_us": round(sum(v for k, v in loop.get("kernels", {}).items()
                                  if "fused" in k), 2)}
    if not separate:
        return out
    if separate == "two_shot":
        return {**out, **_two_shot_separate(xs[0], p, dtype, codec, iters)}
    # the codec family's Triton kernels on a GPU; their references elsewhere (CPU tests of
    # this logic)
    gpu = jax.default_backend() == "gpu"
    kernel = codec.kernels.kernel if gpu else None
    enc = ((lambda b: kernel("compress", "triton")(b, codec)) if gpu
           else codec.compress_reference)
    dec = kernel("decode_sum", "triton") if gpu else references.decode_sum_reference
    blocks = codecs.to_blocks(xs[0], codec.block_size)
    comp, _ = _us(device_time(enc, blocks, iters=iters))
    recv = jnp.stack([enc(blocks)] * p)
    dsum, _ = _us(device_time(lambda r: dec(r, codec, dtype), recv, iters=iters))
    out.update(separate_us=round(comp + dsum, 2), compress_us=round(comp, 2),
               decode_sum_us=round(dsum, 2))
    return out


def _two_shot_separate(x, p, dtype, codec, iters) -> dict:
    """The three-launch two-shot's kernels for one device, as the xla transport runs them
    (`kernels.dispatch`: Triton on a GPU, the references elsewhere): compress of the P − 1
    segments it sends, the owner's reduce (P − 1 decoded copies + its exact segment,
    encoded once) and decompress of the P sums."""
    from bench.common import device_time
    from taco_jax import codecs
    from taco_jax.kernels import dispatch
    blocks = codecs.to_blocks(x, codec.block_size)
    seg = blocks.shape[0] // p
    if seg == 0:
        return {}
    blocks = blocks[:seg * p]
    comp, _ = _us(device_time(lambda b: dispatch.compress(b, codec), blocks[seg:],
                              iters=iters))
    wire = dispatch.compress(blocks, codec)
    recv = wire.reshape(p, seg, -1)
    red, _ = _us(device_time(lambda ro: dispatch.reduce(*ro, 0, codec), (recv, blocks[:seg]),
                             iters=iters))
    dec, _ = _us(device_time(lambda w: dispatch.decompress(w, codec, dtype), wire,
                             iters=iters))
    return {"separate_us": round(comp + red + dec, 2), "compress_us": round(comp, 2),
            "reduce_us": round(red, 2), "decompress_us": round(dec, 2)}


# -- projections and their check on what two GPUs measured -----------------------------------
KERNELS = os.path.join(ROOT, "bench", "results", "kernels.json")


def _rows(path, keep):
    try:
        return [r for r in json.load(open(path))["rows"] if keep(r)]
    except (OSError, ValueError, KeyError):
        return []


def lax_psum_us(mib: float) -> float | None:
    """2×H200 lax.psum (bf16) at `mib` MiB per device, bench/results/collectives.json."""
    for r in _rows(COLLECTIVES, lambda r: r.get("codec") == "taco"):
        if abs(r["mib_per_device"] - mib) < 1e-9:
            return r["lax_psum_us"]
    return None


def wire_bytes(nbytes: int, itemsize: int, row_bytes: int, block: int = 256) -> int:
    return -(-(nbytes // itemsize) // block) * row_bytes


def project(row: dict, row_bytes: int, link_gbps: float = LINK_GBPS,
            fixed_us: float = FIXED_US, block: int = 256) -> dict:
    """Two-GPU projections (P = 2) from a timed loopback row: one launch, fixed +
    max(per-device compute, wire / link); three launches (compress, exchange kernel,
    decode_sum in series), fixed + compress + wire / link + decode_sum. Each / lax.psum."""
    if (row.get("p") != 2 or row.get("per_device_us") is None or "compress_us" not in row
            or not row.get("checked", True)):
        return {}
    wire_us = wire_bytes(row["bytes"], jnp.dtype(DTYPES[row["dtype"]]).itemsize,
                         row_bytes, block) / link_gbps / 1e3
    one = fixed_us + max(row["per_device_us"], wire_us)
    three = fixed_us + row["compress_us"] + wire_us + row["decode_sum_us"]
    lax_us = lax_psum_us(row["mib"]) if row["dtype"] == "bf16" else None
    slow = fixed_us + max(row["per_device_us"], wire_us * link_gbps / MEASURED_GBPS)
    return {"wire_us_nvlink": round(wire_us, 2), "projected_us_nvlink": round(one, 2),
            "projected_ratio_at_measured_rate": round(slow / lax_us, 3) if lax_us else None,
            "projected_three_launch_us_nvlink": round(three, 2), "lax_psum_us_2gpu": lax_us,
            "projected_ratio_nvlink": round(one / lax_us, 3) if lax_us else None,
            "projected_three_launch_ratio_nvlink": round(three / lax_us, 3) if lax_us
            else None}


def method_check(row_bytes: int, link_gbps: float = LINK_GBPS,
                 fixed_us: float = FIXED_US) -> list[dict]:
    """The same kind of projection for the xla transport at P = 2, against what two
    H200s measured for it (collectives.json "compressed_us": its compressed path forced):
    its Triton kernels' one-GPU device times (bench/results/kernels.json: compress of the
    half it sends, reduce of the half it owns, decompress of the whole) plus the all-to-all
    and the all-gather, each (P − 1)/P of the wire at the link rate and a fixed cost, in
    series. "fitted_link_gbps": the link rate that would make the projection exact."""
    kern = {(r["kernel"], r["mib"]): r["device_us"]
            for r in _rows(KERNELS, lambda r: r.get("impl") == "triton"
                           and r.get("codec") == "taco")}
    out = []
    for r in _rows(COLLECTIVES, lambda r: r.get("codec") == "taco"):
        mib = r["mib_per_device"]
        if not all((k, mib) in kern for k in ("compress", "reduce", "decompress")):
            continue
        kernels = kern["compress", mib] / 2 + kern["reduce", mib] / 2 + kern["decompress", mib]
        wire = wire_bytes(int(mib * MIB), 2, row_bytes)
        link = 2 * (wire / 2) / link_gbps / 1e3
        proj = 2 * fixed_us + kernels + link
        meas = r["compressed_us"]
        left = meas - 2 * fixed_us - kernels
        out.append({"mib": mib, "xla_kernels_us": round(kernels, 2), "link_us": round(link, 2),
                    "projected_us": round(proj, 2), "measured_2gpu_us": meas,
                    "error": round(proj / meas - 1, 3),
                    "fitted_link_gbps": round(wire / left / 1e3, 1) if left > 0 else None})
    return out


def annotate(payload: dict, row_bytes: int, block: int = 256) -> dict:
    """Derived figures (projections, the method's check) from a payload's measured ones;
    row_bytes, block: the codec's. The method's check is on the xla transport's taco rows
    of two GPUs, so only a codec with taco's blocks (256) gets it. Rows of another codec
    (kept by --update) are left as they are."""
    mine = payload.get("codec")
    rows = [{**r, **project(r, row_bytes, block=block)}
            if r.get("ok") and r.get("codec", mine) == mine else r for r in payload["rows"]]
    return {**payload, "rows": rows,
            "method_check": method_check(row_bytes) if block == 256 else []}


# -- attribution of the kernel's time (--ablate) ------------------------------------------------
# Variants timed side by side: FusedConfig fields of each (over the kernel's default:
# `kernels.fused.default_config`), and what its difference to the default (variant −
# default, per device) estimates. "ablate=…" variants are measurement
# knobs (wrong results, timed only); the others are checked as usual. The most telling
# first, so a run cut short keeps them; a variant that hangs (2 per SM, if its programs are
# not all resident) costs only its own time limit.
# The one-warpgroup kernel (FusedConfig(warp_specialized=False) on two programs per SM, the
# P = 2 default before the warp-specialized one): the base of its stage knobs and levers,
# which the warp-specialized kernel does not take (`--base one_warpgroup` compares to it).
ONE_WG = ["warp_specialized=false", "x_slots=1", "out_store=registers", "per_sm=2"]
VARIANTS = {
    "default": ([], "the kernel as it is"),
    "one_warpgroup": (ONE_WG, "one warpgroup per program, two programs per SM"),
    "no_sync": (ONE_WG + ["ablate=no_sync"], "− signal, wait and the stores' landing wait"),
    "no_signal": (ONE_WG + ["ablate=no_signal"], "− signal and wait on the semaphores"),
    "no_peer_stores": (ONE_WG + ["ablate=no_peer_stores"], "− the P − 1 stores to peers"),
    "no_decode": (ONE_WG + ["ablate=no_decode"], "− the decode (loads kept)"),
    "no_encode": (ONE_WG + ["ablate=no_encode"], "− the encode and its staging"),
    "one_per_sm": (ONE_WG[:1] + ["x_slots=2", "out_store=tma", "per_sm=1"],
                   "double-buffered input, results by TMA, 1 program per SM"),
    "slim": (ONE_WG[:1] + ["x_slots=1", "out_store=registers", "per_sm=1"],
             "half the shared memory, 1 per SM"),
    "per_source": (["decode=per_source"],
                   "each source's accumulator through its own butterfly (not summed first)"),
    "store_at_end": (["store_parts=false"],
                     "every column part stored after the last is summed (finished parts "
                     "held in registers)"),
    "neither": (["store_parts=false", "decode=per_source"],
                "per_source and store_at_end: the decode before the FP8 default"),
    "from_own_slot": (ONE_WG + ["own_from_smem=false"],
                      "one warpgroup, this device's tile stored to its own slot and loaded "
                      "back (not decoded from its staging)"),
    "one_part": (["parts=1"], "the decode in one column pass (not two halves)"),
    "halved_encode": (["encode_parts=2"],
                      "the encode in two column halves (three transforms, half the "
                      "accumulator registers)"),
    "encode_twice": (ONE_WG + ["ablate=encode_twice"], "+ one encode and its staging"),
    "decode_twice": (ONE_WG + ["ablate=decode_twice"], "+ one decode of the P tiles"),
}
ABLATE_SIZES = ["16MiB", "64MiB", "256MiB"]


def ablation_table(rows: list[dict], base_variant: str = "default") -> list[dict]:
    """Timed rows of several variants → one row per (P, dtype, MiB, variant): its
    per-device µs, the difference to the base variant's (µs and fraction of it), the
    separate kernels' µs where measured, and what the difference estimates."""
    key = lambda r: (r["p"], r["dtype"], r["mib"])               # noqa: E731
    base = {key(r): r for r in rows
            if r.get("variant", "default") == base_variant and r.get("per_device_us")}
    out = []
    for r in rows:
        b = base.get(key(r))
        us = r.get("per_device_us")
        entry = {"p": r["p"], "dtype": r["dtype"], "mib": r["mib"],
                 "variant": r.get("variant", "default"), "checked": r.get("checked", True),
                 "ok": r.get("ok"), "per_device_us": us,
                 "estimates": VARIANTS.get(r.get("variant", "default"), ([], ""))[1]}
        if b is not None and us is not None:
            d = us - b["per_device_us"]
            entry.update(delta_us=round(d, 2), delta_frac=round(d / b["per_device_us"], 3))
            if b.get("separate_us"):
                entry["vs_separate"] = round(us / b["separate_us"], 3)
        out.append(entry)
    return out


# -- the fused transport's checked table (--write-checked) -----------------------------------
CHECK_RESULTS = os.path.join(ROOT, "bench", "results", "fused*.json")
# the row-parallel GEMMs' loopback checks (python -m bench.gemm_codec)
GEMM_CHECK_RESULTS = os.path.join(ROOT, "bench", "results", "gemm_codec_checks*.json")
GEMM_KERNEL_OF_EXCHANGE = {"all": "gemm_all", "owner": "gemm_owner"}
CHECKED_PY = os.path.join(ROOT, "taco_jax", "kernels", "fused", "checked.py")
TABLE_MARK = "# -- the table: written by `python -m bench.fused --write-checked`"
KERNEL_OF_LABEL = {"one_launch": "one_shot", "one_launch_two_shot": "two_shot"}


def check_rows(paths=None) -> list[dict]:
    """The loopback checks among the results files (default: bench/results/fused*.json and
    gemm_codec_checks*.json): rows of the one-launch kernels run on a GPU (`row_label`
    "one_launch", "one_launch_two_shot") at their default launch, checked (no measurement
    knob), and of the row-parallel GEMMs (`gemm_check_rows`), each as {kernel, codec,
    dtype (jnp name), p, ok, fingerprint (None: the row has none), file}."""
    if paths is None:
        paths = sorted(glob.glob(CHECK_RESULTS)) + sorted(glob.glob(GEMM_CHECK_RESULTS))
    out = []
    for path in paths:
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            continue
        if not isinstance(doc, dict) or doc.get("platform") != "gpu":
            continue
        if os.path.basename(path).startswith("gemm_codec"):
            out += gemm_check_rows(doc, os.path.basename(path))
            continue
        for r in doc.get("rows", []):
            kernel = KERNEL_OF_LABEL.get(r.get("kernel"))
            dt = DTYPES.get(r.get("dtype"))
            if (kernel is None or dt is None or not r.get("checked", True)
                    or r.get("config", doc.get("config", "default")) != "default"
                    or r.get("variant", "default") != "default"):
                continue
            out.append({"kernel": kernel, "codec": r.get("codec", doc.get("codec")),
                        "dtype": jnp.dtype(dt).name, "p": r.get("p"),
                        "ok": bool(r.get("ok")) and r.get("calls", 0) >= 1,
                        "fingerprint": r.get("fingerprint"),
                        "file": os.path.basename(path)})
    return out


def gemm_check_rows(doc: dict, name: str) -> list[dict]:
    """`check_rows`' rows of one bench.gemm_codec checks file: the loopback kernels (--impl
    kernel) at their default launch, kernel "gemm_all" or "gemm_owner" by exchange."""
    out = []
    for r in doc.get("rows", []):
        kernel = GEMM_KERNEL_OF_EXCHANGE.get(r.get("exchange"))
        dt = DTYPES.get(r.get("dtype"))
        if (kernel is None or dt is None or r.get("kind", "check") != "check"
                or r.get("impl", doc.get("impl")) != "kernel"
                or r.get("config", "default") != "default"):
            continue
        out.append({"kernel": kernel, "codec": r.get("codec"), "dtype": jnp.dtype(dt).name,
                    "p": r.get("p"), "ok": bool(r.get("ok")) and r.get("calls", 0) >= 1,
                    "fingerprint": r.get("fingerprint"), "file": name})
    return out


def takes(kernel: str, p: int) -> bool:
    """Do the collectives take `kernel` at axis size P? The one-launch all-reduce's by P
    (`collectives.fused.one_launch_kernel`), the GEMMs at every P ≥ 2."""
    from taco_jax.collectives.fused import one_launch_kernel
    from taco_jax.kernels.fused import checked
    return p >= 2 and (kernel in checked.GEMM_KERNELS or one_launch_kernel(p) == kernel)


def current_fingerprints(rows, known: dict | None = None) -> dict:
    """{(kernel, codec, dtype, p): the fingerprint this checkout emits} for every
    configuration of `rows` (`check_rows`) that has a fingerprint and a registered codec,
    each lowered (`kernels.fused.checked.fingerprint`), except those `known` gives (a
    checked table, {(kernel, codec, dtype): ((p, fingerprint), ...)}, whose fingerprints are
    known to be current: `checked.stale` says so)."""
    from taco_jax import codecs
    from taco_jax.kernels.fused import checked
    given = {(*t, p): fp for t, pairs in (known or {}).items() for p, fp in pairs}
    keys = {(r["kernel"], r["codec"], r["dtype"], r["p"]) for r in rows
            if r["fingerprint"] and r["codec"] in codecs.names() and isinstance(r["p"], int)
            and r["p"] >= 2}
    return {k: given[k] if k in given else checked.fingerprint(k[0], codecs.get(k[1]), k[2], k[3])
            for k in sorted(keys)}


def checked_table(rows, current: dict) -> dict:
    """{(kernel, codec, dtype): ((P, fingerprint), ...)} of the triples whose check rows
    (`check_rows`) at the fingerprints `current` gives (`current_fingerprints`) all pass,
    some at a P the collectives take that kernel at (the one-shot at 2, the two-shot at 3
    and above, the GEMMs at 2 and above: `takes`): what the fused transport may select,
    with the modules it was checked at."""
    groups: dict = {}
    for r in rows:
        key = (r["kernel"], r["codec"], r["dtype"], r["p"])
        if r["fingerprint"] is not None and current.get(key) == r["fingerprint"]:
            groups.setdefault(key[:3], []).append(r)
    return {t: tuple(sorted({(r["p"], r["fingerprint"]) for r in rs}))
            for t, rs in sorted(groups.items()) if all(r["ok"] for r in rs)
            and any(takes(t[0], r["p"]) for r in rs)}


def table_text(jax_version: str, table: dict) -> str:
    """checked.py's table as `write_checked` writes it."""
    lines = [TABLE_MARK + " from the check rows", f'JAX = "{jax_version}"']
    if not table:
        lines.append("CHECKED = {}")
    else:
        lines.append("CHECKED = {")
        lines += [f"    {t!r}: {pairs!r}," for t, pairs in sorted(table.items())]
        lines.append("}")
    return "\n".join(lines) + "\n"


def write_checked(path: str = CHECKED_PY, rows=None) -> dict:
    """Rewrite the table at the end of checked.py (from TABLE_MARK on): JAX the installed
    jax, CHECKED the triples whose check rows pass at the fingerprints this checkout emits
    with it (`checked_table` of `check_rows()`, or of `rows`). Prints and returns it."""
    rows = check_rows() if rows is None else rows
    current = current_fingerprints(rows)
    table = checked_table(rows, current)
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(text[:text.index(TABLE_MARK)] + table_text(jax.__version__, table))
    at = sum(r["fingerprint"] is not None and
             current.get((r["kernel"], r["codec"], r["dtype"], r["p"])) == r["fingerprint"]
             for r in rows)
    print(f"wrote {path}: {len(table)} (kernel, codec, dtype) checked as jax "
          f"{jax.__version__} emits them ({at} of {len(rows)} check rows are at the "
          f"fingerprints emitted now)")
    for t, pairs in sorted(table.items()):
        print("  " + " ".join(t) + "  " + " ".join(f"P={p}:{fp}" for p, fp in pairs))
    return table


def unselected(codec, ps, dtypes) -> list[str]:
    """"kernel dtype" of the one-launch kernels that the collectives would take at these
    P and dtypes (names of DTYPES) but do not select: their checks have not passed."""
    from taco_jax.collectives.fused import one_launch_kernel
    from taco_jax.kernels.fused import checked
    return sorted({f"{one_launch_kernel(p)} {d}" for p in ps for d in dtypes
                   if checked.unchecked(one_launch_kernel(p), codec, DTYPES[d]) is not None})


# -- the driver -----------------------------------------------------------------------------
def child_cmd(a, p, sizes, dtype) -> list[str]:
    cmd = [sys.executable, "-m", "bench.fused", "--one", str(p),
           ",".join(map(str, sizes)), dtype,
           "--impl", a.impl, "--calls", str(a.calls), "--codec", a.codec]
    if getattr(a, "variant", None):
        cmd += ["--variant", a.variant]
    if a.kernel != "one_shot":
        cmd += ["--kernel", a.kernel]
    if a.wrong_exchange:
        cmd += ["--wrong-exchange", a.wrong_exchange]
    if a.config:
        cmd += ["--config", *a.config]
    if a.time:
        cmd.append("--time")
    return cmd


def run_children(a, configs, save=lambda rows: None) -> list[dict]:
    """Each configuration in its own process (--isolate config), or each (P, dtype) group
    of sizes in one (--isolate group: one start-up for several sizes; a hang or crash
    loses the rest of its group, reported as such), one at a time (a GPU in exclusive
    mode admits one process), each under a.timeout per configuration."""
    if a.isolate == "config":
        groups = [((p, d), [s]) for p, s, d in configs]
    else:
        keys = list(dict.fromkeys((p, d) for p, _, d in configs))
        groups = [(k, [s for p, s, d in configs if (p, d) == k]) for k in keys]
    from taco_jax import codecs
    rows = []
    for (p, dtype), sizes in groups:
        # what a configuration that did not finish would have run: its failure counts
        # against the module it stands for, like a row that ran
        fp = row_fingerprint(a.impl, a.kernel, codecs.get(a.codec), p, dtype, a.config)
        mark = {} if fp is None else {"fingerprint": fp}
        if getattr(a, "fail_fast", False) and getattr(a, "_stopped", None):
            rows += [{"p": p, "mib": round(nb / MIB, 6), "bytes": nb, "dtype": dtype,
                      "kernel": row_label(a.impl, a.kernel),
                      "variant": getattr(a, "variant", None) or "default", "ok": False,
                      "reason": f"not run: {a._stopped}", **mark} for nb in sizes]
            continue
        limit = a.timeout * len(sizes)
        got, why = child_rows(child_cmd(a, p, sizes, dtype), limit, ROOT)
        if why:
            a._stopped = f"P={p} {dtype} {why}"[:200]
        for r in got:
            print(f"P={p} {r['mib']} MiB {dtype} {r.get('variant', '')}: "
                  + ("ok" if r["ok"] else r["reason"]), flush=True)
        rows += got
        for nbytes in sizes[len(got):]:
            rows.append({"p": p, "mib": round(nbytes / MIB, 6), "bytes": nbytes,
                         "dtype": dtype, "kernel": row_label(a.impl, a.kernel),
                         "variant": getattr(a, "variant", None) or "default",
                         "ok": False, "reason": why or "no result", **mark})
            print(f"P={p} {rows[-1]['mib']} MiB {dtype}: {rows[-1]['reason']}", flush=True)
        save(rows)                 # what is done survives a kill of the whole batch
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--p", type=int, nargs="+", default=None, help="default 2 4 8")
    ap.add_argument("--sizes", type=parse_size, nargs="+", default=None,
                    help=f"default {' '.join(DEFAULT_SIZES)}")
    ap.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=None,
                    help="default bf16 f32")
    ap.add_argument("--codec", default="taco")
    ap.add_argument("--calls", type=int, default=None, help="default 5 (--ablate: 1)")
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--annotate", metavar="JSON", default=None,
                    help="recompute the projections of a results file, run nothing")
    ap.add_argument("--impl", choices=["kernel", "mesh", "emulated"], default=None,
                    help="kernel: the loopback on one GPU (default on GPU); mesh: "
                         "taco_jax.psum(transport='fused') over P GPUs; emulated: a jnp "
                         "model of the kernel (default elsewhere)")
    ap.add_argument("--config", nargs="+", metavar="KEY=VALUE", default=None,
                    help="FusedConfig fields of the loopback kernel, e.g. programs=66")
    ap.add_argument("--kernel", choices=["one_shot", "two_shot"], default="one_shot",
                    help="one_shot: the one-launch kernel (rows 'one_launch'); two_shot: "
                         "the one-launch two-shot as a loopback (rows "
                         "'one_launch_two_shot'), its error within "
                         f"{TWO_SHOT_SLACK} × its jnp reference's")
    ap.add_argument("--fail-fast", action="store_true",
                    help="after a configuration times out or crashes, run no more (each "
                         "is reported as not run)")
    ap.add_argument("--ablate", action="store_true",
                    help="time the variants of --variants side by side (default sizes "
                         f"{' '.join(ABLATE_SIZES)}, P = 2, bf16, 1 checked call) and "
                         "print their differences to the default")
    ap.add_argument("--base", choices=list(VARIANTS), default="default",
                    help="--ablate: the variant the others are compared with")
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                    help="with --ablate: the variants, in order (default first)")
    ap.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--wrong-exchange", choices=["slot", "stale"], default=None)
    ap.add_argument("--isolate", choices=["config", "group"], default="config")
    ap.add_argument("--timeout", type=float, default=240.0)
    ap.add_argument("--out", default="bench/results/fused_loopback.json")
    ap.add_argument("--update", action="store_true",
                    help="keep the --out file's rows of what this run does not measure "
                         "(another codec, P, size, dtype or config); each row names its "
                         "codec and commit")
    ap.add_argument("--missing", action="store_true",
                    help="with --update: run only the configurations without a passing "
                         "row in --out from the same library sources (rows name them), so "
                         "a long matrix resumes where a run cut short left it")
    ap.add_argument("--write-checked", action="store_true",
                    help="run nothing: write the fused transport's checked table "
                         "(taco_jax/kernels/fused/checked.py) from the check rows in "
                         "bench/results/fused*.json at the fingerprints emitted now")
    ap.add_argument("--one", nargs=3, metavar=("P", "BYTES,…", "DTYPE"), default=None,
                    help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.p = a.p or ([2] if a.ablate else [2, 4, 8])
    a.sizes = a.sizes or [parse_size(s) for s in (ABLATE_SIZES if a.ablate
                                                   else DEFAULT_SIZES)]
    a.dtypes = a.dtypes or (["bf16"] if a.ablate else ["bf16", "f32"])
    a.calls = a.calls if a.calls is not None else (1 if a.ablate else 5)
    if a.missing and (not a.update or a.ablate or a.time):
        raise SystemExit("bench.fused: --missing resumes checks: it needs --update and "
                         "takes neither --ablate nor --time")
    if a.write_checked:
        write_checked()
        return 0
    from taco_jax import codecs
    if a.kernel == "two_shot" and a.impl == "mesh":
        raise SystemExit("bench.fused: --impl mesh runs the collectives, which take the "
                         "kernel for each P (the two-shot at P >= 3): leave --kernel out")
    if a.impl == "mesh":
        unchecked = unselected(codecs.get(a.codec), a.p, a.dtypes)
        if unchecked:
            raise SystemExit(f"bench.fused: --impl mesh: the collectives do not select the "
                             f"one-launch kernel for {a.codec} until its loopback checks "
                             f"pass as it is emitted now (--impl kernel on one GPU, then "
                             f"--write-checked; not yet: {', '.join(unchecked)})")
    if a.ablate:
        a.time = True
        if a.kernel != "one_shot":
            raise SystemExit("bench.fused: --ablate times the one-shot kernel's variants")
        if a.config:
            raise SystemExit("bench.fused: --ablate takes its configurations from "
                             "--variants, not --config")
        if a.base not in a.variants:
            raise SystemExit(f"bench.fused: --base {a.base} is not among --variants")
    if a.impl is None:
        a.impl = "kernel" if jax.default_backend() == "gpu" else "emulated"
    if a.impl in ("kernel", "mesh") and jax.default_backend() != "gpu":
        raise SystemExit(f"bench.fused: cannot run here: the kernel needs a Hopper GPU "
                         f"(platform {jax.default_backend()!r}; --impl emulated runs the "
                         f"checks on a jnp model)")
    if a.impl == "mesh":
        from taco_jax.collectives import fused
        n = jax.device_count()
        mesh = jax.make_mesh((n,), ("tp",))
        why = fused.mesh_unavailable_reason(mesh) or (
            None if max(a.p) <= n and min(a.p) >= 2 else
            f"--p {a.p} needs 2..{n} GPUs of this process")
        if why:
            raise SystemExit(f"bench.fused: cannot run here: {why}")
    if a.one:
        a.one_p, a.one_dtype = int(a.one[0]), a.one[2]
        for nbytes in a.one[1].split(","):
            a.one_bytes = int(nbytes)
            print("ROW " + json.dumps(run_config(a)), flush=True)
        return 0
    codec = codecs.get(a.codec)
    if a.annotate:                   # recompute the derived figures of a results file
        with open(a.annotate) as f:
            write_json(a.annotate, annotate(json.load(f), codec.row_bytes,
                                            codec.block_size))
        return 0
    configs = [(p, s, d) for p in a.p for s in a.sizes for d in a.dtypes]
    config = "ablation" if a.ablate else " ".join(a.config or ()) or "default"

    facts = env_facts()
    if a.missing:
        with locked(a.out):
            old = read_rows(a.out)
        fps = {(p, d): row_fingerprint(a.impl, a.kernel, codec, p, d, a.config)
               for p in a.p for d in a.dtypes}
        done = passed_rows(old, a.codec, config, fps, a.calls, row_label(a.impl, a.kernel))
        skip = [c for c in configs if row_key({"p": c[0], "bytes": c[1], "dtype": c[2]})
                in done]
        configs = [c for c in configs if c not in skip]
        print(f"--missing: {len(skip)} configurations already passed at the fingerprints "
              f"emitted now, {len(configs)} to run")
        if not configs:
            return 0

    def payload(rows):
        rows = [{**r, "codec": r.get("codec", a.codec),
                 "commit": r.get("commit", facts["commit"]),
                 "sources": r.get("sources", facts["sources"])}
                for r in rows]
        # --update: the file as it is now (under `locked`), not as it was when this run
        # began, so the rows another run has written since stay
        kept = kept_rows(read_rows(a.out) if a.update else None, a.codec,
                         {row_key(r) for r in rows}, config, row_label(a.impl, a.kernel))
        return {**facts, "impl": a.impl, "codec": a.codec, "calls": a.calls,
                "config": config,
                "link_gbps": LINK_GBPS, "fixed_us": FIXED_US,
                "projection": "projected for 2 GPUs, not measured: fixed_us + "
                              "max(per_device_us, wire bytes / link_gbps), / 2xH200 "
                              "lax.psum (bench/results/collectives.json)",
                "rows": kept + rows, "method_check": []}
    def save(rows, final: bool = False):
        with locked(a.out):
            result = annotate(payload(rows), codec.row_bytes, codec.block_size)
            if final and a.ablate:
                result["ablation"] = ablation_table(result["rows"], a.base)
            write_json(a.out, result)
        return result
    if a.ablate:
        rows = []
        for name in a.variants:
            a.config, a.variant = VARIANTS[name][0] or None, name
            rows += run_children(a, configs, lambda got: save(rows + got))
    else:
        rows = run_children(a, configs, save)
    result = save(rows, final=True)
    rows = result["rows"]
    if a.ablate:
        print(f"per-device time of each variant, and its difference to {a.base}'s:")
        print_table(result["ablation"], ["p", "dtype", "mib", "variant", "checked", "ok",
                                         "per_device_us", "delta_us", "delta_frac",
                                         "vs_separate", "estimates"])
    cols = ["p", "mib", "dtype", "kernel", "ok", "same_on_every_device", "rel_err",
            "reference_rel_err", "xla_rel_err",
            "device_us", "per_device_us", "separate_us", "projected_ratio_nvlink",
            "projected_three_launch_ratio_nvlink", "measured_ratio"]
    print_table(rows, [c for c in cols if any(c in r for r in rows)])
    if result["method_check"]:
        print("the projection's method on the xla transport (2×H200 measured):")
        print_table(result["method_check"], list(result["method_check"][0]))
    failed = [r for r in rows if not r.get("ok")]
    if failed:
        r = failed[0]
        print(f"bench.fused: FAILED P={r['p']} {r['mib']} MiB {r['dtype']}: {r['reason']} "
              f"({len(failed)} of {len(rows)} configurations failed)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
