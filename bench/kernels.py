"""Kernel benchmark: compress / decompress / reduce per implementation, vs the HBM roofline.

    python -m bench.kernels [--sizes-mib 16 64 256 1024] [--impls triton mosaic]
                            [--codecs taco echo4] [--check] [--stages] [--tune]
                            [--no-timings] [--out bench/results/kernels.json]

Each row is one implementation (Pallas-Triton or Pallas Mosaic GPU) × kernel × size, with
two times per call: `device_us`, the GPU kernels' own durations summed from a profiler
trace (`bench.common.device_time`), and `host_us`, calls back to back under the host timer
(`time_calls`, which adds launch gaps). The roofline is XLA's f32 `x + 1` over 256 MiB
(bytes read + written), timed both ways in the same run; `device_fraction` (device time
against the device-timed roofline) is the figure the targets refer to, `host_fraction`
the host-timed pair. Effective bytes of a kernel = bytes it reads + bytes it writes (input
of bf16; a wire row is row_bytes per block). Implementations that do not cover a call
(`taco_jax.kernels.mosaic.unsupported`) have no row for it. Each row names its codec:
the TACO codecs' kernels (compress, decompress, reduce) and Echo's 4-bit ones
(`taco_jax.kernels.triton.echo4`, Triton only: compress, compress_feedback — x and the fp32
residual in, codes and the new residual out —, decompress, reduce, decode_sum over P = 2).

--check compares every kernel and implementation with its jnp reference on this device:
every codec, block size and dtype the implementation covers, rows with NaN and ±Inf, which
must decode to NaN. For the 4-bit codecs (`--codecs echo4`) every kernel must match its
jitted reference bit for bit (`ok` per case). --stages times the Triton compress with parts of its work taken away
(a Pallas copy with the wire layout, no transform, no α). --tune times Mosaic launch
configs (blocks per multiprocessor × TMA steps in flight) at 16 and 256 MiB, and with
`--codecs echo4` the 4-bit kernels at 16 and 256 MiB: the plain tile math, the variants each
kernel runs (`echo4.MEASURED_VARIANTS`) and all of them under the default tiling, then the
variants it runs under other tilings, side by side in one table. --no-timings leaves the
timing rows out (the checks alone fit a GPU call that the timings would fill). --update
re-times only the codecs given and keeps the rest of --out: the other codecs' timing rows,
each tagged with the commit it was measured at (`measured_at`), and the sections this run
does not write, each labelled with its commit (`<section>_commit`); it refuses a file from
another device or jax version. Writes
bench/results/kernels.json (device, jax, commit and every figure). On CPU the Triton
kernels run in Pallas' interpreter at small sizes, a smoke test without device times.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import device_time, env_facts, print_table, write_json
from taco_jax import codecs
from taco_jax.kernels import mosaic, references
from taco_jax.kernels.triton import compress, decompress, echo4, reduce, tiling as common

MIB = 1 << 20
INTERP = jax.default_backend() != "gpu"   # CPU smoke runs use the Pallas interpreter
KINDS = ("compress", "decompress", "reduce")
ECHO_KINDS = ("compress", "compress_feedback", "decompress", "reduce", "decode_sum")


def kinds_for(codec) -> tuple[str, ...]:
    return ECHO_KINDS if echo4.covers(codec) else KINDS


def timed(fn, x, iters: int = 10) -> dict:
    """Host-timer and device-time µs per call of one compiled program (device time None,
    with the reason, where there is no GPU)."""
    t = device_time(fn, x, iters=iters)
    out = {"host_us": t["host_us"], "device_us": t["us"]}
    if t["us"] is None:
        out["device_error"] = t["error"]
    else:
        out["device_kernels"] = t["kernels"]
    return out


def roofline(n_bytes: int) -> dict:
    """XLA f32 x + 1 over n_bytes: effective GB/s by each timer."""
    t = timed(lambda v: v + 1, jnp.ones(n_bytes // 4, jnp.float32))
    return {"bytes": 2 * n_bytes, "host_us": t["host_us"], "device_us": t["device_us"],
            "host_gbs": 2 * n_bytes / t["host_us"] / 1e3,
            "device_gbs": t["device_us"] and 2 * n_bytes / t["device_us"] / 1e3}


def echo_kernel_fn(kind, codec, x, cfg=None, peers=2):
    """`kernel_fn` for Echo's 4-bit kernels."""
    nb, isz, row = x.shape[0], x.dtype.itemsize, codec.row_bytes
    n = x.size
    if kind == "compress":
        return (lambda v: echo4.compress(v, codec, cfg, INTERP)), x, n * isz + nb * row
    if kind == "compress_feedback":
        r = (x.astype(jnp.float32) * 0.01).astype(jnp.float32)
        return ((lambda v: echo4.compress_feedback(v[0], v[1], codec, cfg, INTERP)), (x, r),
                n * isz + 4 * n + nb * row + 4 * n)
    w = echo4.compress(x, codec, interpret=INTERP)
    if kind == "decompress":
        return ((lambda v: echo4.decompress(v, codec, x.dtype, cfg, INTERP)), w,
                nb * row + n * isz)
    recv = jnp.stack([w] * peers)
    if kind == "decode_sum":
        return ((lambda v: echo4.decode_sum(v, codec, x.dtype, cfg, INTERP)), recv,
                peers * nb * row + n * isz)
    return ((lambda v: echo4.reduce(v, x, jnp.int32(0), codec, cfg, INTERP)), recv,
            peers * nb * row + n * isz + nb * row)


def kernel_fn(kind, impl, codec, x, cfg=None, peers=2):
    """(fn, its argument, effective bytes) for one kernel on bf16 data x (n_blocks, B)."""
    if echo4.covers(codec):
        return echo_kernel_fn(kind, codec, x, cfg, peers)
    nb, isz, row = x.shape[0], x.dtype.itemsize, codec.row_bytes
    n = x.size
    if kind == "compress":
        if impl == "mosaic":
            return (lambda v: mosaic.compress(v, codec, cfg)), x, n * isz + nb * row
        return (lambda v: compress.compress(v, codec, cfg, INTERP)), x, n * isz + nb * row
    w = compress.compress(x, codec, interpret=INTERP)
    if kind == "decompress":
        if impl == "mosaic":
            return (lambda v: mosaic.decompress(v, codec, x.dtype, cfg)), w, nb * row + n * isz
        return ((lambda v: decompress.decompress(v, codec, x.dtype, cfg, INTERP)), w,
                nb * row + n * isz)
    recv = jnp.stack([w] * peers)   # reduce: P received copies + own segment → one segment
    return ((lambda v: reduce.reduce(v, x, jnp.int32(0), codec, cfg, INTERP)), recv,
            peers * nb * row + n * isz + nb * row)


def covers(impl, kind, codec, shape, dtype) -> bool:
    if impl == "triton" or echo4.covers(codec):
        return impl == "triton"
    return not INTERP and mosaic.unsupported(kind, codec, shape, dtype) is None


def measure(kind, impl, codec, n, roof, cfg=None) -> dict:
    x = (jax.random.normal(jax.random.key(0), (n // codec.block_size, codec.block_size),
                           jnp.float32) * 0.02).astype(jnp.bfloat16)
    fn, arg, nbytes = kernel_fn(kind, impl, codec, x, cfg)
    t = timed(fn, arg, iters=4 if n * 2 >= 1024 * MIB else 10)
    row = {"impl": impl, "kernel": kind, "codec": codec.name, "elements": n,
           "mib": n * 2 / MIB, "bytes": nbytes, "host_us": round(t["host_us"], 2),
           "host_gbs": round(nbytes / t["host_us"] / 1e3, 1),
           "host_fraction": round(nbytes / t["host_us"] / 1e3 / roof["host_gbs"], 3)}
    if t["device_us"]:
        gbs = nbytes / t["device_us"] / 1e3
        row.update(device_us=round(t["device_us"], 2), device_gbs=round(gbs, 1),
                   device_fraction=round(gbs / roof["device_gbs"], 3),
                   device_kernels=t["device_kernels"])
    elif "device_error" in t:
        row["device_error"] = t["device_error"]
    return row


# -- --check ---------------------------------------------------------------------------------
# The references jitted: one compile per case instead of one per eager op and shape.
_compress_ref = jax.jit(references.compress_reference, static_argnums=1)
_decompress_ref = jax.jit(references.decompress_reference, static_argnums=(1, 2))
_reduce_ref = jax.jit(references.reduce_reference, static_argnums=3)


def _check_input(rng, rows, b, dtype):
    x = rng.standard_t(3, size=(rows, b)).astype(np.float32) * 0.01
    x[7, 3] = np.nan
    x[11, 0] = np.inf
    x[13, 5] = -np.inf
    return jnp.asarray(x).astype(dtype)


def _compare(wk, wr, c, dk, dr):
    b = c.block_size
    fin = np.isfinite(dr)
    return {"codes_differ_frac": float(np.mean(np.asarray(wk[:, :b]) != np.asarray(wr[:, :b]))),
            "decode_max_rel": float(np.max(np.abs(dk[fin] - dr[fin])) / np.max(np.abs(dr[fin]))),
            "nan_rows_match": bool(np.array_equal(np.isnan(dk).any(1), np.isnan(dr).any(1)))}


def check_triton(out_rows, save=None, shard=(0, 1)):
    """Every Triton case; shard=(i, n): cases i, i + n, … (several processes share a GPU,
    each compiling its own cases)."""
    rng = np.random.default_rng(0)
    cases = [(n, b, d, {}) for n, b, d in itertools.product(
        ["taco", "taco-1scale", "taco-e5m2", "taco-int8", "block-fp8"],
        [32, 64, 128, 256, 512], [jnp.bfloat16, jnp.float32, jnp.float16])
        if n == "taco" or (b == 256 and d == jnp.bfloat16)]
    # the IEEE per-block math (fast_rowmath=False), not the default
    cases += [("taco", b, d, {"fast_rowmath": False}) for b in (32, 256)
              for d in (jnp.bfloat16, jnp.float32)]
    for name, b, dtype, over in cases[shard[0]::shard[1]]:
        c = codecs.get(name, block_size=b)
        cfg = {k: dataclasses.replace(common.KernelConfig.default(b, k), **over) for k in KINDS}
        x = _check_input(rng, 4099, b, dtype)
        wk = compress.compress(x, c, cfg["compress"], interpret=INTERP)
        wr = _compress_ref(x, c)
        dk = np.asarray(decompress.decompress(wr, c, cfg=cfg["decompress"], interpret=INTERP),
                        np.float64)
        dr = np.asarray(_decompress_ref(wr, c, jnp.float32), np.float64)
        recv = jnp.stack([wr, wr])
        rk = np.asarray(_decompress_ref(
            reduce.reduce(recv, x, jnp.int32(1), c, cfg["reduce"], interpret=INTERP), c,
            jnp.float32))
        rr = np.asarray(_decompress_ref(_reduce_ref(recv, x, jnp.int32(1), c), c, jnp.float32))
        rfin = np.isfinite(rr)
        out_rows.append({
            "impl": "triton", "codec": name, "block": b, "dtype": jnp.dtype(dtype).name,
            "fast_rowmath": cfg["compress"].fast_rowmath, **_compare(wk, wr, c, dk, dr),
            "reduce_max_rel": float(np.max(np.abs(rk[rfin] - rr[rfin])) /
                                    np.max(np.abs(rr[rfin]))),
            "reduce_nan_match": bool(np.array_equal(np.isnan(rk), np.isnan(rr)))})
        print(out_rows[-1], flush=True)
        if save:          # a run stopped by a time limit keeps the cases it checked
            save()


def check_mosaic(out_rows):
    """Every codec and dtype the Mosaic kernels cover; decompress of the reference wire in
    each output dtype; a call skipping rows leaves the rest identical."""
    rng = np.random.default_rng(1)
    for name in ("taco", "taco-e5m2", "taco-1scale"):
        c = codecs.get(name)
        for dtype in mosaic.IN_DTYPES:
            x = _check_input(rng, 4096, 256, dtype)
            wk = mosaic.compress(x, c)
            wr = _compress_ref(x, c)
            dk = np.asarray(_decompress_ref(wk, c, jnp.float32), np.float64)
            dr = np.asarray(_decompress_ref(wr, c, jnp.float32), np.float64)
            row = {"impl": "mosaic", "kernel": "compress", "codec": name, "block": 256,
                   "dtype": jnp.dtype(dtype).name, **_compare(wk, wr, c, dk, dr)}
            xf = np.asarray(x.astype(jnp.float32), np.float64)
            ok = np.isfinite(xf).all(1)
            row["err_vs_input"] = float(np.linalg.norm(dk[ok] - xf[ok]) / np.linalg.norm(xf[ok]))
            row["ref_err_vs_input"] = float(np.linalg.norm(dr[ok] - xf[ok]) /
                                            np.linalg.norm(xf[ok]))
            skip = mosaic.compress(x, c, skip_start=jnp.int32(1024), skip_rows=2048)
            keep = np.r_[0:1024, 3072:4096]
            row["skip_rest_equal"] = bool(np.array_equal(np.asarray(skip)[keep],
                                                         np.asarray(wk)[keep]))
            out_rows.append(row)
            print(row, flush=True)
        x = _check_input(rng, 4096, 256, jnp.float32)
        wr = _compress_ref(x, c)
        for out in mosaic.OUT_DTYPES:
            dk = np.asarray(mosaic.decompress(wr, c, out).astype(jnp.float32), np.float64)
            dr = np.asarray(_decompress_ref(wr, c, out).astype(jnp.float32), np.float64)
            out_rows.append({"impl": "mosaic", "kernel": "decompress", "codec": name,
                             "block": 256, "dtype": jnp.dtype(out).name,
                             **_compare(wr, wr, c, dk, dr)})
            print(out_rows[-1], flush=True)


_echo_refs = {"compress": jax.jit(references.compress_reference, static_argnums=1),
              "compress_feedback": jax.jit(references.compress_feedback_reference, static_argnums=2),
              "decompress": jax.jit(references.decompress_reference, static_argnums=(1, 2)),
              "reduce": jax.jit(references.reduce_reference, static_argnums=3),
              "decode_sum": jax.jit(references.decode_sum_reference, static_argnums=(1, 2))}
ECHO_CHECKS = ([("echo4", b, jnp.bfloat16) for b in (32, 64, 128, 256, 512)]
               + [("echo4", 128, jnp.float32), ("echo4", 128, jnp.float16),
                  ("int4-sym", 128, jnp.bfloat16), ("int4-sym", 32, jnp.float32)])
# the encoder variants not (yet) in the defaults, on top of each kernel's default config:
# checked on the device before the sweep may make them the default
ECHO_TRIAL = ("merged_rows", "word_stores", "prefetch", "pack_mad", "int_stats")
ECHO_CHECKS += [("echo4", 128, jnp.bfloat16, ECHO_TRIAL),
                ("int4-sym", 32, jnp.float32, ECHO_TRIAL)]


def _bits_differ(a, b) -> int:
    """How many elements differ bit for bit (NaN payloads included)."""
    a, b = np.asarray(a), np.asarray(b)
    u = f"u{a.dtype.itemsize}"
    return int(np.sum(a.view(u) != b.view(u)))


def check_echo(out_rows, save=None):
    """Every Echo kernel against its jitted reference, bit for bit: wire bytes (compress,
    compress_feedback, reduce) and decoded values (decompress, decode_sum, the new
    residual); rows with NaN, ±Inf, zeros and one-signed groups."""
    rng = np.random.default_rng(2)
    n = 4099 if not INTERP else 99            # the interpreter: a smoke test, three cases
    cases = ECHO_CHECKS if not INTERP else ECHO_CHECKS[2::6] + ECHO_CHECKS[-1:]
    for name, b, dtype, *extra in cases:
        variants = extra[0] if extra else ()
        try:
            row = _check_echo_case(rng, n, name, b, dtype, variants)
        except Exception as e:   # a kernel that does not compile fails its case, visibly
            row = {"impl": "triton", "codec": name, "block": b,
                   "dtype": jnp.dtype(dtype).name, "variants": "+".join(variants),
                   "ok": False, "error": f"{type(e).__name__}: {str(e)[:500]}"}
        out_rows.append(row)
        print(row, flush=True)
        if save:
            save()


def _check_echo_case(rng, n, name, b, dtype, variants=()) -> dict:
    """One codec, block size and dtype; `variants`: EchoConfig options turned on over each
    kernel's default config (none: the kernels as the library calls them)."""
    c = codecs.get(name, block_size=b)

    def cfg(kernel):
        if not variants:
            return None
        return echo4.with_options(echo4.default_config(b, kernel, n),
                                  **{v: True for v in variants})
    x = np.array(_check_input(rng, n, b, jnp.float32), np.float32)
    x[17] = 0.0
    x[19] = np.abs(x[19])
    x = jnp.asarray(x).astype(dtype)
    r = jnp.asarray(rng.standard_normal((n, b)).astype(np.float32) * 0.005)
    wr = _echo_refs["compress"](x, c)
    recv = jnp.stack([wr, _echo_refs["compress"](x[::-1], c)])
    fk, ek = echo4.compress_feedback(x, r, c, cfg("compress"), interpret=INTERP)
    fr, er = _echo_refs["compress_feedback"](x, r, c)
    row = {"impl": "triton", "codec": name, "block": b, "dtype": jnp.dtype(dtype).name,
           "variants": "+".join(variants),
           "compress_bytes_differ": _bits_differ(
               echo4.compress(x, c, cfg("compress"), interpret=INTERP), wr),
           "feedback_bytes_differ": _bits_differ(fk, fr),
           "feedback_residual_differ": _bits_differ(ek, er),
           "decompress_differ": _bits_differ(
               echo4.decompress(wr, c, dtype, cfg("decompress"), interpret=INTERP),
               _echo_refs["decompress"](wr, c, dtype)),
           "reduce_bytes_differ": _bits_differ(
               echo4.reduce(recv, x, jnp.int32(1), c, cfg("reduce"), interpret=INTERP),
               _echo_refs["reduce"](recv, x, jnp.int32(1), c)),
           "decode_sum_differ": _bits_differ(
               echo4.decode_sum(recv, c, dtype, cfg("decode_sum"), interpret=INTERP),
               _echo_refs["decode_sum"](recv, c, dtype))}
    sk = np.asarray(echo4.decode_sum(recv, c, jnp.float32, cfg("decode_sum"),
                                     interpret=INTERP), np.float64)
    sr = np.asarray(_echo_refs["decode_sum"](recv, c, jnp.float32), np.float64)
    fin = np.isfinite(sr)
    row["decode_sum_f32_max_rel"] = float(np.max(np.abs(sk[fin] - sr[fin])) /
                                          np.max(np.abs(sr[fin])))
    dec = np.asarray(_echo_refs["decompress"](wr, c, jnp.float32))
    row["nan_rows_match"] = bool(np.array_equal(
        np.isnan(dec).all(1), ~np.isfinite(np.asarray(x.astype(jnp.float32))).all(1)))
    row["ok"] = row["nan_rows_match"] and not any(
        v for k, v in row.items() if k.endswith("differ"))
    return row


# -- --stages (Triton compress) ------------------------------------------------------------
def _copy_kernel(x_ref, o_ref, *, cfg, n_rows, b):
    """compress's plumbing only: load a bf16 tile, cast to fp8, store codes + zero scales."""
    def tile(t):
        x = common.load_rows(x_ref, t, cfg.blocks_per_program, 0, b, n_rows)
        codes = jax.lax.bitcast_convert_type(x.astype(jnp.float8_e4m3fn), jnp.uint8)
        common.store_rows(o_ref, t, codes, cfg.blocks_per_program, 0, n_rows)
        pad = o_ref.shape[1] - b
        if pad:
            common.store_rows(o_ref, t, jnp.zeros((cfg.blocks_per_program, pad), jnp.uint8),
                              cfg.blocks_per_program, b, n_rows)
    common.for_each_tile(cfg, n_rows, tile)


def copy_kernel(x, row_bytes, cfg):
    n_rows, b = x.shape
    kernel = functools.partial(_copy_kernel, cfg=cfg, n_rows=n_rows, b=b)
    out = jax.ShapeDtypeStruct((n_rows, row_bytes), jnp.uint8)
    return common.launch(kernel, out, n_rows, cfg, INTERP, "copy", x)


def stage_rows(n: int, roof: dict) -> list[dict]:
    """Triton compress with parts of its work taken away, default tiling: a Pallas copy
    with the wire layout (and codes only), no transform (block-fp8), Hadamard without α
    (taco-1scale), taco. Same input (n bf16 elements)."""
    taco = codecs.get("taco")
    b, nb = taco.block_size, n // taco.block_size
    x = (jax.random.normal(jax.random.key(0), (nb, b), jnp.float32) * 0.02).astype(jnp.bfloat16)
    cfg = common.KernelConfig.default(b, "compress")
    runs = [(f"copy row={rb}B", lambda v, rb=rb: copy_kernel(v, rb, cfg), rb)
            for rb in (taco.row_bytes, b)]
    for name in ("block-fp8", "taco-1scale", "taco"):
        c = codecs.get(name)
        runs.append((f"compress {name}",
                     lambda v, c=c: compress.compress(v, c, cfg, INTERP), c.row_bytes))
    rows = []
    for label, fn, rb in runs:
        t = timed(fn, x)
        nbytes = n * 2 + nb * rb
        row = {"stage": label, "host_us": round(t["host_us"], 2),
               "host_fraction": round(nbytes / t["host_us"] / 1e3 / roof["host_gbs"], 3)}
        if t["device_us"]:
            row.update(device_us=round(t["device_us"], 2), device_fraction=round(
                nbytes / t["device_us"] / 1e3 / roof["device_gbs"], 3))
        rows.append(row)
        print(row, flush=True)
    return rows


# -- --tune (Mosaic launch configs) ---------------------------------------------------------
TUNE = [mosaic.MosaicConfig(*args) for args in
        [(2, 2, 1, True), (2, 2, 2, True), (4, 2, 2, True), (3, 3, 2, True), (2, 2, 1, False)]]


def tune_rows(sizes_mib, roof) -> list[dict]:
    taco = codecs.get("taco")
    rows = []
    for mib, kind, cfg in itertools.product(sizes_mib, ("compress", "decompress"), TUNE):
        try:
            r = measure(kind, "mosaic", taco, int(mib * MIB) // 2, roof, cfg)
            r.update(ctas_per_sm=cfg.ctas_per_sm, steps=cfg.steps, parts=cfg.parts,
                     tma_store=cfg.tma_store)
            r.pop("device_kernels", None)
        except Exception as e:   # a config that does not compile or launch is a finding
            r = {"kernel": kind, "mib": mib, "ctas_per_sm": cfg.ctas_per_sm,
                 "steps": cfg.steps, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        rows.append(r)
        print(r, flush=True)
    return rows


# echo4's tile-math variants (echo4.EchoConfig) and the tilings they are timed under. Per
# kernel and size, under the default tiling: the plain tile math, the variants the kernel runs
# (echo4.MEASURED_VARIANTS, "used"), for the kernels that encode (compress, reduce) those
# plus each encoder variant on trial, alone and in pairs, and all variants; then "used" (and
# compress and reduce "int") under each of ECHO_TILINGS. --tune-kernels picks
# the kernels (all four: ~6.5 min on an H200, compress alone: 54 configurations). The
# variants alone were compared in bench/results/kernels_echo4_variants.json and
# kernels_echo4_tune_encoders.json, the tilings in kernels_echo4_tilings.json.
ECHO_VARIANTS = {"present": {}, "used": (), "merged": ("merged_rows",),
                 "words": ("word_stores",), "merged+words": ("merged_rows", "word_stores"),
                 "mad": ("pack_mad",), "prefetch": ("prefetch",),
                 "prefetch+mad": ("prefetch", "pack_mad"), "int": ("int_stats",),
                 "int+prefetch": ("int_stats", "prefetch"),
                 "all": {"pairs": True, "lean": True, "scale_words": True,
                         "scale_columns": True, "merged_rows": True, "word_stores": True,
                         "prefetch": True, "pack_mad": True, "int_stats": True}}
ENCODERS = ("compress", "reduce")
# the variants only a looping compress reads
COMPRESS_ONLY = ("prefetch", "prefetch+mad", "int+prefetch")
# other tilings per size: (elements per tile, warps, tiles per program, stages)
ECHO_TILINGS = {16: [(1024, 1, 4, 3), (1024, 2, 1, 2), (4096, 4, 1, 2), (1024, 1, 8, 3),
                     (512, 1, 4, 3), (2048, 2, 1, 2), (512, 1, 2, 3), (2048, 4, 2, 3),
                     (512, 1, 4, 2), (1024, 2, 2, 3), (512, 1, 8, 3)],
                256: [(2048, 2, 4, 3), (4096, 4, 2, 3), (8192, 8, 1, 2), (1024, 1, 16, 3),
                      (2048, 4, 2, 3), (1024, 1, 8, 4), (2048, 2, 8, 3)]}
# (kernel, sizes in MiB) the sweep times
ECHO_TUNE_AT = [(kind, (16, 256)) for kind in ("compress", "decompress", "reduce", "decode_sum")]


def _tiling(elements: int, warps: int, tiles: int, stages: int, b: int = 128):
    return common.KernelConfig(blocks_per_program=max(1, elements // b), num_warps=warps,
                               num_stages=stages, tiles_per_program=tiles)


def echo_tune_cases(interp: bool = INTERP, kinds=None) -> list[tuple]:
    """(kernel, MiB, tiling label, variant, EchoConfig) of the echo4 sweep (B = 128), of the
    kernels `kinds` (None: all). On CPU (the interpreter) a smoke test: 0.0625 MiB, the
    default tiling, present and all."""
    cases = []
    for kind, sizes in ECHO_TUNE_AT:
        if kinds is not None and kind not in kinds:
            continue
        for mib in sizes if not interp else (0.0625,):
            cases += _echo_tune_cell(kind, mib, interp)
    return cases


def _echo_tune_cell(kind, mib, interp) -> list[tuple]:
    """One kernel and size: each of ECHO_VARIANTS under the default tiling, then the
    variants the kernel runs under each of ECHO_TILINGS (the interpreter: present and all,
    default tiling only)."""
    n_rows = int(mib * MIB) // 2 // 128
    used = echo4.MEASURED_VARIANTS[kind]

    def opts(name):     # a tuple: the used variants plus these; a dict: exactly these
        v = ECHO_VARIANTS[name]
        return v if isinstance(v, dict) else {**used, **{k: True for k in v}}
    names = [n for n, v in ECHO_VARIANTS.items()
             if (isinstance(v, dict) or not v or kind in ENCODERS)
             and (n not in COMPRESS_ONLY or kind == "compress")]
    cases = [(kind, mib, "default", name,
              echo4.with_options(echo4.default_tiling(128, kind, n_rows), **opts(name)))
             for name in names if not interp or name in ("present", "all")]
    if not interp:
        again = {"compress": ["used", "int"], "reduce": ["used", "int"]}.get(
            kind, ["used"])
        cases += [(kind, mib, "{}/{}w/{}t".format(*t[:3]), name,
                   echo4.with_options(_tiling(*t), **opts(name)))
                  for t in ECHO_TILINGS[mib] for name in again]
    return cases


def echo_tune_rows(roof, kinds=None) -> list[dict]:
    """echo4's kernels (bf16, B = 128) under each tile-math variant and tiling
    (`echo_tune_cases`): one row per configuration, and a table of the fraction of the
    roofline per variant side by side."""
    c = codecs.get("echo4")
    rows = []
    for kind, mib, label, variant, cfg in echo_tune_cases(kinds=kinds):
        try:
            r = measure(kind, "triton", c, int(mib * MIB) // 2, roof, cfg)
            r.pop("device_kernels", None)
        except Exception as e:   # a config that does not compile or launch is a finding
            r = {"kernel": kind, "codec": c.name, "mib": mib,
                 "error": f"{type(e).__name__}: {str(e)[:300]}"}
        r.update(tiling=label, variant=variant, pairs=cfg.pairs, lean=cfg.lean,
                 scale_words=cfg.scale_words, scale_columns=cfg.scale_columns,
                 merged_rows=cfg.merged_rows, word_stores=cfg.word_stores,
                 prefetch=cfg.prefetch, pack_mad=cfg.pack_mad, int_stats=cfg.int_stats,
                 elements_per_tile=cfg.blocks_per_program * 128, num_warps=cfg.num_warps,
                 tiles_per_program=cfg.tiles_per_program, num_stages=cfg.num_stages)
        rows.append(r)
        print(r, flush=True)
    print_echo_tune(rows)
    return rows


def print_echo_tune(rows: list[dict]) -> None:
    """One line per kernel, size and tiling: each variant's fraction of the device-timed
    roofline (host-timed where there is no device time; "err" where it failed)."""
    key = lambda r: (r["kernel"], r["mib"], r["tiling"])
    table = {}
    for r in rows:
        frac = r.get("device_fraction", r.get("host_fraction"))
        table.setdefault(key(r), {})[r["variant"]] = "err" if "error" in r else frac
    cols = ["kernel", "mib", "tiling", *ECHO_VARIANTS]
    print_table([{"kernel": k, "mib": m, "tiling": t, **v} for (k, m, t), v in table.items()],
                cols)


def hlo_custom_calls() -> dict:
    """Custom-call targets of compress → decompress per implementation (compiled)."""
    if INTERP:
        return {}
    c = codecs.get("taco")
    x = jnp.ones((1024, 256), jnp.bfloat16)
    fns = {"triton": lambda v: decompress.decompress(compress.compress(v, c), c),
           "mosaic": lambda v: mosaic.decompress(mosaic.compress(v, c), c)}
    out = {}
    for impl, fn in fns.items():
        txt = jax.jit(fn).lower(x).compile().as_text()
        out[impl] = sorted({l.split("custom_call_target=")[1].split(",")[0]
                            for l in txt.splitlines() if "custom_call_target=" in l})
    return out


# what a run writes of its own, never carried over by --update
RUN_KEYS = ("device", "platform", "n_devices", "jax", "commit", "xla_flags", "custom_calls",
            "roofline", "rows", "command")


def kept_from(path: str, facts: dict, codecs_timed) -> dict:
    """--update: what of the results file at `path` the new run keeps — the timing rows of
    codecs it does not time (tagged `measured_at` with their commit) and the sections it
    does not write (labelled `<section>_commit` unless they are). {} when there is no file.
    Raises SystemExit naming the field when the file is unreadable or from another device
    or jax version (rows of two machines are not comparable)."""
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            old = json.load(f)
        rows = old["rows"]
        assert isinstance(rows, list)
    except (OSError, ValueError, KeyError, AssertionError, TypeError) as e:
        raise SystemExit(f"bench.kernels --update: {path} is not a kernels results file "
                         f"({type(e).__name__}: {e})") from None
    for key in ("device", "platform", "jax"):
        if old.get(key) != facts.get(key):
            raise SystemExit(f"bench.kernels --update: {path} has {key}={old.get(key)!r}, "
                             f"this run {facts.get(key)!r}: re-time every codec instead")
    commit = old.get("commit")
    out = {"rows": [{**r, "measured_at": r.get("measured_at", commit)} for r in rows
                    if r.get("codec") not in codecs_timed]}
    for key, value in old.items():
        if key in RUN_KEYS or key.endswith("_commit"):
            continue
        out[key] = value
        if isinstance(value, (list, dict)) and f"{key}_commit" not in old:
            out[f"{key}_commit"] = commit
        elif f"{key}_commit" in old:
            out[f"{key}_commit"] = old[f"{key}_commit"]
    return out


def own(result: dict, key: str) -> None:
    """This run writes section `key`: drop what --update carried of an earlier one's."""
    for k in (key, f"{key}_commit", f"{key}_note", f"{key}_done"):
        result.pop(k, None)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-mib", type=float, nargs="+", default=[16, 64, 256, 1024])
    ap.add_argument("--impls", nargs="+", default=["triton", "mosaic"],
                    choices=["triton", "mosaic"])
    ap.add_argument("--codecs", nargs="+", default=["taco"])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--check-shard", default="0/1", metavar="I/N",
                    help="check only cases I, I+N, ... (and no timings when N > 1)")
    ap.add_argument("--stages", action="store_true")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--tune-kernels", nargs="+", default=None,
                    choices=[k for k, _ in ECHO_TUNE_AT],
                    help="echo4's --tune: only these kernels (default all four)")
    ap.add_argument("--no-timings", action="store_true",
                    help="no timing rows: only --check, --tune or --stages")
    ap.add_argument("--out", default="bench/results/kernels.json")
    ap.add_argument("--update", action="store_true",
                    help="re-time only --codecs; keep the rest of --out (tagged with its "
                         "commit)")
    args = ap.parse_args(argv)
    shard = tuple(int(v) for v in args.check_shard.split("/"))
    if len(shard) != 2 or not 0 <= shard[0] < shard[1]:
        ap.error(f"--check-shard {args.check_shard!r}: want I/N with 0 <= I < N")
    if shard[1] > 1:            # one shard of the check: no timings, no Mosaic check twice
        result = {**env_facts(), "check_shard": args.check_shard, "check": []}
        check_triton(result["check"], lambda: write_json(args.out, result), shard)
        result["check_done"] = True
        write_json(args.out, result)
        return result
    if args.no_timings and not (args.check or args.tune or args.stages):
        ap.error("--no-timings leaves nothing to run without --check, --tune or --stages")
    facts = env_facts()
    timed = set() if args.no_timings else set(args.codecs)
    kept = kept_from(args.out, facts, timed) if args.update else {}
    result = {**facts, "custom_calls": hlo_custom_calls()}
    print(facts, "custom calls:", result["custom_calls"], flush=True)
    roof_bytes = 256 * MIB if not INTERP else 1 << 16
    result["roofline"] = roofline(roof_bytes)
    roof = result["roofline"]
    print(f"roofline (XLA f32 x+1, {roof_bytes / MIB:g} MiB): host {roof['host_gbs']:.0f} "
          f"GB/s, device {roof['device_gbs'] or 0:.0f} GB/s", flush=True)
    # The timings first, each phase written when done: a run stopped by a time limit keeps
    # what it measured.
    result.update({k: v for k, v in kept.items() if k != "rows"})
    rows = result["rows"] = list(kept.get("rows", []))
    n_kept = len(rows)
    sizes = args.sizes_mib if not INTERP else [0.0625]
    cs = [codecs.get(name) for name in args.codecs]
    echo = [c for c in cs if echo4.covers(c)]
    for c, mib in itertools.product(cs, sizes if not args.no_timings else []):
        for kind, impl in itertools.product(kinds_for(c), args.impls):
            n = int(mib * MIB) // 2                           # bf16 input elements
            if not covers(impl, kind, c, (n // c.block_size, c.block_size), jnp.bfloat16):
                continue
            try:
                rows.append(measure(kind, impl, c, n, roof))
            except Exception as e:   # a kernel that does not compile is a finding, not a stop
                rows.append({"impl": impl, "kernel": kind, "codec": c.name, "mib": mib,
                             "error": f"{type(e).__name__}: {str(e)[:500]}"})
            print({k: v for k, v in rows[-1].items() if k != "device_kernels"}, flush=True)
        write_json(args.out, result)
    if rows[n_kept:]:
        print_table(rows[n_kept:], ["codec", "impl", "kernel", "mib", "device_us",
                                    "device_fraction", "host_us", "host_fraction"])
    write_json(args.out, result)
    if args.check and echo and "triton" in args.impls:   # the 4-bit checks are quick
        own(result, "check_echo")
        result["check_echo"] = []
        check_echo(result["check_echo"], lambda: write_json(args.out, result))
        print_table(result["check_echo"], list(result["check_echo"][0]))
        write_json(args.out, result)
    if args.tune and echo:
        own(result, "tune_echo")
        result["tune_echo"] = echo_tune_rows(roof, args.tune_kernels)
        write_json(args.out, result)
    if args.tune and not INTERP and len(echo) < len(cs):
        own(result, "tune")
        result["tune"] = tune_rows([16, 256], roof)
        write_json(args.out, result)
    if args.stages:
        own(result, "stages")
        result["stages"] = stage_rows(256 * MIB // 2 if not INTERP else 1 << 16, roof)
        write_json(args.out, result)
    if args.check and len(echo) < len(cs):                  # the TACO codecs' kernels
        own(result, "check")
        result["check"] = []
        result["check_done"] = False
        if "mosaic" in args.impls and not INTERP:
            check_mosaic(result["check"])
            write_json(args.out, result)
        if "triton" in args.impls:
            check_triton(result["check"], lambda: write_json(args.out, result))
        result["check_done"] = True
        cols = list(dict.fromkeys(k for r in result["check"] for k in r))
        print_table(result["check"], cols)
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
