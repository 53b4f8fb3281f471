"""EXPERIMENT (session 4): compress/decompress/reduce kernel variants side by side at 256 MiB.

    python bench/exp_variants.py [--mib 256] [--out bench/results/kernel_variants.json]

KernelConfig.exp toggles: T = cast the Hadamard intermediate to bf16 before the transpose,
A = α from Σz0² (Parseval) instead of Σx², C = no clip before the FP8 cast (the scale
bounds |z·g/s| ≤ Qmax already), Q = codes → bf16 directly in decompress, L = tile loaded as
[p, (t, q)], H on the left, reshape (no transpose), H on the right; codes row-major per block.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
from bench.common import env_facts, print_table, time_loop, write_json  # noqa: E402
from bench.kernels import INTERP, roofline_gbs  # noqa: E402
from taco_jax import codecs  # noqa: E402
from taco_jax.ops import common, compress, decompress, reduce  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--mib", type=float, default=256)
ap.add_argument("--quick", action="store_true", help="CPU smoke: one iteration")
ap.add_argument("--out", default="bench/results/kernel_variants.json")
a = ap.parse_args()
MIB = 1 << 20
n = int(a.mib * MIB) // 2
roof = roofline_gbs(int(a.mib * MIB))
print(f"roofline {roof:.0f} GB/s", flush=True)
B = 256
nb = n // B
x = (jax.random.normal(jax.random.key(0), (nb, B), jnp.float32) * 0.02).astype(jnp.bfloat16)


def cfg(exp="", tm=16, warps=4, stages=3):
    return common.KernelConfig(blocks_per_program=tm, num_warps=warps, num_stages=stages,
                               exp=exp)


RUNS = []
for e in ("", "T", "A", "C", "TA", "TAC", "L"):
    RUNS.append(("compress", "taco", cfg(e)))
for e in ("", "C"):
    RUNS.append(("compress", "block-fp8", cfg(e)))
for tm, w in ((8, 4), (32, 4), (16, 8), (32, 8)):
    RUNS.append(("compress", "taco", cfg("TAC", tm, w)))
    RUNS.append(("compress", "taco", cfg("L", tm, w)))
for e in ("", "T", "Q", "TQ", "L"):
    RUNS.append(("decompress", "taco", cfg(e)))
for tm, w in ((8, 4), (32, 4), (16, 8), (32, 8)):
    RUNS.append(("decompress", "taco", cfg("TQ", tm, w)))
    RUNS.append(("decompress", "taco", cfg("L", tm, w)))
for e in ("", "TACQ"):
    RUNS.append(("reduce", "taco", cfg(e)))
RUNS.append(("compress", "taco", cfg("")))       # drift check: baselines again at the end
RUNS.append(("decompress", "taco", cfg("")))

rows = []
for kind, name, c in RUNS:
    co = codecs.get(name)
    row = co.row_bytes
    if kind == "compress":
        fn, arg, nbytes = (lambda v, c=c, co=co: compress.compress(v, co, c, INTERP)), x, \
            n * 2 + nb * row
    elif kind == "decompress":
        w = compress.compress(x, co, interpret=INTERP)
        fn, arg, nbytes = (lambda v, c=c, co=co: decompress.decompress(
            v, co, jnp.bfloat16, c, INTERP)), w, nb * row + n * 2
    else:
        w = compress.compress(x, co, interpret=INTERP)
        fn, arg, nbytes = (lambda v, c=c, co=co: reduce.reduce(
            v, x, jnp.int32(0), co, c, INTERP)), jnp.stack([w, w]), 3 * nb * row + n * 2
    r = {"kernel": kind, "codec": name, "exp": c.exp, "tm": c.blocks_per_program,
         "warps": c.num_warps}
    try:
        us = time_loop(fn, arg, *((1, 1) if a.quick else ()))
        r.update(us=round(us, 1), fraction_of_roofline=round(nbytes / us / 1e3 / roof, 3))
    except Exception as e:  # noqa: BLE001 - a variant that fails to compile is a finding
        r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    rows.append(r)
    print(r, flush=True)
print_table([r for r in rows if "us" in r],
            ["kernel", "codec", "exp", "tm", "warps", "us", "fraction_of_roofline"])
write_json(a.out, {**env_facts(), "mib": a.mib, "roofline_gbs": round(roof, 1), "rows": rows})
