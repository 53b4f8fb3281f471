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

A variant may name the transport of its compressed collectives after a colon,
`SPEC:TRANSPORT[@min_bytes]` (`taco:xla`, `taco:fused`, `echo4:fused`): the run is traced
under `taco_jax.config(transport=TRANSPORT)`; without one, the library's default.
`SPEC:overlap` (`none:overlap`, `taco:overlap`, `echo4:overlap`) runs the model's collective
matmul instead: `model.tp_overlap=true` with `model.sequence_parallel=true` (the all-gather
before each column-parallel GEMM and the reduce-scatter after each row-parallel one, hidden
under the GEMM), the codec SPEC's, the library's default transport. Where the variants
have an overlapped one, `sp` (the same sequence parallelism with its collectives serial,
codec none) runs too, before it, unless named; each overlap row's `speedup_vs_sp` is
against it, beside `speedup_vs_none`.

Writes bench/results/train_step.json: per row tokens/s, step time, speedup against the
"none" row of the same preset, the pipeline's bubble fraction, the bytes each device sends
per step (`telemetry.wire_bytes` over the step's call sites) and the compiled step's
temporary memory per device (`temp_mib`: activations kept for the backward pass and work
buffers, from XLA's memory analysis).

Emulated tensor parallelism, `--emulate-tp N [N ...]` (with `--mesh 1,1,1`): each preset at
each N, `parallel.emulate_tp=N` (the N tensor-parallel members under jax.vmap on one device:
N members' compute, the all-reduces sums over the vmapped axis), every variant side by side.
Rows add `emulate_tp`, `transport`, `added_ms` (the step minus the "none" row of the same
preset and N) and `sites`: per call site of the step its op, axes, shape, dtype, bytes per
device, calls per step, compressed or plain (codec, transport), and the all-reduces it runs
per step (`allreduces_per_step`: a psum's forward, a pvary's backward, and a psum's
transpose where it was traced under check_vma=False). A variant that fails (a transport
this device lacks, out of memory) is a row with its `error`; the others still run. Writes
bench/results/train_step_emulated.json, the input of `python -m bench.step_projection`;
`--update` keeps that file's rows of the (preset, N) not measured now (one preset per call
where a call's time is bounded), each with the commit it was measured at.
"""
from __future__ import annotations

import argparse
import contextlib
import json
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
OUT = "bench/results/train_step.json"
EMULATED_OUT = "bench/results/train_step_emulated.json"
OVERLAP = "overlap"               # `SPEC:overlap`: collective matmul (model.tp_overlap)
SP_BASELINE = "sp"                # an overlap row's baseline: sequence parallelism, serial
# the ops whose call runs one all-reduce (psum forward, pvary backward)
ALLREDUCE_OPS = ("psum", "pvary", "psum_with_feedback", "pvary_with_feedback")


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


def split_transport(variant: str) -> tuple[str, str | None]:
    """'taco:fused@default' -> ('taco@default', 'fused'): the variant without its transport,
    and the transport (None: the library's default; OVERLAP: the model's collective
    matmul)."""
    head, at, min_bytes = variant.partition("@")
    spec, colon, transport = head.partition(":")
    if not colon:
        return variant, None
    if transport == OVERLAP:
        return spec + at + min_bytes, OVERLAP
    try:
        taco_jax.Recipe(transport=transport)
    except ValueError as e:
        raise ValueError(f"variant {variant!r}: {e}") from None
    return spec + at + min_bytes, transport


def allreduces_per_step(site: taco_jax.telemetry.Site, calls: int) -> int:
    """All-reduces one step runs through a site: a psum's forward (and its transpose, an
    all-reduce too, where traced under check_vma=False), a pvary's backward; 0 for the other
    ops and for an axis of one device."""
    if site.p <= 1 or site.op not in ALLREDUCE_OPS:
        return 0
    return calls * (2 if site.op in taco_jax.telemetry.PSUM_OPS and not site.vma else 1)


def site_rows(sites: list) -> list[dict]:
    """[(site, calls)] -> what a projection of the step needs of each call site."""
    return [{"op": s.op, "axes": list(s.axes), "p": s.p, "shape": list(s.shape),
             "dtype": s.dtype, "bytes": s.bytes_per_device, "calls": n,
             "compressed": s.compressed, "codec": s.codec, "transport": s.transport or None,
             "reason": s.reason, "vma": s.vma, "allreduces_per_step": allreduces_per_step(s, n),
             "wire_bytes_per_step": step_wire_bytes([(s, n)])}
            for s, n in sorted(sites, key=lambda sn: (sn[0].op, sn[0].shape, sn[0].codec))]


def variant_overrides(variant: str, codecs: dict, overlap: bool = False) -> list[str]:
    """Config overrides of one variant: its codecs per axis, the model's fields following
    the TP one, sequence parallelism (on with `overlap`, which also sets the model's
    collective matmul, model.tp_overlap), and its min_bytes for every collective."""
    _, sp, min_bytes = split_variant(variant)
    sp = sp or overlap
    return [f"model.sequence_parallel={str(sp).lower()}",
            *(["model.tp_overlap=true"] if overlap else []), f"recipe.codec={codecs['tp']}",
            f"model.codec_fwd={codecs['tp']}", f"model.codec_bwd={codecs['tp']}",
            "model.codec_head=null", f"recipe.codec_pp={codecs['pp']}",
            f"recipe.codec_dp={codecs['dp']}", "model.min_bytes=null",
            f"recipe.min_bytes={'null' if min_bytes == 'default' else int(min_bytes or 0)}"]


def measure(preset: str, variant: str, codecs: dict, steps: int, extra: list[str],
            transport: str | None = None, sites_out: list | None = None) -> dict:
    """One variant's row. `variant` without its transport; `transport` the taco_jax
    transport it is traced under (None: the default; OVERLAP: the model's collective
    matmul, the default transport). `sites_out` receives the step's [(site, calls)]."""
    overlap = transport == OVERLAP
    recipe = (taco_jax.config(transport=transport) if transport and not overlap
              else contextlib.nullcontext())
    with recipe:
        return _measure(preset, variant, codecs, steps, extra, sites_out, overlap)


def _measure(preset, variant, codecs, steps, extra, sites_out, overlap=False) -> dict:
    overrides = ["train.progress=false", *extra, *variant_overrides(variant, codecs, overlap)]
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
    if sites_out is not None:
        sites_out.extend(sites)
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
            "tp_overlap": cfg.model.tp_overlap,
            "temp_mib": round(memory["temp"] / 2**20, 2) if memory else None,
            "wire_mib_per_step": round(step_wire_bytes(sites) / 2**20, 3),
            "compressed_sites": sum(n for s, n in sites if s.encoded),
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


def misfit(preset: str, n: int, extra: list[str]) -> str | None:
    """Why the preset's model cannot split over tp = n (its heads, widths or sequence), or
    None: such a (preset, n) is skipped rather than recorded as error rows."""
    cfg = config_lib.load_config(preset, ["train.progress=false", *extra])  # bad ones raise
    try:
        cfg.model.validate(n)
    except ValueError as e:
        return str(e)
    return None


def emulated_row(preset: str, n: int, variant: str, plain: str, transport, codecs,
                 steps: int, extra: list[str]) -> dict:
    """One variant at emulate_tp=n: measure's row with the step's sites, or its error."""
    head = {"preset": preset, "emulate_tp": n, "variant": variant,
            "transport": transport or "default"}
    sites: list = []
    try:
        row = measure(preset, plain, codecs, steps, [*extra, f"parallel.emulate_tp={n}"],
                      transport, sites)
    except Exception as e:       # noqa: BLE001 -- recorded; the other variants still run
        return {**head, "codec_tp": codecs["tp"], "step_ms": None,
                "error": f"{type(e).__name__}: {str(e)[:500]}"}
    row = {**head, **row, "variant": variant}
    row["allreduces_per_step"] = sum(allreduces_per_step(s, k) for s, k in sites)
    row["sites"] = site_rows(sites)
    return row


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
    ap.add_argument("--emulate-tp", type=int, nargs="+", default=None, metavar="N",
                    help="tensor parallelism emulated on one device, each preset at each N")
    ap.add_argument("--update", action="store_true",
                    help="with --emulate-tp: keep the out file's rows of the (preset, N) "
                         "this run does not measure, each with the commit it was measured at")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--set", nargs="*", default=[], help="extra config overrides")
    ap.add_argument("--out", default=None,
                    help=f"default {OUT}, with --emulate-tp {EMULATED_OUT}")
    args = ap.parse_args(argv)
    extra = mesh_overrides(args.mesh, args.tp)
    if args.microbatches is not None:
        extra.append(f"parallel.microbatches={args.microbatches}")
    extra += args.set
    if args.emulate_tp and min(args.emulate_tp) < 1:
        raise ValueError(f"--emulate-tp {args.emulate_tp}: each N must be >= 1")
    plans = []
    for v in with_sp_baseline(args.variants):                        # bad names: now
        plain, transport = split_transport(v)
        plans.append((v, plain, transport, variant_codecs(
            split_variant(plain)[0], args.codec_tp, args.codec_pp, args.codec_dp)))
    rows, skipped = [], set()
    for preset in args.presets:
        for n in args.emulate_tp or [None]:
            why = misfit(preset, n, extra) if n is not None else None
            if why is not None:
                print(f"[train_step] {preset} at emulated tp={n}: skipped ({why})")
                skipped.add((preset, n))
                continue
            base = base_sp = None
            for variant, plain, transport, codecs in plans:
                if n is None:
                    row = measure(preset, plain, codecs, args.steps, extra, transport)
                    row["variant"] = variant
                    if transport:
                        row["transport"] = transport
                else:
                    row = emulated_row(preset, n, variant, plain, transport, codecs,
                                       args.steps, extra)
                step = row["step_ms"]
                if base is None and step and set(codecs.values()) == {"none"}:
                    base = step
                row["speedup_vs_none"] = round(base / step, 3) if base and step else None
                if variant == SP_BASELINE and step:
                    base_sp = step
                if transport == OVERLAP:
                    row["speedup_vs_sp"] = round(base_sp / step, 3) if base_sp and step else None
                if n is not None:
                    row["added_ms"] = round(step - base, 2) if base and step else None
                rows.append(row)
                print_table(rows[-1:], [k for k in row if k != "sites"])
    cols = list(dict.fromkeys(k for r in rows for k in r if k != "sites"))
    print_table(rows, cols)
    payload = {**env_facts(), "rows": rows}
    out = args.out or (EMULATED_OUT if args.emulate_tp else OUT)
    if args.emulate_tp and args.update:
        rows = kept_rows(out, {(r["preset"], r["emulate_tp"]) for r in rows} | skipped) + rows
    if args.emulate_tp:
        payload = {**env_facts(), "mode": "emulated tensor parallelism (parallel.emulate_tp)",
                   "emulate_tp": args.emulate_tp, "presets": args.presets,
                   "variants": args.variants, "steps": args.steps, "overrides": extra,
                   "rows": rows}
    write_json(out, payload)


def with_sp_baseline(variants: list[str]) -> list[str]:
    """The variants, with the serial sequence-parallel step (SP_BASELINE) before the first
    overlapped one where they have one and lack it: an overlap row's fair baseline is the
    same sequence parallelism without the overlap (`speedup_vs_sp`), beside "none"."""
    if SP_BASELINE in variants:
        return list(variants)
    for i, v in enumerate(variants):
        if split_transport(v)[1] == OVERLAP:
            return [*variants[:i], SP_BASELINE, *variants[i:]]
    return list(variants)


def kept_rows(path: str, measured: set) -> list[dict]:
    """--update: the rows of `path` whose (preset, emulate_tp) this run did not measure
    (nor skip: a model that cannot split there keeps no rows), each naming the commit it
    was measured at ("measured_at")."""
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return []
    return [{**r, "measured_at": r.get("measured_at") or old.get("commit")}
            for r in old.get("rows", []) if (r.get("preset"), r.get("emulate_tp"))
            not in measured]


if __name__ == "__main__":
    main()
