"""python -m experiments.convergence_3d: does compressing each axis of a (data, pipe, tp)
mesh change how a GPT trains? Final validation loss per variant against the exact run of the
same seed.

    python -m experiments.convergence_3d [--config tiny] [--mesh 2,2,2] [--microbatches M]
        [--variants none tp dp+pp 3d] [--seeds 0 1] [--steps N] [--codec-tp taco]
        [--codec-pp tah4] [--codec-dp taco] [--set k=v ...] [--out-dir DIR]
        [--json bench/results/convergence_3d.json] [--plot docs/convergence_3d.png]
        [--budget-s S]

The variants are bench.train_step's (`variant_codecs`, `variant_overrides`): `none` every
axis exact, `tp` / `pp` / `dp` joined by `+` (`2d` = dp+pp, `3d` = dp+pp+tp) those axes
compressed with --codec-tp / --codec-pp / --codec-dp, or a codec name on every axis; every
collective compressed (min_bytes 0). Each (variant, seed) trains the same preset, data order
and steps via `train.run` on the mesh DATA,PIPE,TP (on CPU: DATA*PIPE*TP simulated
devices) in `<out-dir>/<variant>@seed<N>`. Runs are ordered seed by seed, so the pairs
finish first; finished runs are read back, interrupted ones resume from their checkpoint,
diverged ones (NaN loss) are recorded once. `--budget-s S` stops cleanly after S seconds (the
current step finishes, a checkpoint is written); re-run the same command to continue.

Output: a table of final validation loss per run and the paired degradation of each variant
against `none` of the same seed (experiments.ablation.paired_summary: per seed, mean, s.e.,
90% Student-t interval); the JSON {"device", "jax", "commit", "preset", "mesh",
"microbatches", "steps", "codecs", "rows": [{"variant", "seed", "final_val_loss", ...}],
"paired": [...]}; a figure of the validation curves and the paired differences.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import train
from bench.common import write_json
from bench.train_step import mesh_overrides, split_variant, variant_codecs, variant_overrides
from experiments.ablation import (_Budget, _commit, _curve, _device, _record, paired_summary,
                                  read_run_dir)
from train import config as config_lib
from train.loop import setup_backend
from train.metrics import save_figure


def run_name(variant: str, seed: int) -> str:
    return f"{variant}@seed{seed}"


def overrides(variant: str, codecs: dict, seed: int, args, run_dir: Path) -> list[str]:
    """The run's config overrides: the mesh, --set, then the variant's codecs per axis."""
    d, p, t = (int(v) for v in args.mesh.split(","))
    return [f"parallel.cpu_devices={d * p * t}", *mesh_overrides(args.mesh, None),
            *([f"parallel.microbatches={args.microbatches}"] if args.microbatches else []),
            "train.progress=false", *args.set, *variant_overrides(variant, codecs),
            *([f"train.steps={args.steps}"] if args.steps else []), f"train.seed={seed}",
            f"train.run_dir={run_dir}"]


def run_one(variant: str, codecs: dict, seed: int, args, budget: _Budget) -> dict | None:
    """Train (or read back) one run -> its row, or None if it stopped unfinished."""
    run_dir = Path(args.out_dir) / run_name(variant, seed)
    var = {"name": variant, "codec": variant, "feedback": False, "seed": seed}
    extra = {f"codec_{a}": codecs[a] for a in ("tp", "pp", "dp")}
    diverged_f = run_dir / "diverged.json"
    done = read_run_dir(var, run_dir, args.steps, args.commit)
    if done is not None:
        return done if done.get("diverged") else {**done, **extra}
    cfg = config_lib.load_config(args.config, overrides(variant, codecs, seed, args, run_dir))
    resume = (run_dir / "ckpt").exists()
    print(f"[convergence_3d] {run_name(variant, seed)}: "
          f"{'resuming' if resume else 'training'} in {run_dir}", flush=True)
    budget.arm()
    try:
        s = train.run(cfg, resume=resume)
    except FloatingPointError as e:   # NaN/inf loss: recorded once, never retried
        rec = {**var, "variant": variant, "run_dir": str(run_dir), **extra,
               "final_val_loss": float("nan"), "diverged": True, "error": str(e),
               "curve": _curve(run_dir)}
        diverged_f.write_text(json.dumps(rec, indent=1))
        return rec
    finally:
        budget.disarm()
    return None if s["interrupted"] else {**_record(var, s, run_dir, args.commit), **extra}


def plot(rows: list[dict], paired: list[dict], args) -> Path:
    """(a) validation loss per run against step, (b) each variant's paired differences
    (one dot per seed) and their mean."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = dict(zip(args.variants, plt.get_cmap("tab10").colors))
    for r in rows:
        c = r.get("curve") or {}
        ax.plot(c.get("val_step", []), c.get("val_loss", []), "o-" if r["seed"] == args.seeds[0]
                else "s--", color=colors.get(r["variant"]), ms=3, lw=1,
                label=run_name(r["variant"], r["seed"]))
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss")
    ax.legend(fontsize=8)
    for y, e in enumerate(paired):
        bx.plot(e["paired_pct"], [y] * len(e["paired_pct"]), "o", color="tab:blue", alpha=0.6)
        bx.plot([e["mean_pct"]], [y], "D", color="tab:red")
    bx.axvline(0, color="k", lw=0.6)
    bx.set_yticks(range(len(paired)), [e["config"] for e in paired])
    bx.set_xlabel("final val loss vs none of the same seed (%): seeds (dots), mean (diamond)")
    for a in (ax, bx):
        a.grid(alpha=0.3)
    fig.suptitle(f"{args.preset_name}, mesh data x pipe x tp = {args.mesh.replace(',', ' x ')}, "
                 f"{args.steps} steps, codecs tp={args.codec_tp} pp={args.codec_pp} "
                 f"dp={args.codec_dp}", fontsize=10)
    return save_figure(fig, args.plot)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.convergence_3d", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny", help="preset name or YAML (default tiny)")
    p.add_argument("--mesh", default="2,2,2", help="DATA,PIPE,TP (default 2,2,2)")
    p.add_argument("--microbatches", type=int, default=0, help="0 = the preset's")
    p.add_argument("--variants", nargs="+", default=["none", "tp", "dp+pp", "3d"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--steps", type=int, default=None, help="default: the preset's train.steps")
    p.add_argument("--codec-tp", default="taco")
    p.add_argument("--codec-pp", default="tah4")
    p.add_argument("--codec-dp", default="taco")
    p.add_argument("--set", nargs="*", default=[], help="extra config overrides (k=v)")
    p.add_argument("--out-dir", default=None, help="default runs/convergence_3d-<preset>")
    p.add_argument("--json", default="bench/results/convergence_3d.json")
    p.add_argument("--plot", default="docs/convergence_3d.png", help="'' = no figure")
    p.add_argument("--budget-s", type=float, default=0, help="stop cleanly after S seconds")
    return p


def main(argv=None) -> dict:
    p = build_parser()
    args = p.parse_args(argv)
    mesh_overrides(args.mesh, None)   # a malformed --mesh fails here
    if 0 in [int(v) for v in args.mesh.split(",")]:
        p.error(f"--mesh {args.mesh}: every size must be >= 1")
    plans = {v: variant_codecs(split_variant(v)[0], args.codec_tp, args.codec_pp,
                               args.codec_dp) for v in args.variants}  # bad names: now
    if "none" not in plans:
        p.error("--variants needs 'none': every degradation is read against it")
    args.commit = _commit()
    cfg0 = config_lib.load_config(args.config, overrides("none", plans["none"], 0, args, ""))
    setup_backend(cfg0)   # the simulated CPU devices, before anything starts JAX
    args.preset_name, args.steps = cfg0.name, args.steps or cfg0.train.steps
    args.out_dir = args.out_dir or f"runs/convergence_3d-{cfg0.name}"
    budget = _Budget(args.budget_s)
    rows, left = [], []
    for seed in args.seeds:
        for variant, codecs in plans.items():
            rec = None if budget.expired() else run_one(variant, codecs, seed, args, budget)
            (rows.append(rec) if rec is not None else left.append(run_name(variant, seed)))
    paired = paired_summary(rows)
    print(f"\n{'variant':<10}{'seed':>5}{'val loss':>10}")
    for r in rows:
        print(f"{r['variant']:<10}{r['seed']:>5}{r['final_val_loss']:>10.4f}")
    print(f"\n{'vs none, same seed':<20}{'mean %':>8}  per seed")
    for e in paired:
        print(f"{e['config']:<20}{e['mean_pct']:>+8.2f}  " + ", ".join(
            f"{v:+.2f} ({s})" for v, s in zip(e["paired_pct"], e["seeds"])))
    import jax
    out = {"device": _device(), "jax": jax.__version__, "commit": args.commit,
           "preset": args.preset_name, "mesh": args.mesh.replace(",", "x"),
           "microbatches": cfg0.parallel.microbatches, "steps": args.steps,
           "codecs": {"tp": args.codec_tp, "pp": args.codec_pp, "dp": args.codec_dp},
           "rows": rows, "paired": paired}
    if left:
        out["unfinished"] = left
        print(f"[convergence_3d] not finished: {left}. Re-run the same command to continue.")
    if args.json:
        write_json(args.json, out)
    if args.plot and rows:
        print(f"wrote {plot(rows, paired, args)}")
    return out


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
