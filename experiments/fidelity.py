"""Codec fidelity on the real tensors of tensor-parallel GPT training.

    python -m experiments.fidelity [--config tiny] [--steps 200] [--capture-at 20 100 200]
        [--tp 2] [--train-codec none] [--load RUN_DIR] [--codecs ...] [--set k=v ...]

Trains a GPT (train.build: same data, init and optimizer as `python -m train`) with
`--train-codec` (default none: bf16/fp32 all-reduces, so the tensors are the baseline's),
or loads the latest checkpoint of a finished run (`--load`). At each capture step it runs
one forward+backward of the next training batch under `taco_jax.telemetry.capture()`,
which hands every TP all-reduce input to the host (device 0 of "tp"): "fwd" = the partial
sums entering the row-parallel psums (attention-out, MLP-down), "bwd" = the partial input
gradients entering the column-parallel backward all-reduces (before QKV, MLP-up, LM head).
Each codec in taco_jax.codecs.names() then encodes+decodes every captured tensor, exactly
as the first quantization of the two-shot all-reduce does (per-tensor codecs: one scale
over the device's tensor). Reported per (codec, site kind, step):

  rel_l2          sqrt(Σ‖x̂−x‖² / Σ‖x‖²) pooled over the sites of that kind
  snr_db          mean over sites of 10·log10(‖x‖² / ‖x̂−x‖²)
  underflow_frac  fraction of nonzero x that decode to exactly 0
  rel_l2_max      worst site; per_site: rel_l2 of every site in trace order

Writes bench/results/fidelity.json, docs/fidelity_hist.png (values before and after the
transform: raw, α·x, α·H·x, and the quantizer input |z/s| against the E4M3 grid — the idea
of the TACO paper's Figs. 4/6/8) and docs/fidelity_error.png (rel_l2 per codec).
"""
from __future__ import annotations

import argparse
import functools
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import env_facts, write_json
from taco_jax import codecs, telemetry
from taco_jax.numerics import hadamard, quant
from train import config as config_lib
from train.checkpoint import Checkpointer
from train.data import Batches, load_corpus
from train.loop import build, build_mesh, setup_backend
from train.metrics import save_figure

KINDS = ("fwd", "bwd")
E4M3_MIN_SUB = 2.0 ** -9        # smallest E4M3 subnormal; |y| < 2^-10 rounds to 0
E4M3_MIN_NORMAL = 2.0 ** -6


# -- capture ----------------------------------------------------------------------------
def capture(prog, params, x, y) -> tuple[list[dict], float]:
    """One forward+backward with telemetry.capture on: the records of device 0 of "tp"."""
    fn = jax.jit(prog.model.loss_and_grad_fn())        # a fresh trace, inside the block
    with telemetry.capture() as cap:
        loss, _ = fn(params, prog.put_batch(x), prog.put_batch(y))
        loss = float(jax.block_until_ready(loss))
    jax.effects_barrier()
    recs = sorted(cap.records, key=lambda r: (r["kind"], r["site"]))
    return recs, loss


# -- metrics ----------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _stats_fn(name: str):
    codec = codecs.get(name)

    @jax.jit
    def stats(x):
        xh = codec.roundtrip(x).astype(jnp.float32)
        xf = x.astype(jnp.float32)
        nz = xf != 0
        return {"err2": jnp.sum(jnp.square(xh - xf)), "sig2": jnp.sum(jnp.square(xf)),
                "nonzero": jnp.sum(nz), "underflow": jnp.sum(nz & (xh == 0)),
                "nonfinite": jnp.sum(~jnp.isfinite(xh))}
    return stats


def codec_rows(records: list[dict], names, step: int) -> list[dict]:
    rows = []
    for name in names:
        for kind in KINDS:
            recs = [r for r in records if r["kind"] == kind]
            if not recs:
                continue
            s = [jax.tree.map(float, _stats_fn(name)(jnp.asarray(r["value"]))) for r in recs]
            err2, sig2 = sum(v["err2"] for v in s), sum(v["sig2"] for v in s)
            per_site = [math.sqrt(v["err2"] / max(v["sig2"], 1e-300)) for v in s]
            snrs = [10 * math.log10(v["sig2"] / v["err2"]) for v in s if v["err2"] > 0]
            rows.append({
                "codec": name, "site": kind, "step": step,
                "rel_l2": math.sqrt(err2 / max(sig2, 1e-300)),
                "snr_db": float(np.mean(snrs)) if len(snrs) == len(s) else None,  # None: exact
                "underflow_frac": sum(v["underflow"] for v in s)
                / max(sum(v["nonzero"] for v in s), 1),
                "rel_l2_max": max(per_site), "nonfinite": int(sum(v["nonfinite"] for v in s)),
                "n_tensors": len(s), "per_site": [round(e, 6) for e in per_site]})
    return rows


def tensor_stats(records: list[dict], step: int) -> list[dict]:
    out = []
    for r in records:
        v = np.asarray(r["value"], np.float64).ravel()
        rms = float(np.sqrt(np.mean(v * v)))
        c = v - v.mean()
        kurt = float(np.mean(c ** 4) / max(np.mean(c ** 2) ** 2, 1e-300))
        out.append({"step": step, "kind": r["kind"], "site": r["site"], "op": r["op"],
                    "shape": list(np.shape(r["value"])), "dtype": str(r["value"].dtype),
                    "rms": rms, "absmax_over_rms": float(np.max(np.abs(v)) / max(rms, 1e-300)),
                    "kurtosis": kurt})
    return out


# -- histograms -------------------------------------------------------------------------
def _blocks_sample(records, kind, b=256, max_blocks=8192, seed=0) -> np.ndarray:
    """(n, B) f32 blocks of the tensors of one kind, a random subset of whole blocks."""
    blocks = [np.asarray(codecs.to_blocks(jnp.asarray(r["value"], jnp.float32), b))
              for r in records if r["kind"] == kind]
    x = np.concatenate(blocks)
    if len(x) > max_blocks:
        x = x[np.random.default_rng(seed).choice(len(x), max_blocks, replace=False)]
    return x


def transform_views(x: np.ndarray) -> dict:
    """The values at each stage of TACO's encoder, and block-fp8's quantizer input."""
    xj = jnp.asarray(x)
    bad = quant.nonfinite_rows(xj)
    a = quant.alpha(xj, bad)
    ax = xj * a
    z = hadamard.forward(ax)
    q_taco = z / (jnp.max(jnp.abs(z), axis=1, keepdims=True) / 448.0)
    q_block = xj / jnp.maximum(jnp.max(jnp.abs(xj), axis=1, keepdims=True) / 448.0, 1e-30)
    return {k: np.asarray(v).ravel() for k, v in
            {"raw": xj, "ax": ax, "ahx": z, "q_taco": q_taco, "q_block": q_block}.items()}


def plot_hist(records: list[dict], step: int, out: Path, title: str) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k in KINDS if any(r["kind"] == k for r in records)]
    fig, axes = plt.subplots(len(kinds), 3, figsize=(15, 3.6 * len(kinds)), squeeze=False)
    for row, kind in zip(axes, kinds):
        v = transform_views(_blocks_sample(records, kind))
        raw = v["raw"]
        rms = np.sqrt(np.mean(raw ** 2))
        row[0].hist(raw, bins=200, color="tab:gray", log=True)
        row[0].set_title(f"{kind}: raw values (max|x|/rms = {np.abs(raw).max() / rms:.1f})")
        lim = max(np.abs(v["ax"]).max(), np.abs(v["ahx"]).max())
        bins = np.linspace(-lim, lim, 200)
        row[1].hist(v["ax"], bins=bins, alpha=0.6, log=True, label="α·x (ASH scale only)")
        row[1].hist(v["ahx"], bins=bins, alpha=0.6, log=True, label="α·H·x (TACO)")
        row[1].set_title(f"{kind}: after α = clip(448/σ, 1e-3, 1e3), and after α·H")
        row[1].legend(fontsize=8)
        edges = np.logspace(-14, np.log10(448) + 0.01, 200)
        for key, lab in (("q_block", "block-fp8: |x/s|"), ("q_taco", "taco: |α·H·x/s|")):
            q = np.abs(v[key])
            q = q[q > 0]
            zero = np.mean(np.abs(v[key][v["raw"] != 0]) < 2.0 ** -10)
            row[2].hist(np.clip(q, 1e-14, None), bins=edges, alpha=0.6, log=True,
                        label=f"{lab} ({100 * zero:.2f}% → 0)")
        row[2].set_xscale("log")
        for xv, lab in ((E4M3_MIN_SUB / 2, "round to 0"), (E4M3_MIN_NORMAL, "min normal"),
                        (448, "max")):
            row[2].axvline(xv, color="k", ls=":", lw=0.8)
            row[2].text(xv, 2.0, lab, rotation=90, fontsize=7, va="bottom")
        row[2].set_title(f"{kind}: quantizer input vs the E4M3 grid")
        row[2].legend(fontsize=8, loc="upper left")
        row[0].ticklabel_format(axis="x", style="sci", scilimits=(-2, 3))
        for ax in row:
            ax.grid(alpha=0.3)
    fig.suptitle(title)
    return save_figure(fig, out)


def plot_errors(rows: list[dict], step: int, out: Path, title: str) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["step"] == step and r["rel_l2"] > 0]
    names = list(dict.fromkeys(r["codec"] for r in rows))
    fig, ax = plt.subplots(figsize=(10, 4))
    w = 0.38
    for i, kind in enumerate(KINDS):
        vals = [next((r["rel_l2"] for r in rows if r["codec"] == n and r["site"] == kind),
                     np.nan) for n in names]
        ax.bar(np.arange(len(names)) + (i - 0.5) * w, vals, w, label=kind)
    ax.set_xticks(np.arange(len(names)), names, rotation=30, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("relative L2 error (one encode+decode)")
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    return save_figure(fig, out)


def print_table(rows: list[dict], step: int) -> None:
    print(f"\nstep {step}: rel_l2 / SNR dB / underflow %")
    print(f"{'codec':<14}" + "".join(f"{k + ' rel_l2':>12}{'SNR':>7}{'uflow%':>8}" for k in KINDS))
    for name in dict.fromkeys(r["codec"] for r in rows):
        line = f"{name:<14}"
        for kind in KINDS:
            r = next((r for r in rows if r["codec"] == name and r["site"] == kind
                      and r["step"] == step), None)
            if r is None:
                line += f"{'-':>12}{'-':>7}{'-':>8}"
                continue
            snr = "inf" if r["snr_db"] is None else f"{r['snr_db']:.1f}"
            line += f"{r['rel_l2']:>12.5f}{snr:>7}{100 * r['underflow_frac']:>8.3f}"
        print(line)


# -- main -------------------------------------------------------------------------------
def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="tiny", help="preset name or YAML (default tiny)")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default: preset's)")
    ap.add_argument("--capture-at", type=int, nargs="+", default=None,
                    help="steps to capture after (default: steps/10, steps/2, steps)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--train-codec", default="none", help="codec used while training")
    ap.add_argument("--load", help="a finished run dir: capture at its latest checkpoint")
    ap.add_argument("--codecs", nargs="+", default=None, help="default: codecs.names()")
    ap.add_argument("--set", nargs="*", default=[], help="extra config overrides")
    ap.add_argument("--out", default="bench/results/fidelity.json")
    ap.add_argument("--hist", default="docs/fidelity_hist.png")
    ap.add_argument("--errplot", default="docs/fidelity_error.png")
    args = ap.parse_args(argv)

    if args.load:
        cfg = config_lib.load_config(Path(args.load) / "config.yaml", args.set)
    else:
        over = [f"parallel.tp={args.tp}", "parallel.data=1", f"codec={args.train_codec}",
                "train.progress=false"]
        if args.steps:
            over.append(f"train.steps={args.steps}")
        cfg = config_lib.load_config(args.config, over + list(args.set))
    setup_backend(cfg)
    mesh = build_mesh(cfg)
    prog = build(cfg, mesh)
    corpus = load_corpus(cfg.data, cfg.model.vocab_size)
    batches = Batches(corpus.train, cfg.train.batch_size, cfg.model.seq_len, cfg.train.seed,
                      stream=0)
    names = args.codecs or list(codecs.names())
    state = prog.init(cfg.train.seed)
    steps = cfg.train.steps
    if args.load:
        ck = Checkpointer(Path(args.load) / "ckpt")
        restored = ck.restore_latest(state, name=cfg.name, set_aside=False)
        ck.close()
        if restored is None:
            raise FileNotFoundError(f"no checkpoint under {Path(args.load) / 'ckpt'}")
        state, _, start = restored
        capture_at = [start]
    else:
        start = 0
        capture_at = sorted(set(args.capture_at or [max(1, steps // 10), steps // 2, steps]))
    trained = cfg.codecs()
    print(f"[fidelity] {cfg.name}, tp={mesh.shape['tp']}, trained with {trained['fwd']}/"
          f"{trained['bwd']}, capture after steps {capture_at}, codecs {names}", flush=True)

    rows, tensors, losses, last = [], [], {}, None
    step = start
    while True:
        if step in capture_at:
            x, y = batches[step]                    # the batch the next step would train on
            recs, losses[step] = capture(prog, state["params"], x, y)
            rows += codec_rows(recs, names, step)
            tensors += tensor_stats(recs, step)
            last = (step, recs)
            print_table(rows, step)
        if step >= max(capture_at):
            break
        x, y = batches[step]
        state, m = prog.step(state, prog.put_batch(x), prog.put_batch(y))
        step += 1
        if step % 50 == 0:
            print(f"[fidelity] step {step} loss {float(m['loss']):.4f}", flush=True)

    facts = env_facts()
    payload = {"device": facts["device"], "commit": facts["commit"], "preset": cfg.name,
               "tp": int(mesh.shape["tp"]), "dtype": str(last[1][0]["value"].dtype),
               "train_codec": trained["fwd"], "train_steps": steps,
               "steps_captured": capture_at, "loss_at_capture": losses,
               "env": facts, "rows": rows, "tensors": tensors}
    write_json(args.out, payload)
    title = (f"{cfg.name} GPT, TP={mesh.shape['tp']}, step {last[0]}, device 0 "
             f"({facts['device']})")
    if args.hist:
        print("wrote", plot_hist(last[1], last[0], Path(args.hist), title))
    if args.errplot:
        print("wrote", plot_errors(rows, last[0], Path(args.errplot), title))
    return payload


if __name__ == "__main__":
    main()
