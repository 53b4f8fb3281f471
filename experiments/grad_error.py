"""Loss and gradient error of compressed TP all-reduces against the exact ones, at the
parameters of a trained run (one forward + backward per batch, no update).

    python -m experiments.grad_error --load RUN_DIR [--variants exact echo4 echo4+feedback ...]
        [--batches 4] [--set k=v ...] [--out bench/results/grad_error.json]

A variant is `exact` (codec none), `CODEC`, `CODEC+feedback`, or a one-direction form
`fwd:CODEC` / `bwd:CODEC` (the other direction exact), also with `+feedback` (error
feedback at every compressing site, backward ones included: model.feedback_bwd). Every variant
runs on the same parameters (the run's latest Orbax checkpoint) and the same training
batches. Reported per variant, averaged over the batches: |loss − exact loss|, the relative
L2 error of the whole gradient (pooled over batches) and its cosine with the exact one; the
same error per parameter group; and whether the error repeats across batches (err_cos,
err_mean_ratio: independent errors average out over steps, a repeated one is a bias).
This is what one training step sees; comparing it with how runs *train* separates a wrong
gradient from an effect that only builds up over steps.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import jax
import numpy as np

from bench.common import env_facts, print_table, write_json
from experiments import ablation
from train import config as config_lib
from train.checkpoint import Checkpointer
from train.data import Batches, load_corpus
from train.loop import build, build_mesh, setup_backend

DEFAULT = ["exact", "echo4", "echo4+feedback", "fwd:echo4", "fwd:echo4+feedback",
           "bwd:echo4", "bwd:echo4+feedback", "taco", "taco+feedback"]


def overrides(variant: str) -> list[str]:
    """'bwd:echo4+feedback' -> config overrides (the variant grammar of experiments.ablation;
    here +feedback means every compressing site, the backward ones included)."""
    if variant == "exact":
        return ["codec=none", "model.feedback=false"]
    var = ablation.parse_variant(variant, 0)
    fwd, bwd = ablation.codec_pair(var)
    on = str(var["feedback"]).lower()
    return [f"model.codec_fwd={fwd}", f"model.codec_bwd={bwd}", f"model.feedback={on}",
            f"model.feedback_bwd={'true' if var['feedback'] and bwd != 'none' else 'false'}",
            "model.min_bytes=0"]


def param_group(path: str) -> str:
    """A parameter's group from its pytree path: embeddings, layernorm, attention, mlp, head."""
    p = path.lower()
    for key, name in (("wte", "embed"), ("wpe", "embed"), ("lm_head", "head"), ("ln", "norm"),
                      ("attn", "attention"), ("mlp", "mlp")):
        if key in p:
            return name
    return "other"


def _flat_err(o, e):
    return np.concatenate([(a - b).ravel() for a, b in zip(o[1], e[1])])


def error_persistence(outs, ex) -> dict:
    """Does the gradient error repeat from batch to batch (a bias the optimizer accumulates)
    or average out? err_cos: mean cosine between the errors of two different batches (≈ 0
    for independent errors); err_mean_ratio: ‖mean error‖ / mean ‖error‖ (1/sqrt(batches)
    for independent errors of equal size, 1 for a constant bias); err_gain: mean of
    err·g / g·g, the error's share along the exact gradient g; adam_rel_err /
    adam_mean_err: the error (and its batch mean) per coordinate over that coordinate's RMS
    gradient, as Adam's normalisation weighs it."""
    errs = [_flat_err(o, e) for o, e in zip(outs, ex)]
    norms = [np.linalg.norm(v) for v in errs]
    if len(errs) < 2 or min(norms) == 0:
        return {"err_cos": 0.0, "err_mean_ratio": 0.0, "err_gain": 0.0, "adam_rel_err": 0.0,
                "adam_mean_err": 0.0}
    cos = [errs[i] @ errs[j] / (norms[i] * norms[j])
           for i in range(len(errs)) for j in range(i + 1, len(errs))]
    ratio = np.linalg.norm(np.mean(errs, axis=0)) / np.mean(norms)
    # the error's component along the exact gradient, as a fraction of it: < 0 shrinks the
    # step (a lower effective learning rate), > 0 lengthens it
    exact = [np.concatenate([b.ravel() for b in e[1]]) for e in ex]
    gain = np.mean([v @ g / (g @ g) for v, g in zip(errs, exact)])
    # in Adam's units: each coordinate's error over that coordinate's RMS gradient (what
    # the second-moment normalisation divides by), so small-gradient coordinates count
    # as much as large ones; adam_mean_err: the part that repeats across batches
    rms = np.sqrt(np.mean(np.square(exact), axis=0))
    keep = rms > 0
    z = np.stack(errs)[:, keep] / rms[keep]
    return {"err_cos": round(float(np.mean(cos)), 4), "err_mean_ratio": round(float(ratio), 4),
            "err_gain": round(float(gain), 5),
            "adam_rel_err": round(float(np.sqrt(np.mean(z ** 2))), 4),
            "adam_mean_err": round(float(np.sqrt(np.mean(np.mean(z, axis=0) ** 2))), 4)}


def group_errors(outs, ex, groups) -> dict:
    """Relative L2 gradient error per parameter group, pooled over batches."""
    num, den = {}, {}
    for o, e in zip(outs, ex):
        for grp, a, b in zip(groups, o[1], e[1]):
            num[grp] = num.get(grp, 0.0) + float(np.sum((a - b) ** 2))
            den[grp] = den.get(grp, 0.0) + float(np.sum(b ** 2))
    return {g: round(float(np.sqrt(num[g] / den[g])), 5) if den[g] else 0.0 for g in num}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--load", required=True, help="run dir with config.yaml and ckpt/")
    ap.add_argument("--variants", nargs="+", default=DEFAULT)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--set", nargs="*", default=[], help="extra config overrides")
    ap.add_argument("--out", default="bench/results/grad_error.json")
    args = ap.parse_args(argv)
    run = Path(args.load)
    if "exact" not in args.variants:
        args.variants = ["exact", *args.variants]
    base = config_lib.load_config(run / "config.yaml", args.set)
    setup_backend(base)
    mesh = build_mesh(base)
    corpus = load_corpus(base.data, base.model.vocab_size)
    batches = Batches(corpus.train, base.train.batch_size, base.model.seq_len, 12345, stream=0)
    params, step, results, groups = None, None, {}, None
    for v in args.variants:
        cfg = config_lib.load_config(run / "config.yaml", [*args.set, *overrides(v)])
        prog = build(cfg, mesh)
        if params is None:
            ck = Checkpointer(run / "ckpt")
            restored = ck.restore_latest(prog.init(cfg.train.seed), name=cfg.name,
                                         set_aside=False)
            ck.close()
            if restored is None:
                raise FileNotFoundError(f"no checkpoint under {run / 'ckpt'}")
            state, _, step = restored
            params = state["params"]
        fn = jax.jit(prog.model.loss_and_grad_fn())
        outs = []
        for b in range(args.batches):
            x, y = batches[b]
            loss, g = fn(params, prog.put_batch(x), prog.put_batch(y))
            leaves = jax.tree_util.tree_leaves_with_path(g)
            if groups is None:      # the same pytree for every variant and batch
                groups = [param_group(jax.tree_util.keystr(k)) for k, _ in leaves]
            outs.append((float(loss), [np.asarray(a, np.float64) for _, a in leaves]))
        results[v] = outs
    ex = results["exact"]
    rows = []
    for v, outs in results.items():
        num = sum(np.sum((a - b) ** 2) for o, e in zip(outs, ex) for a, b in zip(o[1], e[1]))
        den = sum(np.sum(b ** 2) for e in ex for b in e[1])
        cos = np.mean([sum(np.sum(a * b) for a, b in zip(o[1], e[1])) / np.sqrt(
            sum(np.sum(a * a) for a in o[1]) * sum(np.sum(b * b) for b in e[1]))
            for o, e in zip(outs, ex)])
        rows.append({"variant": v, "loss": round(float(np.mean([o[0] for o in outs])), 5),
                     "abs_dloss": float(f"{np.mean([abs(o[0] - e[0]) for o, e in zip(outs, ex)]):.3e}"),
                     "grad_rel_err": round(float(np.sqrt(num / den)), 5),
                     "grad_cos": round(float(cos), 6),
                     **error_persistence(outs, ex),
                     "group_rel_err": group_errors(outs, ex, groups)})
    print(f"run {run} at step {step}, {args.batches} batches")
    print_table(rows, [c for c in rows[0] if c != "group_rel_err"])
    for r in rows:
        print(f"  {r['variant']:>24}: " + "  ".join(f"{g} {e}" for g, e in
                                                     r["group_rel_err"].items()))
    payload = {**env_facts(), "run": str(run), "preset": base.name, "step": step,
               "tp": int(mesh.shape["tp"]), "dtype": base.model.dtype, "rows": rows}
    if args.out:
        write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
