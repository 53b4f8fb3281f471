"""Where the time goes, from a device profile: the compressed all-reduce per transport, and
the compute / communication / compression breakdown of a TP training step.

    python -m bench.profile psum  [--mib 256] [--codecs taco] [--transports xla fused]
    python -m bench.profile train [--presets comm_heavy small] [--variants none taco]
    common: [--iters 5] [--device 0] [--out bench/results/profile.json]
            [--plot docs/breakdown_{workload}.png] [--keep-trace DIR]

Each workload compiles and warms up, then runs `--iters` iterations under
`jax.profiler.trace` (perfetto JSON). Every kernel on the streams of one GPU (`--device`) is
classed as `comm` (NCCL, the fused transport's exchange kernel and its one-launch
all-reduces, which code and carry the bytes in one kernel), `compression` (the taco_* and
echo4_* Pallas kernels) or `compute` (everything else), and per iteration the program
reports:

  wall_us            span of that GPU's kernels / iters
  <class>_us         time covered by kernels of the class (union of intervals)
  comm_overlap_us    comm time during which a non-comm kernel also runs
  comm_exposed_us    comm_us - comm_overlap_us: the communication nothing hides
  idle_us            wall_us - time covered by any kernel

`psum` rows: codec `none` is lax.psum; others are taco_jax.psum with min_bytes=0 over each
transport that can run here. `train` rows: one training step of the preset (every
all-reduce compressed for codecs other than none, as bench/train_step.py). The JSON also
keeps the 25 longest kernel names per row, so a class can be checked by hand; the plot has
one stacked bar per row (compute, compression, exposed comm, idle; overlapped comm hatched
on top).
"""
from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
import shutil
import tempfile
from collections import defaultdict

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from bench.common import env_facts, gpu_kernel_events, print_table, write_json

MIB = 1 << 20
CLASSES = ("compute", "compression", "comm")
# The one-launch fused all-reduces carry the bytes and code them in one kernel: "comm".
_COMM = re.compile(r"nccl|exchange|fused_allreduce|fused_two_shot", re.I)
# taco_* (Triton and *_mosaic) and echo4_* kernels, compress_feedback included
_COMPRESSION = re.compile(r"(taco|echo4)_(echo4_)?(compress|decompress|reduce|decode_sum)")


# -- trace analysis (pure Python; unit-tested on synthetic traces) ------------------------
def classify(name: str) -> str:
    if _COMM.search(name):
        return "comm"
    if _COMPRESSION.search(name):
        return "compression"
    return "compute"


def _union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(iv) -> float:
    return sum(b - a for a, b in iv)


def _intersect(u: list, v: list) -> list:
    """Intersection of two unions (sorted, disjoint interval lists)."""
    out, i, j = [], 0, 0
    while i < len(u) and j < len(v):
        a, b = max(u[i][0], v[j][0]), min(u[i][1], v[j][1])
        if a < b:
            out.append((a, b))
        if u[i][1] < v[j][1]:
            i += 1
        else:
            j += 1
    return out


# Complete ('X') events on the kernel streams of GPU `device` of a perfetto trace
# ('/device:GPU:<n>' processes, their 'Stream …' threads)
device_kernels = gpu_kernel_events


def breakdown(kernels: list[dict], iters: int) -> dict:
    """Per-iteration time by class, overlap of comm with other kernels, idle; in µs."""
    if not kernels:
        raise ValueError("no device kernels in the trace")
    iv = defaultdict(list)
    per_name = defaultdict(float)
    for e in kernels:
        a, d = float(e["ts"]), float(e["dur"])
        iv[classify(e["name"])].append((a, a + d))
        per_name[e["name"]] += d
    u = {c: _union(iv[c]) for c in CLASSES}
    every = _union([x for c in CLASSES for x in iv[c]])
    non_comm = _union(iv["compute"] + iv["compression"])
    overlap = _length(_intersect(u["comm"], non_comm))
    wall = every[-1][1] - every[0][0]
    row = {"wall_us": wall / iters}
    for c in CLASSES:
        row[f"{c}_us"] = _length(u[c]) / iters
    row["comm_overlap_us"] = overlap / iters
    row["comm_exposed_us"] = row["comm_us"] - row["comm_overlap_us"]
    row["idle_us"] = (wall - _length(every)) / iters
    row = {k: round(v, 1) for k, v in row.items()}
    row["n_kernels"] = len(kernels)
    top = sorted(per_name.items(), key=lambda t: -t[1])[:25]
    row["top_kernels"] = [{"name": n[:160], "class": classify(n), "us_per_iter":
                           round(d / iters, 1)} for n, d in top]
    return row


def load_trace(log_dir: str) -> list[dict]:
    files = sorted(glob.glob(os.path.join(log_dir, "plugins/profile/*/perfetto_trace.json.gz")))
    if not files:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {log_dir}")
    with gzip.open(files[-1]) as f:
        d = json.load(f)
    return d["traceEvents"] if isinstance(d, dict) else d


def profiled(run, iters: int, device: int, keep: str | None, tag: str) -> dict:
    """run() executes `iters` iterations and blocks; -> breakdown of GPU `device`."""
    log_dir = os.path.join(keep, tag) if keep else tempfile.mkdtemp(prefix="taco_prof_")
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        run()
    try:
        return breakdown(device_kernels(load_trace(log_dir), device), iters)
    except (ValueError, FileNotFoundError) as e:   # keep going; --keep-trace has the raw data
        print(f"[profile] {tag}: {e}", flush=True)
        return {"error": str(e)[:2000], "trace_dir": log_dir if keep else None}
    finally:
        if not keep:
            shutil.rmtree(log_dir, ignore_errors=True)


# -- workloads ---------------------------------------------------------------------------
def psum_rows(args) -> list[dict]:
    import taco_jax
    from taco_jax.collectives import fused
    n_dev = jax.device_count()
    mesh = jax.make_mesh((n_dev,), ("tp",))
    transports = [t for t in args.transports
                  if t != "fused" or fused.mesh_unavailable_reason(mesh) is None]
    rows = []
    for mib in args.mib:
        n = mib * MIB // 2
        cols = 4096
        x = jax.random.normal(jax.random.key(0), (n_dev * (n // cols), cols), jax.numpy.bfloat16)
        x = jax.device_put(x, NamedSharding(mesh, P("tp")))
        configs = [("none", "lax")] + [(c, t) for c in args.codecs if c != "none"
                                       for t in transports]
        for codec, transport in configs:
            if codec == "none":
                def body(v):
                    return jax.lax.psum(v, "tp")
            else:
                def body(v, codec=codec, transport=transport):
                    return taco_jax.psum(v, "tp", codec=codec, min_bytes=0, transport=transport)
            fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P()))
            jax.block_until_ready(fn(x))                              # compile + warm up

            def run(fn=fn):
                outs = [fn(x) for _ in range(args.iters)]
                jax.block_until_ready(outs)
            row = profiled(run, args.iters, args.device, args.keep_trace,
                           f"psum-{mib}-{codec}-{transport}")
            rows.append({"workload": "psum", "mib_per_device": mib, "codec": codec,
                         "transport": transport, **row})
            print_table(rows[-1:], COLS)
    return rows


def train_rows(args) -> list[dict]:
    from models import parallel
    from train import config as config_lib
    from train.loop import build_mesh, make_train_step
    rows = []
    for preset in args.presets:
        for codec in args.variants:
            cfg = config_lib.load_config(preset, [f"codec={codec}", "model.min_bytes=0",
                                                  "train.progress=false", *args.set])
            mesh = build_mesh(cfg)
            init, step = make_train_step(cfg, mesh)
            state = init(cfg.train.seed)
            rng = np.random.default_rng(0)
            shape = (cfg.train.batch_size, cfg.model.seq_len)
            x, y = (parallel.put_batch(rng.integers(0, cfg.model.vocab_size, shape,
                                                    dtype=np.int32), mesh) for _ in range(2))
            for _ in range(3):                                      # compile + warm up
                state, m = step(state, x, y)
            jax.block_until_ready(m)
            box = {"state": state}

            def run():
                s = box["state"]
                for _ in range(args.iters):
                    s, mm = step(s, x, y)
                jax.block_until_ready(mm)
                box["state"] = s
            row = profiled(run, args.iters, args.device, args.keep_trace,
                           f"train-{preset}-{codec}")
            rows.append({"workload": "train", "preset": preset, "tp": int(mesh.shape["tp"]),
                         "codec": codec, **row})
            print_table(rows[-1:], COLS)
    return rows


COLS = ["workload", "codec", "transport", "wall_us", "compute_us", "compression_us", "comm_us",
        "comm_overlap_us", "comm_exposed_us", "idle_us"]


def plot(rows: list[dict], path: str) -> str:
    rows = [r for r in rows if "error" not in r]
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [(f"{r['preset']} {r['codec']}" if r["workload"] == "train" else
               f"{r['mib_per_device']} MiB {r['codec']} {r.get('transport', '')}")
              for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(rows)), 4.5))
    bottom = np.zeros(len(rows))
    for key, col, lab in (("compute_us", "tab:blue", "compute"),
                          ("compression_us", "tab:orange", "compression kernels"),
                          ("comm_exposed_us", "tab:red", "communication, exposed"),
                          ("idle_us", "lightgray", "idle")):
        v = np.array([r[key] for r in rows]) / 1e3
        ax.bar(labels, v, bottom=bottom, color=col, label=lab)
        bottom += v
    v = np.array([r["comm_overlap_us"] for r in rows]) / 1e3
    ax.bar(labels, v, bottom=bottom, color="none", edgecolor="tab:red", hatch="//",
           label="communication, overlapped (hidden under the bars below)")
    ax.set_ylabel("ms per iteration (GPU 0)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload", choices=("psum", "train"))
    ap.add_argument("--mib", type=int, nargs="+", default=[256])
    ap.add_argument("--codecs", nargs="+", default=["taco"])
    ap.add_argument("--transports", nargs="+", default=["xla", "fused"])
    ap.add_argument("--presets", nargs="+", default=["comm_heavy", "small"])
    ap.add_argument("--variants", nargs="+", default=["none", "taco"])
    ap.add_argument("--set", nargs="*", default=[], help="config overrides (train)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--out", default="bench/results/profile.json")
    ap.add_argument("--plot", default="docs/breakdown_{workload}.png")
    ap.add_argument("--keep-trace", default=None, help="keep the raw traces under DIR")
    args = ap.parse_args(argv)
    rows = psum_rows(args) if args.workload == "psum" else train_rows(args)
    print_table(rows, COLS)
    payload = {**env_facts(), "workload": args.workload, "iters": args.iters,
               "gpu": args.device, "rows": rows}
    if args.out:
        old = json.load(open(args.out)) if os.path.exists(args.out) else {}
        if old.get("commit") == payload["commit"]:      # psum and train rows of one commit
            payload["rows"] = [r for r in old.get("rows", [])
                               if r["workload"] != args.workload] + rows
        write_json(args.out, payload)
    if args.plot:
        print(f"wrote {plot(rows, args.plot.format(workload=args.workload))}")
    return payload


if __name__ == "__main__":
    main()
