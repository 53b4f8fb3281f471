"""End-to-end TP training step: codec="none" vs compressed, side by side in one run.

    python -m bench.train_step [--presets comm_heavy small 350m] [--tp 0]
        [--variants none taco taco@default] [--steps 20] [--out PATH]

A variant is `codec` or `codec@min_bytes` (`taco` = compress every all-reduce, min_bytes=0;
`taco@default` = the library's size threshold), set as the run's recipe (`recipe.codec`,
`recipe.min_bytes`) with the model's per-site fields left to it. Each variant compiles once,
runs 3 warm-up steps, then `--steps` timed steps on fixed random tokens (speed does not
depend on the text).
Writes bench/results/train_step.json with tokens/s, step time, speedup vs "none" and the
bytes each device sends per step (`telemetry.wire_bytes` over the step's call sites).
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from bench.common import env_facts, print_table, write_json
from models import parallel
from train import config as config_lib
from train.loop import build_mesh, make_train_step, step_wire_bytes, traced_sites


def measure(preset: str, variant: str, tp: int, steps: int, extra: list[str]) -> dict:
    codec, _, min_bytes = variant.partition("@")
    overrides = [f"recipe.codec={codec}", "model.codec_fwd=", "model.codec_bwd=",
                 "model.codec_head=", "model.min_bytes=-1", f"parallel.tp={tp}",
                 "train.progress=false", *extra]
    overrides.append(f"recipe.min_bytes={-1 if min_bytes == 'default' else int(min_bytes or 0)}")
    cfg = config_lib.load_config(preset, overrides)
    mesh = build_mesh(cfg)
    init, step = make_train_step(cfg, mesh)
    state = init(cfg.train.seed)
    rng = np.random.default_rng(0)
    shape = (cfg.train.batch_size, cfg.model.seq_len)
    x = parallel.put_batch(rng.integers(0, cfg.model.vocab_size, shape, dtype=np.int32), mesh)
    y = parallel.put_batch(rng.integers(0, cfg.model.vocab_size, shape, dtype=np.int32), mesh)
    t0 = time.perf_counter()
    (state, m), sites = traced_sites(step, state, x, y)
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t0
    for _ in range(2):
        state, m = step(state, x, y)
    jax.block_until_ready(m)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, m = step(state, x, y)
        jax.block_until_ready(m["loss"])
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    return {"preset": preset, "tp": int(mesh.shape["tp"]), "codec_fwd": codec,
            "codec_bwd": codec, "min_bytes": min_bytes or "0",
            "tokens_per_s": round(shape[0] * shape[1] / step_s),
            "step_ms": round(step_s * 1e3, 2), "compile_s": round(compile_s, 1),
            "wire_mib_per_step": round(step_wire_bytes(sites) / 2**20, 2),
            "compressed_sites": sum(n for s, n in sites if s.compressed),
            "loss_after_warmup": round(float(m["loss"]), 4)}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="+", default=["comm_heavy", "small", "350m"])
    ap.add_argument("--variants", nargs="+", default=["none", "taco", "taco@default"])
    ap.add_argument("--tp", type=int, default=0, help="0 = every device")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--set", nargs="*", default=[], help="extra config overrides")
    ap.add_argument("--out", default="bench/results/train_step.json")
    args = ap.parse_args(argv)
    rows = []
    for preset in args.presets:
        base = None
        for variant in args.variants:
            row = measure(preset, variant, args.tp, args.steps, args.set)
            base = base or (row["step_ms"] if variant == "none" else None)
            row["speedup_vs_none"] = round(base / row["step_ms"], 3) if base else None
            rows.append(row)
            print_table(rows[-1:], list(row))
    print_table(rows, list(rows[0]))
    write_json(args.out, {**env_facts(), "rows": rows})


if __name__ == "__main__":
    main()
