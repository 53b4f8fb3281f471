"""End-to-end training step on a (data, pipe, tp) mesh: compression off and on per axis, side
by side in one run.

    python -m bench.train_step [--presets comm_heavy small 350m] [--mesh DATA,PIPE,TP]
        [--microbatches M] [--variants none tp dp+pp 3d] [--codec-tp taco]
        [--codec-pp tah4] [--codec-dp taco] [--steps 20] [--set KEY=VALUE ...] [--out PATH]

A variant is `SPEC` or `SPEC@min_bytes`:
  none          every axis exact (the baseline);
  a codec name  that codec on every axis, as `codec=NAME` (`taco`, `taco@default`);
  axes          `tp`, `pp`, `dp` joined by `+` (`dp+pp`; `2d` = dp+pp, `3d` = dp+pp+tp):
                those axes compressed with --codec-tp / --codec-pp / --codec-dp, the others
                exact;
  ...+sp        any of these with Megatron sequence parallelism (`sp` alone: none+sp).
min_bytes: 0 (the default) compresses every collective, `default` leaves the library's size
threshold. Each variant is set as the run's recipe and model codec fields, compiles once,
runs 2 warm-up steps, then `--steps` timed steps on fixed random tokens (speed does not
depend on the text). `--mesh` (default: the preset's parallel.*; `--tp N` sets tp alone)
and `--microbatches` (default: the preset's) apply to every variant.

Writes bench/results/train_step.json: per row tokens/s, step time, speedup against the
"none" row of the same preset, the pipeline's bubble fraction, the bytes each device sends
per step (`telemetry.wire_bytes` over the step's call sites) and the compiled step's
temporary memory per device (`temp_mib`: activations kept for the backward pass and work
buffers, from XLA's memory analysis).
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

import taco_jax
from bench.common import env_facts, print_table, write_json
from models import parallel, pipeline
from train import config as config_lib
from train.loop import (build_mesh, make_train_step, setup_backend, step_memory,
                        step_wire_bytes)

AXES = ("tp", "pp", "dp")
ALIASES = {"2d": ("dp", "pp"), "3d": ("dp", "pp", "tp")}


def variant_codecs(spec: str, codec_tp: str, codec_pp: str, codec_dp: str) -> dict:
    """A variant's SPEC (without @min_bytes and +sp) -> {"tp", "pp", "dp"} codec names."""
    if spec == "none" or spec in taco_jax.codecs.names():
        return dict.fromkeys(AXES, spec)
    axes = ALIASES.get(spec) or tuple(spec.split("+"))
    bad = [a for a in axes if a not in AXES]
    if bad or not axes:
        raise ValueError(f"variant {spec!r}: expected none, a codec name "
                         f"{list(taco_jax.codecs.names())}, 2d, 3d, or axes from {list(AXES)} "
                         f"joined by '+'")
    chosen = {"tp": codec_tp, "pp": codec_pp, "dp": codec_dp}
    return {a: chosen[a] if a in axes else "none" for a in AXES}


def split_variant(variant: str) -> tuple[str, bool, str]:
    """'3d+sp@default' -> ('3d', True, 'default'): the codec spec, sequence parallelism,
    min_bytes."""
    spec, _, min_bytes = variant.partition("@")
    sp = spec == "sp" or spec.endswith("+sp")
    spec = "none" if spec == "sp" else spec.removesuffix("+sp")
    return spec, sp, min_bytes


def variant_overrides(variant: str, codecs: dict) -> list[str]:
    """Config overrides of one variant: its codecs per axis, the model's fields following
    the TP one, sequence parallelism, and its min_bytes for every collective."""
    _, sp, min_bytes = split_variant(variant)
    return [f"model.sequence_parallel={str(sp).lower()}", f"recipe.codec={codecs['tp']}",
            f"model.codec_fwd={codecs['tp']}", f"model.codec_bwd={codecs['tp']}",
            "model.codec_head=null", f"recipe.codec_pp={codecs['pp']}",
            f"recipe.codec_dp={codecs['dp']}", "model.min_bytes=null",
            f"recipe.min_bytes={'null' if min_bytes == 'default' else int(min_bytes or 0)}"]


def measure(preset: str, variant: str, codecs: dict, steps: int, extra: list[str]) -> dict:
    overrides = ["train.progress=false", *extra, *variant_overrides(variant, codecs)]
    cfg = config_lib.load_config(preset, overrides)
    setup_backend(cfg)   # parallel.cpu_devices on CPU (before JAX starts; later: kept)
    mesh = build_mesh(cfg)
    init, step = make_train_step(cfg, mesh)
    state = init(cfg.train.seed)
    rng = np.random.default_rng(0)
    shape = (cfg.train.batch_size, cfg.model.seq_len)
    x = parallel.put_batch(rng.integers(0, cfg.model.vocab_size, shape, dtype=np.int32), mesh)
    y = parallel.put_batch(rng.integers(0, cfg.model.vocab_size, shape, dtype=np.int32), mesh)
    t0 = time.perf_counter()
    (state, m), sites = taco_jax.telemetry.traced_sites(step, state, x, y)
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t0
    memory = step_memory(step, state, x, y) or {}
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
    shape_of = dict(mesh.shape)
    pipe = shape_of.get("pipe", 1)
    return {"preset": preset,
            "mesh": f"{shape_of['data']}x{pipe}x{shape_of.get('tp', cfg.parallel.emulate_tp)}",
            "microbatches": cfg.parallel.microbatches, "variant": variant,
            "codec_tp": codecs["tp"], "codec_pp": codecs["pp"], "codec_dp": codecs["dp"],
            "min_bytes": split_variant(variant)[2] or "0",
            "tokens_per_s": round(shape[0] * shape[1] / step_s),
            "step_ms": round(step_s * 1e3, 2),
            "bubble_fraction": round(pipeline.bubble_fraction(
                pipe, cfg.parallel.microbatches), 4),
            "compile_s": round(compile_s, 1),
            "sequence_parallel": cfg.model.sequence_parallel,
            "temp_mib": round(memory["temp"] / 2**20, 2) if memory else None,
            "wire_mib_per_step": round(step_wire_bytes(sites) / 2**20, 3),
            "compressed_sites": sum(n for s, n in sites if s.compressed),
            "loss_after_warmup": round(float(m["loss"]), 4)}


def mesh_overrides(mesh: str, tp: int | None) -> list[str]:
    """--mesh DATA,PIPE,TP and --tp N -> parallel.* overrides."""
    out = []
    if mesh:
        parts = mesh.split(",")
        if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"--mesh {mesh!r} must be DATA,PIPE,TP (three integers, "
                             f"0 = the devices left for data or tp)")
        out += [f"parallel.{k}={int(v)}" for k, v in zip(("data", "pipe", "tp"), parts)]
    if tp is not None:
        out.append(f"parallel.tp={tp}")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="+", default=["comm_heavy", "small", "350m"])
    ap.add_argument("--variants", nargs="+", default=["none", "tp", "dp+pp", "3d"])
    ap.add_argument("--mesh", default="", help="DATA,PIPE,TP (default: the preset's)")
    ap.add_argument("--tp", type=int, default=None, help="parallel.tp alone (0 = the rest)")
    ap.add_argument("--microbatches", type=int, default=None,
                    help="GPipe micro-batches per data shard (default: the preset's)")
    ap.add_argument("--codec-tp", default="taco", help="codec of the TP sites in axis variants")
    ap.add_argument("--codec-pp", default="tah4", help="codec of the pipeline hand-offs")
    ap.add_argument("--codec-dp", default="taco", help="codec of the data-parallel gradients")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--set", nargs="*", default=[], help="extra config overrides")
    ap.add_argument("--out", default="bench/results/train_step.json")
    args = ap.parse_args(argv)
    extra = mesh_overrides(args.mesh, args.tp)
    if args.microbatches is not None:
        extra.append(f"parallel.microbatches={args.microbatches}")
    extra += args.set
    plans = [(v, variant_codecs(split_variant(v)[0], args.codec_tp, args.codec_pp,
                                args.codec_dp)) for v in args.variants]   # bad names: now
    rows = []
    for preset in args.presets:
        base = None
        for variant, codecs in plans:
            row = measure(preset, variant, codecs, args.steps, extra)
            if base is None and set(codecs.values()) == {"none"}:
                base = row["step_ms"]
            row["speedup_vs_none"] = round(base / row["step_ms"], 3) if base else None
            rows.append(row)
            print_table(rows[-1:], list(row))
    print_table(rows, list(rows[0]))
    write_json(args.out, {**env_facts(), "rows": rows})


if __name__ == "__main__":
    main()
