"""Kernel benchmark: fused compress / decompress / reduce vs the HBM roofline.

    python bench/kernels.py [--sizes-mib 16 64 256 1024] [--sweep] [--stages] [--check]
                            [--tilings] [--out PATH]

roofline_gbs is a plain XLA f32 `x + 1` (bytes read + written) measured in the same run;
effective bytes of a kernel = bytes it reads + bytes it writes. Every time here (kernels,
roofline) is `time_calls`: calls back to back in straight-line code, no while loop (whose
~16 µs per trip the session-1–6 results carry, docs/results.md). Writes
bench/results/kernels.json. --check compares every kernel with its jnp reference on this
device; --sweep times tiling configs at 256 MiB (docs/design.md records the choice);
--stages times the compress kernel with parts of its work taken away (at 256 MiB): a Pallas
copy with the same tiling and wire layout (the plumbing's ceiling; also codes only), no
transform (block-fp8), Hadamard without α (taco-1scale), taco, and taco with the IEEE
per-block math; --tilings times tilings per kernel (TILINGS), A B A B; --overhead times
the timers' own cost (while loop vs straight-line calls). --check also checks
the IEEE kernels (fast_rowmath off) against the references.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
from bench.common import env_facts, print_table, time_calls, time_loop, write_json  # noqa: E402
from taco_jax import codecs  # noqa: E402
from taco_jax.kernels import compress, decompress, reduce, tiling as common  # noqa: E402

MIB = 1 << 20
INTERP = jax.default_backend() != "gpu"   # CPU smoke runs use the Pallas interpreter


def roofline_gbs(n_bytes: int) -> float:
    x = jnp.ones(n_bytes // 4, jnp.float32)
    us = time_calls(lambda v: v + 1, x)
    return 2 * n_bytes / us / 1e3


def bench_kernel(kind, codec, n, cfg=None, dtype=jnp.bfloat16, peers=2):
    b, row = codec.block_size, codec.row_bytes
    nb = n // b
    key = jax.random.key(0)
    x = (jax.random.normal(key, (nb, b), jnp.float32) * 0.02).astype(dtype)
    isz = jnp.dtype(dtype).itemsize
    if kind == "compress":
        fn = lambda v: compress.compress(v, codec, cfg, INTERP)
        arg, nbytes = x, n * isz + nb * row
    elif kind == "decompress":
        w = compress.compress(x, codec, cfg, INTERP)
        fn = lambda v: decompress.decompress(v, codec, dtype, cfg, INTERP)
        arg, nbytes = w, nb * row + n * isz
    else:  # reduce: P received copies + own segment → one compressed segment
        w = compress.compress(x, codec, cfg, INTERP)
        recv = jnp.stack([w] * peers)
        fn = lambda v: reduce.reduce(v, x, jnp.int32(0), codec, cfg, INTERP)
        arg, nbytes = recv, peers * nb * row + n * isz + nb * row
    us = time_calls(fn, arg)
    return us, nbytes / us / 1e3


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


def stage_rows(n: int, roof: float) -> list[dict]:
    """Compress with parts of its work taken away, at the default tiling: a Pallas copy
    with the wire layout (and codes only), no transform (block-fp8), Hadamard without α
    (taco-1scale), taco; then taco again and the IEEE per-block math (fast_rowmath=False)
    beside the default, so drift shows. Same input (n bf16 elements)."""
    taco = codecs.get("taco")
    b, nb = taco.block_size, n // taco.block_size
    x = (jax.random.normal(jax.random.key(0), (nb, b), jnp.float32) * 0.02).astype(jnp.bfloat16)
    default = common.KernelConfig.default(b, "compress")
    ieee = dataclasses.replace(default, fast_rowmath=False)
    runs = []
    for rb in (taco.row_bytes, b):   # the plumbing's ceiling: the wire row, codes only
        runs.append((f"copy tm={default.blocks_per_program} w={default.num_warps} row={rb}B",
                     lambda v, rb=rb: copy_kernel(v, rb, default), rb))
    for name in ("block-fp8", "taco-1scale", "taco"):
        c = codecs.get(name)
        runs.append((f"compress {name}", lambda v, c=c: compress.compress(v, c, default,
                                                                           INTERP), c.row_bytes))
    for label, cfg in (("compress taco again", default), ("compress taco IEEE rowmath", ieee)):
        runs.append((label, lambda v, cfg=cfg: compress.compress(v, taco, cfg, INTERP),
                     taco.row_bytes))
    rows = []
    for label, fn, rb in runs:
        try:
            us = time_calls(fn, x)
            gbs = (n * 2 + nb * rb) / us / 1e3
            rows.append({"stage": label, "us": round(us, 1), "effective_gbs": round(gbs, 1),
                         "fraction_of_roofline": round(gbs / roof, 3)})
        except Exception as e:  # a variant that does not compile is a finding
            rows.append({"stage": label, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        print(rows[-1], flush=True)
    return rows


# KernelConfig overrides per kernel; the first ({}) is the library default for that kernel
# (8 blocks × 2 warps for B = 256, compress with a loop of 4 tiles; sessions 6 and 7,
# docs/results.md). Below 4 warps (one warpgroup) Triton's dots are mma.sync, not wgmma.
TILINGS = {
    "compress": [{}, {"tiles_per_program": 1},
                 {"num_warps": 1, "blocks_per_program": 4}],
    "decompress": [{}, {"num_warps": 1}],
    "reduce": [{}, {"tiles_per_program": 4}],
}


def tiling_rows(sizes: list[int], roof: float, rounds: int = 3) -> list[dict]:
    """Each kernel (taco, n bf16 elements for n in sizes) under each TILINGS override of
    its default KernelConfig, interleaved over `rounds` (A B … A B …) so drift shows."""
    taco = codecs.get("taco")
    rows = []
    for rnd, n, kind in itertools.product(range(rounds), sizes, TILINGS):
        for over in TILINGS[kind]:
            cfg = dataclasses.replace(common.KernelConfig.default(taco.block_size, kind),
                                      **over)
            us, gbs = bench_kernel(kind, taco, n, cfg)
            rows.append({"kernel": kind, "config": ",".join(f"{k}={v}" for k, v in
                                                              over.items()) or "default",
                         "tm": cfg.blocks_per_program, "warps": cfg.num_warps,
                         "tiles": cfg.tiles_per_program, "round": rnd, "mib": n * 2 / MIB,
                         "us": round(us, 1), "effective_gbs": round(gbs, 1),
                         "fraction_of_roofline": round(gbs / roof, 3)})
            print(rows[-1], flush=True)
    return rows


def overhead_rows(n: int, roof_bytes: int) -> list[dict]:
    """What the timers themselves cost: µs per call of an (almost) empty body, the
    roofline's `x + 1` and the taco kernels at n bf16 elements, timed in a while loop
    (`time_loop`, the benchmarks' timer until session 7) and back to back in straight-line
    code (`time_calls`), A B A B. Nsight Compute's kernel durations (gpu_run.sh ncu_time)
    are the reference."""
    taco = codecs.get("taco")
    x = (jax.random.normal(jax.random.key(0), (n // taco.block_size, taco.block_size),
                           jnp.float32) * 0.02).astype(jnp.bfloat16)
    w = compress.compress(x, taco, interpret=INTERP)
    f = jnp.ones(roof_bytes // 4, jnp.float32)
    runs = [("tiny (1 f32 + 1)", lambda v: v + 1, jnp.ones((1,), jnp.float32)),
            ("roofline x+1", lambda v: v + 1, f),
            ("compress taco", lambda v: compress.compress(v, taco, None, INTERP), x),
            ("decompress taco", lambda v: decompress.decompress(v, taco, jnp.bfloat16,
                                                                None, INTERP), w)]
    rows = []
    for rnd, (label, fn, arg) in itertools.product(range(2), runs):
        row = {"what": label, "round": rnd, "loop_us": round(time_loop(fn, arg), 2),
               "calls_us": round(time_calls(fn, arg), 2)}
        rows.append(row)
        print(row, flush=True)
    return rows


def check(out_rows):
    """Kernel vs jnp reference on this device: code agreement and decoded error."""
    rng = np.random.default_rng(0)
    cases = [(n, b, d, {}) for n, b, d in itertools.product(
        ["taco", "taco-1scale", "taco-e5m2", "taco-int8", "block-fp8"],
        [32, 64, 128, 256, 512], [jnp.bfloat16, jnp.float32, jnp.float16])
        if n == "taco" or (b == 256 and d == jnp.bfloat16)]
    # the IEEE per-block math (fast_rowmath=False), no longer the default
    cases += [("taco", b, d, {"fast_rowmath": False}) for b in (32, 256)
              for d in (jnp.bfloat16, jnp.float32)]
    for name, b, dtype, over in cases:
        c = codecs.get(name, block_size=b)
        cfg = {k: dataclasses.replace(common.KernelConfig.default(b, k), **over)
               for k in ("compress", "decompress", "reduce")}
        fast = cfg["compress"].fast_rowmath
        x = rng.standard_t(3, size=(4099, b)).astype(np.float32) * 0.01
        x[7, 3] = np.nan
        x[11, 0] = np.inf
        x = jnp.asarray(x).astype(dtype)
        wk = compress.compress(x, c, cfg["compress"], interpret=INTERP)
        wr = compress.compress_reference(x, c)
        codes_k, codes_r = np.asarray(wk[:, :b]), np.asarray(wr[:, :b])
        dk = np.asarray(decompress.decompress(wr, c, cfg=cfg["decompress"], interpret=INTERP),
                        np.float64)
        dr = np.asarray(decompress.decompress_reference(wr, c), np.float64)
        fin = np.isfinite(dr)
        recv = jnp.stack([wr, wr])
        rk = np.asarray(decompress.decompress_reference(
            reduce.reduce(recv, x, jnp.int32(1), c, cfg["reduce"], interpret=INTERP), c))
        rr = np.asarray(decompress.decompress_reference(reduce.reduce_reference(recv, x, 1, c), c))
        rfin = np.isfinite(rr)
        out_rows.append({
            "codec": name, "block": b, "dtype": jnp.dtype(dtype).name, "fast_rowmath": fast,
            "codes_differ_frac": float(np.mean(codes_k != codes_r)),
            "decode_max_rel": float(np.max(np.abs(dk[fin] - dr[fin])) / np.max(np.abs(dr[fin]))),
            "nan_rows_match": bool(np.array_equal(np.isnan(dk).any(1), np.isnan(dr).any(1))),
            "reduce_max_rel": float(np.max(np.abs(rk[rfin] - rr[rfin])) / np.max(np.abs(rr[rfin]))),
            "reduce_nan_match": bool(np.array_equal(np.isnan(rk), np.isnan(rr))),
        })
    print_table(out_rows, list(out_rows[0]))


def hlo_custom_calls() -> list[str]:
    c = codecs.get("taco")
    x = jnp.ones((1024, 256), jnp.bfloat16)
    if INTERP:
        return []
    txt = jax.jit(lambda v: decompress.decompress(compress.compress(v, c), c)).lower(x) \
        .compile().as_text()
    return sorted({l.split("custom_call_target=")[1].split(",")[0]
                   for l in txt.splitlines() if "custom_call_target=" in l})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 64, 256, 1024])
    ap.add_argument("--codecs", nargs="+", default=["taco"])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--stages", action="store_true")
    ap.add_argument("--tilings", action="store_true",
                    help="A/B of blocks per tile × warps per kernel at 256 MiB (TILINGS)")
    ap.add_argument("--tilings-mib", type=float, nargs="+", default=[256],
                    help="input sizes (MiB of bf16) for --tilings")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of --tilings")
    ap.add_argument("--overhead", action="store_true",
                    help="the timers' own cost: while loop vs straight-line calls, A B A B")
    ap.add_argument("--out", default="bench/results/kernels.json")
    args = ap.parse_args()
    facts = env_facts()
    result = {**facts, "custom_calls": hlo_custom_calls()}
    print(facts, "custom calls:", result["custom_calls"])
    if args.check:
        result["check"] = []
        check(result["check"])
    result["roofline_gbs"] = roofline_gbs(256 * MIB)
    print(f"roofline (XLA f32 x+1, 256 MiB): {result['roofline_gbs']:.0f} GB/s")
    if args.sweep:
        result["sweep"] = []
        c = codecs.get("taco")
        n = 256 * MIB // 2
        for tm, warps, stages, tiles in itertools.product(
                [8, 16, 32], [4, 8], [2, 3], [1, 8]):
            cfg = common.KernelConfig(tm, warps, stages, None, tiles)
            for kind in ["compress", "decompress"]:
                try:
                    us, gbs = bench_kernel(kind, c, n, cfg)
                except Exception as e:  # a config that does not compile is a finding
                    us, gbs = None, None
                    print(f"{cfg} {kind}: {type(e).__name__}: {str(e)[:200]}")
                result["sweep"].append({"kernel": kind, "tm": tm, "warps": warps,
                                        "stages": stages, "tiles": tiles, "us": us,
                                        "fraction_of_roofline": gbs and gbs / result["roofline_gbs"]})
        print_table(result["sweep"], list(result["sweep"][0]))
    if args.stages:
        result["stages"] = stage_rows(256 * MIB // 2 if not INTERP else 1 << 16,
                                  result["roofline_gbs"])
        print_table(result["stages"], ["stage", "us", "effective_gbs", "fraction_of_roofline"])
    if args.overhead:
        result["overhead"] = overhead_rows(256 * MIB // 2 if not INTERP else 1 << 14,
                                           256 * MIB if not INTERP else 1 << 16)
        print_table(result["overhead"], list(result["overhead"][0]))
    if args.tilings:
        sizes = [int(m * MIB) // 2 if not INTERP else 1 << 14 for m in args.tilings_mib]
        result["tilings"] = tiling_rows(sizes, result["roofline_gbs"], args.rounds)
        print_table(result["tilings"], list(result["tilings"][0]))
    rows = []
    for name in args.codecs:
        c = codecs.get(name)
        for mib in args.sizes_mib:
            n = mib * MIB // 2                                  # bf16 input elements
            for kind in ["compress", "decompress", "reduce"]:
                us, gbs = bench_kernel(kind, c, n)
                rows.append({"kernel": kind, "codec": name, "elements": n, "mib": mib,
                             "us": round(us, 1), "effective_gbs": round(gbs, 1),
                             "fraction_of_roofline": round(gbs / result["roofline_gbs"], 3)})
    result["rows"] = rows
    print_table(rows, list(rows[0]))
    write_json(args.out, result)


if __name__ == "__main__":
    main()
