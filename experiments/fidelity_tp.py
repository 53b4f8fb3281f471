"""python -m experiments.fidelity_tp: how much does each codec degrade training at TP8 (and
TP4), measured so that the noise is below the effect. The TACO paper's Table 1 / ablation
question, with tensor parallelism emulated on one GPU.

    python -m experiments.fidelity_tp --tp 8 --preset fidelity [--steps N]
        [--codecs none taco taco-1scale hadamard-fp8 fp8 taco-e5m2 taco-int8 echo4
                  echo4+feedback] [--seeds 0 1 2] [--eval-batches 0] [--budget-s S]
        [--json bench/results/fidelity_tp8.json] [--plot docs/fidelity_tp8.png]
        [--out-dir runs/fidelity_tp8-<preset>] [--workers N] [--set k=v ...]

Every run trains `--preset` for `--steps` with TP of size `--tp` emulated on one device
(parallel.emulate_tp, parallel.data=1: the same tensors compressed at the same sites as on
that many GPUs), every all-reduce compressed forward and backward (min_bytes 0), through
experiments.ablation's machinery (`train.run`, one run dir per run, resumable).
A run is `<codec>@seed<N>`; runs go seed by seed, `none` (bf16) first, so whatever a time
budget leaves finished comes in complete pairs.

The protocol (docs/fidelity.md, "TP8/TP4 fidelity protocol"):
  - the corpus is not repeated: tokens_seen = steps x batch x seq_len is checked against
    the training split's tokens (a warning when the run would see the corpus more than once);
  - the score is the final parameters' mean loss over the whole validation split, cut into
    non-overlapping windows dealt into batches in one fixed order (the same for every run,
    `val_windows`); per-batch losses are kept, so the score's own standard error
    (`val_se_pct`) and that of each paired difference (`eval_se_pct`) are computed, not
    assumed;
  - the LR schedule decays to optim.min_lr at the last step (train.loop.make_optimizer);
  - bf16 (`none`) runs of every seed give the seed-to-seed spread the codecs are read against.
Each codec is compared with the `none` run of the same seed (same init, data order,
validation tokens): mean paired difference over seeds with its two-sided 90% Student-t
interval (experiments.ablation.paired_summary).

Resumable: finished runs (and their scores, `val_eval.json` in the run dir) are read back;
an interrupted run resumes from its checkpoint; diverged runs (NaN loss) are recorded once.
Rows already in the JSON whose run dir is not on this machine are kept (a study spread over
several machines or calls), if they were made with the same preset, steps, TP and corpus.
`--budget-s S` stops cleanly S seconds after the driver starts (tokenizing the corpus
included), and does not start a run that the time left cannot finish (estimated from the
wall time of finished runs of the same codec, else of any).
`--workers N` trains the pending runs in N child drivers at once on the same device, dealt
in contiguous groups of near-equal length (`deal`), and merges their rows: one run's compiles, host
work and evaluation leave the GPU idle, the others fill it. Step times are then
shared-device times.
Error feedback (`echo4+feedback`: model.feedback, Echo's forward sites) runs emulated as on a
mesh (tests/models/test_emulate_tp.py).

JSON: {"device", "jax", "commit", "tp", "emulated": true, "preset", "steps",
"tokens_seen", "corpus_tokens", "bf16_seed_spread_pct", "rows": [{"codec", "seed",
"final_val_loss", ...}], "paired": [{"config", "seeds", "n", "mean_pct", "ci90_pct", ...}],
...}; plots: loss curves (`--plot`) and the paired differences (`<plot>_paired.png`).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from bench.common import write_json
from experiments import ablation
from train import config as config_lib
from train.loop import setup_backend

CODECS = ("none", "taco", "taco-1scale", "hadamard-fp8", "fp8", "taco-e5m2", "taco-int8",
          "echo4", "echo4+feedback")
VAL_ORDER_SEED = 0          # the order windows are dealt into validation batches
EVAL_FILE = "val_eval.json"  # per run dir: the protocol's score of the final parameters


# -- the validation set --------------------------------------------------------------------
def val_windows(n_tokens: int, batch_size: int, seq_len: int, max_batches: int = 0
                ) -> np.ndarray:
    """Start offsets (n_batches, batch_size) of the protocol's validation batches: the split
    cut into non-overlapping windows of seq_len inputs (+1 target), dealt into batches in
    one fixed random order; the remainder (< batch_size windows) is left out. max_batches
    > 0 keeps the first that many batches. Every window is scored at most once."""
    n_windows = (n_tokens - 1) // seq_len
    n_batches = n_windows // batch_size
    if max_batches:
        n_batches = min(n_batches, max_batches)
    if n_batches < 1:
        raise ValueError(f"the validation split holds {n_tokens} tokens: fewer than one "
                         f"batch of {batch_size} x {seq_len + 1}")
    order = np.random.default_rng(VAL_ORDER_SEED).permutation(n_windows)
    return (order[: n_batches * batch_size] * seq_len).reshape(n_batches, batch_size)


def val_batch(tokens: np.ndarray, starts: np.ndarray, seq_len: int):
    """(inputs, targets) int32 (B, seq_len) of the windows starting at `starts`."""
    idx = starts[:, None] + np.arange(seq_len + 1)
    w = np.asarray(tokens[idx], dtype=np.int32)
    return w[:, :-1], w[:, 1:]


# -- statistics ----------------------------------------------------------------------------
def se_pct(losses) -> float | None:
    """Standard error of the mean of per-batch losses, in % of that mean (None for < 2)."""
    if len(losses) < 2:
        return None
    return 100 * statistics.stdev(losses) / math.sqrt(len(losses)) / statistics.fmean(losses)


def paired_se_pct(losses, base) -> float | None:
    """Standard error of the mean per-batch difference (losses − base, the same batches), in
    % of base's mean: the validation set's share of the noise of one paired difference."""
    if len(losses) != len(base) or len(losses) < 2:
        return None
    d = [a - b for a, b in zip(losses, base)]
    return 100 * statistics.stdev(d) / math.sqrt(len(d)) / statistics.fmean(base)


def seed_spread_pct(losses) -> float | None:
    """(max − min) / mean of the final losses of the bf16 runs over seeds, in %."""
    losses = [v for v in losses if v is not None and math.isfinite(v)]
    if len(losses) < 2:
        return None
    return 100 * (max(losses) - min(losses)) / statistics.fmean(losses)


def seed_sd_pct(losses) -> float | None:
    losses = [v for v in losses if v is not None and math.isfinite(v)]
    if len(losses) < 2:
        return None
    return 100 * statistics.stdev(losses) / statistics.fmean(losses)


# -- runs ----------------------------------------------------------------------------------
def variant(codec: str, seed: int) -> dict:
    """A run: `<codec>@seed<N>` parsed as experiments.ablation does."""
    return ablation.parse_variant(f"{codec}@seed{seed}", seed)


def run_order(codecs, seeds) -> list[dict]:
    """Seed by seed, `none` first: a time budget leaves complete pairs behind."""
    codecs = list(dict.fromkeys(codecs))
    if "none" in codecs:
        codecs.remove("none")
        codecs.insert(0, "none")
    return [variant(c, s) for s in seeds for c in codecs]


def deal(runs: list[dict], n: int) -> list[list[dict]]:
    """The runs in n contiguous groups of near-equal length (the first ones one longer),
    in run order: the workers finish together, and since runs go seed by seed with `none`
    first, most pairs stay in one group (a budget that stops a group stops at its end)."""
    n = min(n, len(runs))
    size, extra = divmod(len(runs), n)
    groups, i = [], 0
    for k in range(n):
        j = i + size + (k < extra)
        groups.append(runs[i:j])
        i = j
    return groups


def _finished_here(var: dict, args) -> bool:
    run_dir = ablation.run_dir_of(args.out_dir, var["name"])
    rec = ablation.read_back(var, args)
    return rec is not None and (rec.get("diverged") or (run_dir / EVAL_FILE).exists())


def _run_workers(pending: list[dict], rows: dict, args, budget) -> list[str]:
    """--workers N: `pending` dealt (`deal`) over N child drivers at once
    (experiments.ablation.run_children), their rows merged into `rows`. -> failures."""
    groups = deal(pending, args.workers)
    left = None if budget.t_end is None else max(1.0, budget.t_end - time.monotonic())
    argvs = []
    for i, group in enumerate(groups):
        print(f"[fidelity_tp] worker {i}: {' '.join(v['name'] for v in group)}", flush=True)
        argvs.append(["--tp", str(args.tp), "--preset", args.preset, "--steps", str(args.steps),
                      "--runs", *[v["name"] for v in group], "--seeds", *map(str, args.seeds),
                      "--eval-batches", str(args.eval_batches), "--out-dir", args.out_dir,
                      "--plot", "", "--workers", "1",
                      *(["--budget-s", f"{left:.0f}"] if left is not None else []),
                      *(["--progress"] if args.progress else []),
                      *(["--set", *args.set] if args.set else [])])
    wjsons, failed = ablation.run_children("experiments.fidelity_tp", argvs, args.json,
                                           args.commit, "fidelity_tp")
    for group, wjson in zip(groups, wjsons):
        if wjson.exists():
            names = {v["name"] for v in group}
            rows.update({r["variant"]: r for r in json.loads(wjson.read_text())["rows"]
                         if r["variant"] in names})
    args.trained_here = True
    return failed


def score(run_dir: Path, max_batches: int) -> dict:
    """The protocol's score of a finished run: its final checkpoint's loss on every
    validation batch (`val_windows`), under the run's own config (its codec in the
    forward all-reduces, as train.run's evaluation). Written to run_dir/val_eval.json."""
    from train.checkpoint import Checkpointer
    from train.data import load_corpus
    from train.loop import build, build_mesh

    cfg = config_lib.from_dict(config_lib.read_yaml((run_dir / "config.yaml").read_text()))
    prog = build(cfg, build_mesh(cfg))
    ck = Checkpointer(run_dir / "ckpt", keep=cfg.train.keep, async_save=False)
    try:
        restored = ck.restore_latest(prog.abstract_state(), name=cfg.name, set_aside=False)
    finally:
        ck.close()
    if restored is None:
        raise FileNotFoundError(f"no checkpoint under {run_dir / 'ckpt'}")
    state, _, step = restored
    corpus = load_corpus(cfg.data, cfg.model.vocab_size, verbose=False)
    T = cfg.model.seq_len
    starts = val_windows(len(corpus.val), cfg.train.batch_size, T, max_batches)
    t0 = time.perf_counter()
    losses = [prog.eval_loss(state["params"], *map(prog.put_batch,
                                                  val_batch(corpus.val, s, T)))
              for s in starts]
    losses = [float(np.asarray(x)) for x in losses]
    out = {"step": step, "val_batches": len(losses), "val_tokens": len(losses) * starts.shape[1] * T,
           "val_loss": statistics.fmean(losses), "val_se_pct": se_pct(losses),
           "val_batch_losses": [round(v, 6) for v in losses],
           "eval_s": time.perf_counter() - t0}
    (run_dir / EVAL_FILE).write_text(json.dumps(out, indent=1))
    return out


def row_of(rec: dict, ev: dict | None, wall_s: float | None) -> dict:
    """A JSON row: the ablation record with the protocol's score as final_val_loss (train's
    own few-batch evaluation kept as train_val_loss)."""
    row = {"codec": ablation.config_key(rec), **rec}
    row["train_val_loss"] = rec.get("final_val_loss")
    if ev is not None:
        row.update(final_val_loss=ev["val_loss"], val_se_pct=ev["val_se_pct"],
                   val_batches=ev["val_batches"], val_tokens=ev["val_tokens"],
                   val_batch_losses=ev["val_batch_losses"])
    if wall_s is not None:
        row["wall_s"] = wall_s
    return row


def _codec_wall(rows: dict, codec: str) -> float | None:
    """Estimated wall time of one more run of `codec`: the longest finished one of that
    codec, else of any codec (None when nothing finished yet)."""
    same = [r["wall_s"] for r in rows.values() if r.get("wall_s") and r["codec"] == codec]
    every = [r["wall_s"] for r in rows.values() if r.get("wall_s")]
    return max(same) if same else (max(every) if every else None)


def old_rows(args) -> dict:
    """Rows of args.json made with the same preset, steps, TP, emulation and corpus, by
    variant (sets args.old_meta); others are dropped, with a note."""
    if not (args.json and Path(args.json).exists()):
        return {}
    old = json.loads(Path(args.json).read_text())
    same = ((old.get("preset"), old.get("steps"), old.get("tp"), old.get("emulated"),
             old.get("corpus")) == (args.preset_name, args.steps, args.tp, True, args.corpus))
    if not same:
        print(f"[fidelity_tp] {args.json}: made with another preset, steps, TP or corpus; "
              f"its rows are not reused", flush=True)
        return {}
    args.old_meta = {"device": old.get("device"), "commit": old.get("commit")}
    return {r["variant"]: r for r in old.get("rows", [])}


def paired_rows(rows: list[dict]) -> list[dict]:
    """experiments.ablation.paired_summary over the scored rows, with n, the runs that
    diverged (NaN, or over 2x the none of the same seed) and each pair's validation-set
    standard error (`eval_se_pct`: mean over its seeds of `paired_se_pct`)."""
    base = ablation.seed_baselines(rows)
    diverged = {}
    finite = []
    for r in rows:
        b = base.get(r["seed"])
        v = r["final_val_loss"]
        bad = v is None or not math.isfinite(v) or (b is not None and v > 2 * b["final_val_loss"])
        if bad:
            diverged.setdefault(r["codec"], []).append(r["seed"])
        else:
            finite.append(r)
    out = []
    for e in ablation.paired_summary(finite):
        ses = []
        for run in e["runs"]:
            r = next(x for x in finite if x["variant"] == run)
            b = base[r["seed"]]
            s = paired_se_pct(r.get("val_batch_losses") or [], b.get("val_batch_losses") or [])
            if s is not None:
                ses.append(s)
        out.append({"config": e["config"], "seeds": e["seeds"], "n": len(e["seeds"]),
                    "mean_pct": e["mean_pct"], "ci90_pct": e["ci90_pct"],
                    "paired_pct": e["paired_pct"], "sem_pct": e["sem_pct"],
                    "eval_se_pct": statistics.fmean(ses) if ses else None,
                    "diverged_seeds": diverged.pop(e["config"], [])})
    for config, seeds in diverged.items():       # every seed of it diverged
        out.append({"config": config, "seeds": [], "n": 0, "mean_pct": None, "ci90_pct": None,
                    "paired_pct": [], "sem_pct": None, "eval_se_pct": None,
                    "diverged_seeds": seeds})
    return out


def summarize(rows: list[dict], args) -> dict:
    import jax
    bf16 = [r["final_val_loss"] for r in rows if r["codec"] == "none"]
    paired = paired_rows(rows)
    meta = (args.old_meta if args.old_meta and not args.trained_here
            else {"device": ablation._device(), "commit": args.commit})
    ses = [r["val_se_pct"] for r in rows if r.get("val_se_pct") is not None]
    return {"device": meta["device"], "jax": jax.__version__, "commit": meta["commit"],
            "tp": args.tp, "emulated": True, "preset": args.preset_name, "steps": args.steps,
            "tokens_seen": args.tokens_seen, "corpus_tokens": args.corpus_tokens,
            "bf16_seed_spread_pct": seed_spread_pct(bf16),
            "rows": rows, "paired": paired,
            "bf16_seed_sd_pct": seed_sd_pct(bf16), "bf16_seeds": len(bf16),
            "val_tokens": args.val_tokens, "val_batches": args.val_batches,
            "val_se_pct_max": max(ses) if ses else None,
            "corpus": args.corpus}


def print_table(out: dict) -> None:
    print(f"\nTP={out['tp']} (emulated), {out['preset']}, {out['steps']} steps, "
          f"{out['tokens_seen'] / 1e6:.1f}M tokens seen of {out['corpus_tokens'] / 1e6:.1f}M "
          f"(ratio {out['tokens_seen'] / out['corpus_tokens']:.2f}); validation "
          f"{out['val_batches']} batches = {out['val_tokens'] / 1e6:.2f}M tokens")
    print(f"{'run':<22}{'val loss':>10}{'± s.e. %':>10}")
    for r in out["rows"]:
        v, s = r["final_val_loss"], r.get("val_se_pct")
        print(f"{r['variant']:<22}{v if v is not None else float('nan'):>10.4f}"
              f"{'' if s is None else f'{s:.3f}':>10}")
    sp, sd = out["bf16_seed_spread_pct"], out["bf16_seed_sd_pct"]
    if sp is not None:
        print(f"bf16 seed spread (max - min) {sp:.3f}%, s.d. {sd:.3f}% over "
              f"{out['bf16_seeds']} seeds")
    print(f"\n{'paired vs none, same seed':<26}{'n':>3}{'mean %':>9}{'90% CI':>19}"
          f"{'val s.e.':>10}  diverged")
    for e in out["paired"]:
        if e["config"] == "none":
            continue
        ci, m, es = e["ci90_pct"], e["mean_pct"], e["eval_se_pct"]
        print(f"{e['config']:<26}{e['n']:>3}{'' if m is None else f'{m:+.3f}':>9}"
              f"{'' if ci is None else f'[{ci[0]:+.3f}, {ci[1]:+.3f}]':>19}"
              f"{'' if es is None else f'{es:.3f}':>10}  "
              f"{', '.join(f'seed {s}' for s in e['diverged_seeds'])}")


def write(rows: dict, args, order: list[str]) -> dict:
    ordered = [rows[k] for k in order if k in rows] + [r for k, r in rows.items()
                                                       if k not in order]
    out = summarize(ordered, args)
    print_table(out)
    if args.json:
        write_json(args.json, out)
    if args.plot and ordered:
        pargs = argparse.Namespace(preset_name=f"{args.preset_name} TP{args.tp} emulated",
                                   tp=args.tp, steps=args.steps, plot=args.plot,
                                   seed=args.seeds[0])
        print(f"wrote {ablation.plot_curves(ordered, pargs)}")
        paired = [{**e, "config": e["config"]} for e in out["paired"] if e["n"]]
        if any(e["config"] != "none" for e in paired):
            print(f"wrote {ablation.plot_paired(paired, None, pargs)}")
    return out


def corpus_facts(cfg) -> dict:
    """Tokenize (once, cached) and count: train and validation tokens, cache key."""
    from train.data import load_corpus
    c = load_corpus(cfg.data, cfg.model.vocab_size)
    return {"corpus_tokens": len(c.train), "val_split_tokens": len(c.val),
            "corpus": c.path.name}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m experiments.fidelity_tp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=8, help="emulated tensor-parallel size")
    p.add_argument("--preset", default="fidelity", help="preset name or YAML")
    p.add_argument("--steps", type=int, default=None, help="default: the preset's")
    p.add_argument("--codecs", nargs="+", default=list(CODECS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--eval-batches", type=int, default=0,
                   help="validation batches scored (0 = the whole split)")
    p.add_argument("--set", nargs="*", default=[], help="extra config overrides (k=v)")
    p.add_argument("--out-dir", default=None, help="default runs/fidelity_tp<tp>-<preset>")
    p.add_argument("--json", default=None, help="default bench/results/fidelity_tp<tp>.json")
    p.add_argument("--plot", default=None, help="default docs/fidelity_tp<tp>.png ('' = none)")
    p.add_argument("--budget-s", type=float, default=0, help="stop cleanly after S seconds")
    p.add_argument("--progress", action="store_true", help="tqdm bar per run")
    p.add_argument("--workers", type=int, default=1,
                   help="N > 1: train the pending runs in N processes at once on the same "
                        "device (each gets 0.9/N of its memory), in contiguous groups")
    p.add_argument("--runs", nargs="+", default=None, metavar="CODEC@seedN",
                   help="exactly these runs, in this order (instead of --codecs x --seeds)")
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error(f"--workers={args.workers} must be >= 1")
    t_start = time.monotonic()
    budget = ablation._Budget(args.budget_s)    # counts from here: tokenizing included
    args.commit = ablation._commit()
    args.trained_here, args.old_meta, args.emulate = False, None, True
    args.config = args.preset
    args.json = f"bench/results/fidelity_tp{args.tp}.json" if args.json is None else args.json
    args.plot = f"docs/fidelity_tp{args.tp}.png" if args.plot is None else args.plot

    cfg0 = config_lib.load_config(args.preset, [*args.set, "parallel.tp=0", "parallel.data=1",
                                                f"parallel.emulate_tp={args.tp}"])
    setup_backend(cfg0)
    args.preset_name = cfg0.name
    args.steps = args.steps or cfg0.train.steps
    args.out_dir = args.out_dir or f"runs/fidelity_tp{args.tp}-{cfg0.name}"
    facts = corpus_facts(cfg0)
    args.corpus, args.corpus_tokens = facts["corpus"], facts["corpus_tokens"]
    T, B = cfg0.model.seq_len, cfg0.train.batch_size
    args.tokens_seen = args.steps * B * T
    starts = val_windows(facts["val_split_tokens"], B, T, args.eval_batches)
    args.val_batches, args.val_tokens = starts.shape[0], starts.size * T
    ratio = args.tokens_seen / args.corpus_tokens
    print(f"[fidelity_tp] TP={args.tp} emulated, {cfg0.name}: {args.tokens_seen / 1e6:.1f}M "
          f"tokens seen / {args.corpus_tokens / 1e6:.1f}M corpus tokens = {ratio:.2f}; "
          f"validation {args.val_batches} x {B} x {T} tokens", flush=True)
    if ratio >= 1:
        print(f"[fidelity_tp] WARNING: the runs see the corpus {ratio:.2f} times; the protocol "
              f"asks for < 1 (more data.paths, or fewer steps)", flush=True)

    if args.runs:
        runs = []
        for name in args.runs:
            codec, sep, seed = name.partition("@seed")
            if not (sep and seed.isdigit()):
                p.error(f"--runs: {name!r} is not CODEC@seedN")
            runs.append(variant(codec, int(seed)))
    else:
        runs = run_order(args.codecs, args.seeds)
    order = [v["name"] for v in runs]
    rows = old_rows(args)
    stopped, failed = False, []
    if args.workers > 1:
        pending = [v for v in runs
                   if not (v["name"] in rows
                            and not ablation.run_dir_of(args.out_dir, v["name"]).exists())
                   and not _finished_here(v, args)]
        if len(pending) > 1:
            failed = _run_workers(pending, rows, args, budget)
    for var in runs:
        if failed:
            break       # the children's finished rows are merged; nothing is retried here
        run_dir = ablation.run_dir_of(args.out_dir, var["name"])
        if var["name"] in rows and not run_dir.exists():
            continue        # a row from another machine or call
        rec = ablation.read_back(var, args)
        if rec is None:
            left = None if budget.t_end is None else budget.t_end - time.monotonic()
            est = _codec_wall(rows, var["codec"])
            if left is not None and (left <= 0 or (est is not None and est > left)):
                print(f"[fidelity_tp] {var['name']}: {left:.0f} s left, a run takes "
                      f"~{est or 0:.0f} s: not started", flush=True)
                stopped = True
                break
            args.trained_here = True
            t0 = time.monotonic()
            rec = ablation.run_variant(var, args, budget)
            if rec is None:
                stopped = True
                break
            wall = time.monotonic() - t0
        else:
            wall = (rows.get(var["name"]) or {}).get("wall_s")
        ev = None
        if not rec.get("diverged"):
            f = run_dir / EVAL_FILE
            if f.exists():
                ev = json.loads(f.read_text())
            else:
                t0 = time.monotonic()
                ev = score(run_dir, args.eval_batches)
                wall = (wall or 0) + time.monotonic() - t0
            if ev["val_batches"] != args.val_batches:
                ev = score(run_dir, args.eval_batches)
        rows[var["name"]] = row_of(rec, ev, wall)
        write(rows, args, order)
    out = write(rows, args, order)
    if stopped:
        left = [v["name"] for v in runs if v["name"] not in rows]
        print(f"[fidelity_tp] stopped (time budget) after {time.monotonic() - t_start:.0f} s; "
              f"not finished: {left}. Re-run the same command to continue.", flush=True)
        out["unfinished"] = left
    if failed:
        raise RuntimeError(f"[fidelity_tp] {'; '.join(failed)} (finished rows are saved in "
                           f"{args.json or 'no JSON'}; its log is above)")
    return out


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
