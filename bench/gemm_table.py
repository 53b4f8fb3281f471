"""Per-shape GEMM times on one GPU: each Megatron GEMM of a preset's step at TP = P, forward,
dX and dW, whole and cut into P chunks of the sequence as collective matmul runs it. The
input of bench.step_projection's overlapped variants (without it they take FLOP counts).

    python -m bench.gemm_table [--presets 350m] [--p 2 4 8] [--gemms qkv proj fc1 fc2 head]
                               [--set KEY=VALUE ...] [--out bench/results/gemm_table.json]

Shapes per device (T = batch × seq_len tokens; K, N the whole weight's; bench.step_projection
.gemms): a column-parallel GEMM (qkv, fc1, head) holds N/P columns, a row-parallel one (proj,
fc2) K/P rows. fwd: (T, k) @ (k, n); dx: the output's gradient times the weight transposed;
dw: the input transposed times the output's gradient. Chunked: P GEMMs one after another,
each over T/P tokens (fwd and dx: rows of the output; dw: a slice of the contraction,
accumulated in f32), an optimization barrier between them so that XLA keeps them apart, as
the P steps of a collective matmul are. bf16 operands, f32 accumulation, bf16 out.

Times are device time (bench.common.device_time: the GPU kernels under the profiler), the
host timer where there is no GPU (tests). chunk_efficiency = whole / chunked time.
"""
from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
from jax import lax

from bench import step_projection
from bench.common import device_time, env_facts, print_table, write_json

OUT = "bench/results/gemm_table.json"
PASSES = ("fwd", "dx", "dw")


def shapes(shape: dict, p: int, gemms=None) -> list[dict]:
    """[{"gemm", "pass", "m", "k", "n", "split"}] per device at TP = P; split: the dimension
    the P chunks cut ("m" for fwd and dx, "k" for dw: the tokens)."""
    t, out = shape["tokens"], []
    for g, (k, n, _) in step_projection.gemms(shape).items():
        if gemms and g not in gemms:
            continue
        if g in step_projection.COLUMN:
            n //= p
        else:
            k //= p
        for ps, (mm, kk, nn) in zip(PASSES, ((t, k, n), (t, n, k), (k, t, n))):
            out.append({"gemm": g, "pass": ps, "m": mm, "k": kk, "n": nn,
                        "split": "k" if ps == "dw" else "m"})
    return out


def matmul(split: str, chunks: int):
    """(a (m, k), b (k, n)) -> a @ b in `chunks` GEMMs along `split` (1: one GEMM)."""
    def whole(x):
        a, b = x
        return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype)

    def chunked(x):
        a, b = x
        dim = a.shape[0] if split == "m" else a.shape[1]
        step = dim // chunks
        acc, parts = None, []
        for i in range(chunks):
            if split == "m":                                 # rows of the output
                part = jnp.dot(a[i * step:(i + 1) * step], b,
                               preferred_element_type=jnp.float32).astype(a.dtype)
                a, part = lax.optimization_barrier((a, part))
                parts.append(part)
            else:                                            # a slice of the contraction
                part = jnp.dot(a[:, i * step:(i + 1) * step], b[i * step:(i + 1) * step],
                               preferred_element_type=jnp.float32)
                acc = part if acc is None else acc + part
                a, acc = lax.optimization_barrier((a, acc))
        return jnp.concatenate(parts) if split == "m" else acc.astype(a.dtype)

    return whole if chunks == 1 else chunked


def time_shape(s: dict, p: int, iters: int) -> dict:
    """One row: the GEMM whole and in P chunks, µs per call."""
    key = jax.random.key(0)
    a = jax.random.normal(key, (s["m"], s["k"]), jnp.bfloat16)
    b = jax.random.normal(jax.random.fold_in(key, 1), (s["k"], s["n"]), jnp.bfloat16)
    whole = device_time(matmul(s["split"], 1), (a, b), iters=iters)
    chunked = device_time(matmul(s["split"], p), (a, b), iters=iters)
    timer = "device" if whole["us"] is not None else "host"
    us = whole["us"] if timer == "device" else whole["host_us"]
    cus = chunked["us"] if timer == "device" else chunked["host_us"]
    flops = 2 * s["m"] * s["k"] * s["n"]
    return {**s, "p": p, "flops": flops, "us": round(us, 2), "chunked_us": round(cus, 2),
            "chunk_efficiency": round(us / cus, 3), "tflops": round(flops / us / 1e6, 1),
            "timer": timer}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", default=["350m"])
    ap.add_argument("--p", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--gemms", nargs="+", default=None,
                    help="a subset of qkv proj fc1 fc2 head (default all)")
    ap.add_argument("--iters", type=int, default=5, help="input copies per timed call")
    ap.add_argument("--set", nargs="*", default=[], help="config overrides")
    ap.add_argument("--out", default=OUT)
    a = ap.parse_args(argv)
    rows = []
    for preset in a.presets:
        shape = step_projection.model_shape(preset, a.set)
        for p in a.p:
            for s in shapes(shape, p, a.gemms):
                rows.append({"preset": preset, **time_shape(s, p, a.iters)})
                print_table(rows[-1:], list(rows[-1]))
    print_table(rows, list(rows[0]) if rows else [])
    write_json(a.out, {**env_facts(), "command": "python -m bench.gemm_table "
                       + " ".join(argv if argv is not None else sys.argv[1:]),
                       "presets": a.presets, "p": a.p, "overrides": a.set, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
