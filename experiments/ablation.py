"""python -m experiments.ablation: does compressing the TP all-reduces change how a GPT
trains? Final validation loss per codec against the uncompressed run, over seeds (the
idea of the TACO paper's Table 4).

    python -m experiments.ablation [--config small] [--steps 2000] [--tp 2] [--seed 0]
        [--variants none fp8 ... taco+feedback none@seed1] [--set k=v ...]
        [--out-dir runs/ablation-<preset>] [--json bench/results/ablation.json]
        [--plot docs/ablation.png] [--budget-s 540] [--workers N]

Every variant trains the same preset, seed, data order and number of steps via `train.run`,
with every all-reduce compressed (model.min_bytes=0), forward and backward, at TP=2. A
variant is `codec`, `fwd:codec` / `bwd:codec` (one direction compressed, the other exact),
`fwdcodec/bwdcodec` (e.g. `taco/taco-int8`),
`codec+feedback` (model.feedback=true: Echo error feedback at the
forward sites; `--set model.feedback_bwd=true` adds the backward ones) or
`none@seedN` (the baseline with another seed: the noise floor every degradation is read
against). Each run has its own run dir `<out-dir>/<variant>`; the driver is resumable:
finished runs are read back, not re-run; interrupted ones resume from their checkpoint;
diverged ones (NaN loss) are recorded once and not retried.

`--budget-s S` stops cleanly after S seconds (SIGTERM to itself: the current step
finishes, a checkpoint is written): for machines that cap a command's time. Re-run the
same command to continue. Rows already in the JSON for variants without a local run dir
are kept (runs split over several machines).

`--workers N` trains the pending variants in N child drivers at once on the same devices
(their rows are merged into one JSON); step times are then shared-device times.

Output: a table of final validation loss and degradation vs `none` (the seed-0 baseline),
the same against the `none` of each row's own seed, summed up per configuration over seeds
(`paired`), the rerun noise (a second `none` of the same seed),
`diverged` = NaN or final val loss > 2x none's; the JSON
{"device", "commit", "preset", "steps", "tp", "noise_floor_pct", "rerun_noise_pct",
"paired", "rows": [{"codec", "feedback", "seed", "final_val_loss", "degradation_pct",
"diverged", ...}]}; one loss-curve figure of all runs (train loss, and val loss vs the none
of the same seed in %).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import scipy.stats

from bench.common import write_json

import train
from train import config as config_lib
from train.loop import setup_backend
from train.metrics import read_jsonl, save_figure

ROOT = Path(__file__).resolve().parent.parent  # the checkout holding experiments/

VARIANTS = ("none", "fp8", "block-fp8", "hadamard-fp8", "taco", "taco-1scale", "taco-e5m2",
            "taco-int8", "echo4", "echo4+feedback", "taco+feedback", "none@seed1")


def parse_variant(v: str, seed: int) -> dict:
    """"taco+feedback" / "none@seed1" / "fwd:taco" / "fp8" -> {"name", "codec", "feedback",
    "seed", "direction"}. `fwd:` compresses only the forward all-reduces (codec_bwd=none),
    `bwd:` only the backward ones (as in experiments.grad_error); default both. "taco/taco-int8"
    names the forward and the backward codec."""
    body, _, seed_part = v.partition("@")
    direction, _, body = body.rpartition(":")
    codec, _, fb = body.partition("+")
    if fb not in ("", "feedback"):
        raise ValueError(f"variant {v!r}: only '+feedback' may follow the codec")
    if "/" in codec and direction:
        raise ValueError(f"variant {v!r}: a fwd/bwd codec pair takes no direction prefix")
    if direction not in ("", "fwd", "bwd"):
        raise ValueError(f"variant {v!r}: the direction before ':' must be fwd or bwd, "
                         f"got {direction!r}")
    if seed_part and not seed_part.startswith("seed"):
        raise ValueError(f"variant {v!r}: '@' must be followed by seedN")
    return {"name": v, "codec": codec, "feedback": fb == "feedback",
            "seed": int(seed_part[4:]) if seed_part else seed,
            "direction": direction or "both"}


def _device() -> str:
    import jax
    d = jax.devices()[0]
    return getattr(d, "device_kind", d.platform)


def _commit() -> str | None:
    import subprocess
    c = os.environ.get("GIT_COMMIT")
    if c:
        return c
    try:
        return subprocess.run(["git", "rev-parse", "--verify", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).parent).stdout.strip() or None
    except OSError:
        return None


class _Budget:
    """SIGTERM to this process after `seconds` (train.run then checkpoints and returns)."""

    def __init__(self, seconds: float):
        self.t_end = time.monotonic() + seconds if seconds else None
        self.fired = False
        self._timer = None

    def arm(self):
        if self.t_end is None:
            return
        left = self.t_end - time.monotonic()
        if left <= 0:
            self.fired = True
            return

        def fire():
            self.fired = True
            os.kill(os.getpid(), signal.SIGTERM)
        self._timer = threading.Timer(left, fire)
        self._timer.daemon = True
        self._timer.start()

    def disarm(self):
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def expired(self) -> bool:
        return self.fired or (self.t_end is not None and time.monotonic() >= self.t_end)


def run_dir_of(out_dir, name: str) -> Path:
    """A variant's run dir: its name, with the fwd/bwd pair's '/' as '__' (one level)."""
    return Path(out_dir) / name.replace("/", "__")


def codec_pair(var: dict) -> tuple[str, str]:
    """(forward codec, backward codec) of a parsed variant."""
    fwd, _, bwd = var["codec"].partition("/")     # "taco/taco-int8": forward / backward
    bwd = bwd or fwd
    return (fwd if var["direction"] != "bwd" else "none",
            bwd if var["direction"] != "fwd" else "none")


def variant_overrides(var: dict, tp: int, steps: int, run_dir, progress: bool,
                      extra=(), emulate: bool = False) -> list[str]:
    """Config overrides of one variant: every all-reduce compressed (min_bytes 0). emulate:
    TP of size `tp` emulated on one device (parallel.emulate_tp, parallel.data=1)."""
    fwd, bwd = codec_pair(var)
    mesh = (["parallel.tp=0", "parallel.data=1", f"parallel.emulate_tp={tp}"] if emulate
            else [f"parallel.tp={tp}"])
    overrides = [f"model.codec_fwd={fwd}", f"model.codec_bwd={bwd}", "model.min_bytes=0",
                 *mesh, f"train.steps={steps}", f"train.seed={var['seed']}",
                 f"train.run_dir={run_dir}", f"train.progress={str(progress).lower()}",
                 *extra]
    if var["feedback"]:
        overrides.append("model.feedback=true")
    return overrides


def read_back(var: dict, args) -> dict | None:
    """The record of a run that finished (or diverged) in this variant's run dir; None if
    there is none (not started, or interrupted: to be trained or resumed)."""
    return read_run_dir(var, run_dir_of(args.out_dir, var["name"]), args.steps, args.commit)


def read_run_dir(var: dict, run_dir: Path, steps: int, commit: str | None) -> dict | None:
    """`read_back` for a given run dir: its diverged record, or the record of a run that
    reached `steps` uninterrupted; else None."""
    summary_f, diverged_f = run_dir / "summary.json", run_dir / "diverged.json"
    if diverged_f.exists():
        return json.loads(diverged_f.read_text())
    if summary_f.exists():
        s = json.loads(summary_f.read_text())
        if not s["interrupted"] and s["step"] >= steps:
            return _record(var, s, run_dir, commit)
    return None


def old_records(args, requested: list[str]) -> dict:
    """Rows of args.json (runs finished earlier, here or on other machines) for the same
    preset, steps and TP, by variant; sets args.old_meta. A requested variant whose run dir
    exists here is left out: its run dir is read back, or resumed, by the caller. Every
    other row is kept, also when its run dir exists (a variant finished by an earlier call
    on this machine and not requested again must stay in the table)."""
    records = {}
    if not (args.json and Path(args.json).exists()):
        return records
    old = json.loads(Path(args.json).read_text())
    if (old.get("preset"), old.get("steps"), old.get("tp")) != \
            (args.preset_name, args.steps, args.tp):
        return records
    args.old_meta = {"device": old.get("device"), "commit": old.get("commit")}
    for r in old["rows"]:
        if r["variant"] in requested and run_dir_of(args.out_dir, r["variant"]).exists():
            continue
        records[r["variant"]] = {k: v for k, v in r.items() if k != "degradation_pct"}
    return records


def run_variant(var: dict, args, budget: _Budget) -> dict | None:
    """Train one variant (or read it back). -> record, or None if not finished."""
    rec = read_back(var, args)
    if rec is not None:
        return rec
    run_dir = run_dir_of(args.out_dir, var["name"])
    diverged_f = run_dir / "diverged.json"
    overrides = variant_overrides(var, args.tp, args.steps, run_dir, args.progress, args.set,
                                  emulate=getattr(args, "emulate", False))
    cfg = config_lib.load_config(args.config, overrides)
    resume = (run_dir / "ckpt").exists()
    print(f"[ablation] {var['name']}: {'resuming' if resume else 'training'} in {run_dir}",
          flush=True)
    budget.arm()
    try:
        s = train.run(cfg, resume=resume)
    except FloatingPointError as e:   # NaN/inf loss: record once, never retried
        rec = {**_base(var, run_dir), "final_val_loss": float("nan"), "diverged": True,
               "error": str(e), "curve": _curve(run_dir)}
        diverged_f.write_text(json.dumps(rec, indent=1))
        return rec
    finally:
        budget.disarm()
    if s["interrupted"]:
        return None
    return _record(var, s, run_dir, args.commit)


def _base(var: dict, run_dir: Path) -> dict:
    return {"variant": var["name"], "codec": var["codec"], "feedback": var["feedback"],
            "seed": var["seed"], "direction": var.get("direction", "both"),
            "run_dir": str(run_dir)}


def _curve(run_dir: Path) -> dict:
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if math.isfinite(r["loss"])]
    return {"step": [r["step"] for r in rows],
            "loss": [round(r["loss"], 5) for r in rows],
            "val_step": [r["step"] for r in rows if "val_loss" in r],
            "val_loss": [round(r["val_loss"], 5) for r in rows if "val_loss" in r]}


def _record(var: dict, s: dict, run_dir: Path, commit: str | None) -> dict:
    """commit: the code the driver runs (taken at its start, not when the run ends)."""
    return {**_base(var, run_dir), "commit": commit, "final_val_loss": s["final_val_loss"],
            "final_train_loss": s["final_train_loss"], "steps": s["step"],
            "step_time_s": s["step_time_s"], "platform": s["platform"],
            "curve": _curve(run_dir)}


def config_key(row: dict) -> str:
    """The variant name without its seed ("taco@seed1" -> "taco", "none@seed0" -> "none"):
    runs with the same key differ only in seed (or are reruns of the same seed)."""
    return row["variant"].partition("@")[0]


def seed_baselines(rows: list[dict]) -> dict:
    """seed -> that seed's `none` row (plain "none" before "none@seedN", so a rerun named
    none@seed0 is compared with "none", not the other way round)."""
    base = {}
    for r in sorted(rows, key=lambda r: "@" in r["variant"]):
        if r["codec"] == "none" and not r["feedback"]:
            base.setdefault(r["seed"], r)
    return base


def paired_summary(rows: list[dict]) -> list[dict]:
    """Each configuration against the `none` run of the same seed, over every seed it ran.

    A final validation loss of one run carries the trajectory's noise: the same bf16 run
    repeated on a GPU (nondeterministic reductions) ended 0.41% apart, and seeds 0 and 1
    1.5% apart (small preset, 2000 steps, bench/results/ablation.json). So a configuration's degradation is read as the mean of its
    paired differences (same seed, same data order, same validation windows) over seeds,
    and a repeated `none` (none@seed0 beside none) gives the rerun noise directly.
    -> [{"config", "runs", "seeds", "paired_pct": [...], "mean_pct", "spread_pct",
    "sem_pct", "ci90_pct"}]; spread_pct is max - min of the paired differences, sem_pct the
    standard error of their mean (sample standard deviation / sqrt(runs)), ci90_pct the
    two-sided 90% Student-t interval of the mean [lo, hi], which a target such as
    "≤ +0.25%" is read against (None for one run)."""
    base = seed_baselines(rows)
    out = {}
    for r in rows:
        b = base.get(r["seed"])
        v = r["final_val_loss"]
        if b is None or r is b or v is None or not math.isfinite(v):
            continue
        e = out.setdefault(config_key(r), {"config": config_key(r), "runs": [], "seeds": [],
                                            "paired_pct": []})
        e["runs"].append(r["variant"])
        e["seeds"].append(r["seed"])
        e["paired_pct"].append(100 * (v - b["final_val_loss"]) / b["final_val_loss"])
    for e in out.values():
        p = e["paired_pct"]
        e["mean_pct"] = sum(p) / len(p)
        e["spread_pct"] = e["sem_pct"] = e["ci90_pct"] = None
        if len(p) > 1:
            e["spread_pct"] = max(p) - min(p)
            e["sem_pct"] = statistics.stdev(p) / math.sqrt(len(p))
            half = float(scipy.stats.t.ppf(0.95, len(p) - 1)) * e["sem_pct"]
            e["ci90_pct"] = [e["mean_pct"] - half, e["mean_pct"] + half]
    return list(out.values())


def finish(records: dict, args, order: list[str]) -> dict:
    """Degradation vs none, diverged flags, table, JSON, plot."""
    base = records.get("none")
    b = base["final_val_loss"] if base else None
    rows = []
    for name in order:
        r = records.get(name)
        if r is None:
            continue
        v = r["final_val_loss"]
        bad = v is None or not math.isfinite(v)
        r = {**r, "degradation_pct": None if (bad or b is None) else 100 * (v - b) / b,
             "diverged": bool(r.get("diverged") or bad or (b is not None and v > 2 * b))}
        rows.append(r)
    noise = next((r["degradation_pct"] for r in rows
                  if r["codec"] == "none" and r["seed"] != args.seed), None)
    print(f"\n{'variant':<18}{'val loss':>10}{'vs none %':>11}  diverged")
    for r in rows:
        v = r["final_val_loss"]
        d = r["degradation_pct"]
        print(f"{r['variant']:<18}{v if v is not None else float('nan'):>10.4f}"
              f"{'' if d is None else f'{d:+.2f}':>11}  {'yes' if r['diverged'] else ''}")
    if noise is not None:
        print(f"noise floor (none, another seed): {noise:+.2f}%")
    paired = paired_summary(rows)
    if any(len(e["paired_pct"]) > 1 for e in paired):
        print(f"\n{'paired vs none of the same seed':<34}{'mean %':>8}{'± sem':>7}"
              f"{'90% CI':>17}  runs")
        for e in paired:
            runs = ", ".join(f"{p:+.2f} (seed {s})" for p, s in zip(e["paired_pct"],
                                                                   e["seeds"]))
            sem, ci = e["sem_pct"], e["ci90_pct"]
            print(f"{e['config']:<34}{e['mean_pct']:>+8.2f}"
                  f"{'' if sem is None else f'{sem:.2f}':>7}"
                  f"{'' if ci is None else f'[{ci[0]:+.2f}, {ci[1]:+.2f}]':>17}  {runs}")
    rerun = next((p for e in paired if e["config"] == "none"      # a second none, same seed
                  for p, s in zip(e["paired_pct"], e["seeds"]) if s == args.seed), None)
    if rerun is not None:
        print(f"rerun noise (none again, same seed): {rerun:+.2f}%")
    import jax
    # rows read back from the JSON only (nothing trained here): keep where they ran
    meta = (args.old_meta if args.old_meta and not args.trained_here
            else {"device": _device(), "commit": args.commit})
    out = {"device": meta["device"], "jax": jax.__version__, "commit": meta["commit"],
           "preset": args.preset_name,
           "steps": args.steps, "tp": args.tp, "min_bytes": 0, "seed": args.seed,
           "noise_floor_pct": noise, "rerun_noise_pct": rerun, "paired": paired,
           "rows": rows}
    if args.json:
        write_json(args.json, out)
    if args.plot and rows:
        print(f"wrote {plot_curves(rows, args)}")
        if paired:
            print(f"wrote {plot_paired(paired, rerun, args)}")
    return out


def paired_plot_path(plot: str) -> Path:
    """docs/ablation.png -> docs/ablation_paired.png"""
    p = Path(plot)
    return p.with_name(f"{p.stem}_paired{p.suffix}")


def plot_paired(paired: list[dict], rerun: float | None, args) -> Path:
    """Each configuration's paired differences (one dot per seed), their mean (diamond)
    and, with two or more seeds, its 90% Student-t interval; the rerun noise as a band
    around 0. Sorted by mean, so the ordering of the codecs reads off the figure."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    es = sorted((e for e in paired if e["config"] != "none"), key=lambda e: e["mean_pct"])
    fig, ax = plt.subplots(figsize=(8, 0.38 * len(es) + 2.2))
    if rerun is not None:
        ax.axvspan(-abs(rerun), abs(rerun), color="0.88",
                   label=f"rerun noise (none again, same seed): ±{abs(rerun):.2f}%")
    ax.axvline(0, color="k", lw=0.6)
    labels = {"one seed", "90% t-interval of the mean", "mean over seeds"}

    def once(label):   # each legend entry once
        if label not in labels:
            return None
        labels.discard(label)
        return label
    for y, e in enumerate(es):
        ax.plot(e["paired_pct"], [y] * len(e["paired_pct"]), "o", color="tab:blue", ms=4,
                alpha=0.6, label=once("one seed"))
        if e["ci90_pct"]:
            lo, hi = e["ci90_pct"]
            ax.plot([lo, hi], [y, y], "-", color="tab:red", lw=1.5,
                    label=once("90% t-interval of the mean"))
        ax.plot([e["mean_pct"]], [y], "D", color="tab:red", ms=6,
                label=once("mean over seeds"))
        ax.text(1.01, y, f"n={len(e['paired_pct'])}", transform=ax.get_yaxis_transform(),
                va="center", fontsize=8)
    ax.set_yticks(range(len(es)), [e["config"] for e in es])
    ax.set_xlabel("final val loss vs none of the same seed (%)")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.09), ncol=2)
    ax.set_title(f"ablation, paired by seed: {args.preset_name}, TP={args.tp}, "
                 f"{args.steps} steps", fontsize=10)
    return save_figure(fig, paired_plot_path(args.plot))


def plot_curves(rows: list[dict], args) -> Path:
    """One figure for all runs, drawn from the curves in the rows (so it can be redrawn from
    the JSON alone when run dirs live on other machines): (a) train loss (EMA) with val
    points, (b) val loss vs `none` in %. train.metrics.plot_runs draws the same curves but
    its legend does not fit 12 runs."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = [r for r in rows if r.get("curve") and r["curve"]["step"]]
    bases = {seed: r["curve"] for seed, r in seed_baselines(rows).items()}
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(14, 5))
    colors = plt.get_cmap("tab20")(np.linspace(0, 1, 20))
    for i, r in enumerate(rows):
        c, col = r["curve"], colors[(2 * i) % 20 if i < 10 else (2 * i + 1) % 20]
        loss = np.asarray(c["loss"], float)
        ema = np.copy(loss)
        k = 2.0 / (1 + max(len(loss) // 50, 1))
        for j in range(1, len(ema)):
            ema[j] = (1 - k) * ema[j - 1] + k * loss[j]
        ls = "--" if r["feedback"] else ("-." if r["seed"] != args.seed else "-")
        ax.plot(c["step"], ema, ls, color=col, lw=1.2, label=r["variant"])
        ax.plot(c["val_step"], c["val_loss"], "o", color=col, ms=3)
        base = bases.get(r["seed"])
        if base and base["val_step"]:
            ref = dict(zip(base["val_step"], base["val_loss"]))
            pts = [(s, 100 * (v - ref[s]) / ref[s]) for s, v in zip(c["val_step"],
                                                                   c["val_loss"]) if s in ref]
            if pts:
                bx.plot(*zip(*pts), "o" + ls, color=col, ms=3, lw=1, label=r["variant"])
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (EMA), val loss (dots)")
    bx.set_xlabel("step")
    bx.set_ylabel("val loss vs none of the same seed (%)")
    bx.axhline(0, color="k", lw=0.6)
    for a in (ax, bx):
        a.grid(alpha=0.3)
    bx.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.suptitle(f"ablation: {args.preset_name}, TP={args.tp}, {args.steps} steps, every "
                 f"all-reduce compressed")
    return save_figure(fig, args.plot)


def run_children(module: str, argvs: list[list[str]], start_json: str | None,
                 commit: str | None, tag: str) -> tuple[list[Path], list[str]]:
    """Run `python -m <module> *argv --json <own JSON>` for every argv at once, on the same
    devices (what one run leaves idle, compiles, evaluations and Python, the others fill).
    Each child's JSON starts as a copy of `start_json` (rows finished earlier) and each gets
    0.9/N of GPU memory unless XLA_PYTHON_CLIENT_MEM_FRACTION is set. -> (the children's
    JSON paths, in argv order; one line per child that failed)."""
    import subprocess
    import tempfile
    tmp = Path(tempfile.mkdtemp(prefix=f"{tag}-workers-"))
    # the children import this checkout's experiments package, wherever they start
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, GIT_COMMIT=commit or "", PYTHONPATH=path)
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / len(argvs):.2f}")
    procs = []
    for i, argv in enumerate(argvs):
        wjson = tmp / f"worker{i}.json"
        if start_json and Path(start_json).exists():
            wjson.write_text(Path(start_json).read_text())
        cmd = [sys.executable, "-m", module, *argv, "--json", str(wjson)]
        procs.append((subprocess.Popen(cmd, env=env), wjson))
    failed = []
    for i, (proc, _) in enumerate(procs):
        if proc.wait() != 0:
            failed.append(f"worker {i} exited with {proc.returncode}")
    return [w for _, w in procs], failed


def _run_workers(pending: list[dict], records: dict, args, cfg0, order: list[str]) -> dict:
    """--workers N: the pending variants, dealt round-robin, run in N child drivers at once
    (`run_children`); their rows are merged here and the table, JSON and plot written once.
    Step times measured this way are shared-device times."""
    from train.data import load_corpus
    load_corpus(cfg0.data, cfg0.model.vocab_size)   # tokenize once, before the children
    n = min(args.workers, len(pending))
    groups = [pending[i::n] for i in range(n)]
    argvs = []
    for i, group in enumerate(groups):
        print(f"[ablation] worker {i}: {' '.join(v['name'] for v in group)}", flush=True)
        argvs.append(["--config", args.config, "--steps", str(args.steps), "--tp", str(args.tp),
                      "--seed", str(args.seed), "--variants", *[v["name"] for v in group],
                      "--out-dir", args.out_dir, "--plot", "", "--budget-s", str(args.budget_s),
                      "--workers", "1", *(["--progress"] if args.progress else []),
                      *(["--set", *args.set] if args.set else [])])
    wjsons, failed = run_children("experiments.ablation", argvs, args.json, args.commit,
                                  "ablation")
    for group, wjson in zip(groups, wjsons):
        if wjson.exists():
            for r in json.loads(wjson.read_text())["rows"]:
                if r["variant"] in {v["name"] for v in group}:
                    records[r["variant"]] = {k: v for k, v in r.items()
                                             if k != "degradation_pct"}
    args.trained_here = True
    out = finish(records, args, order)
    left = [v["name"] for v in pending if v["name"] not in records]
    if left:
        print(f"[ablation] not finished: {left}. Re-run the same command to continue.",
              flush=True)
        out["unfinished"] = left
    if failed:
        raise RuntimeError(f"[ablation] {'; '.join(failed)} (finished rows are saved in "
                           f"{args.json or 'no JSON'}; its log is above)")
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m experiments.ablation", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny", help="preset name or YAML (default tiny)")
    p.add_argument("--steps", type=int, default=None, help="default: the preset's train.steps")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS))
    p.add_argument("--set", nargs="*", default=[], help="extra config overrides (k=v)")
    p.add_argument("--out-dir", default=None, help="default runs/ablation-<preset>")
    p.add_argument("--json", default="bench/results/ablation.json")
    p.add_argument("--plot", default="docs/ablation.png")
    p.add_argument("--budget-s", type=float, default=0, help="stop cleanly after S seconds")
    p.add_argument("--progress", action="store_true", help="tqdm bar per run")
    p.add_argument("--workers", type=int, default=1,
                   help="N > 1: train the pending variants in N processes at once, sharing "
                        "the devices (each gets 0.9/N of GPU memory), and merge their rows")
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error(f"--workers={args.workers} must be >= 1")
    args.commit = _commit()   # the code this driver runs
    args.trained_here, args.old_meta = False, None

    cfg0 = config_lib.load_config(args.config, args.set)
    setup_backend(cfg0)   # before anything starts JAX (the table asks for the device name)
    args.preset_name = cfg0.name
    args.steps = args.steps or cfg0.train.steps
    args.out_dir = args.out_dir or f"runs/ablation-{cfg0.name}"
    variants = [parse_variant(v, args.seed) for v in args.variants]
    if "none" not in [v["name"] for v in variants]:
        print("[ablation] no 'none' variant: degradations need the baseline", flush=True)

    records = old_records(args, [v["name"] for v in variants])
    order = [v["name"] for v in variants]
    order += [k for k in records if k not in order]
    if args.workers > 1:
        for v in variants:     # finished here before: read back, as the loop below would
            if v["name"] not in records and (rec := read_back(v, args)) is not None:
                records[v["name"]] = rec
        pending = [v for v in variants if v["name"] not in records]
        if len(pending) > 1:
            return _run_workers(pending, records, args, cfg0, order)
    budget = _Budget(args.budget_s)
    stopped = False
    for var in variants:
        if var["name"] in records and not run_dir_of(args.out_dir, var["name"]).exists():
            continue
        if budget.expired():
            stopped = True
            break
        args.trained_here = True
        rec = run_variant(var, args, budget)
        if rec is None:
            stopped = True
            break
        records[var["name"]] = rec
        finish(records, args, order)   # after every finished run: partial results survive
    out = finish(records, args, order)
    if stopped:
        left = [v["name"] for v in variants if v["name"] not in records]
        print(f"[ablation] stopped (time budget); not finished: {left}. Re-run the same "
              f"command to continue.", flush=True)
        out["unfinished"] = left
    return out


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
