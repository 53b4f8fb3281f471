"""python -m experiments.arch_fidelity: the codecs' error at each TP site of the two decoder
families (`model.arch` gpt and qwen), and how it grows through the layers.

    python -m experiments.arch_fidelity [--presets tiny qwen-tiny] [--steps 100] [--tp 4]
        [--codecs taco echo4] [--set k=v ...] [--json bench/results/arch_fidelity.json]

For each preset: `--steps` exact training steps (codec none, no TP:
`error_growth.train_exact`), then one forward+backward of the next training batch on a TP
mesh of `--tp` devices under `taco_jax.telemetry.capture(all_devices=True)`
(`error_growth`'s capture), once exact and once per codec with that codec at every TP
site (min_bytes 0, the LM head's too). Sites are named by block and place: fwd `attn-out`
/ `mlp-down` (the row-parallel partial sums entering g), bwd `attn-in` / `mlp-in` (the
cotangents of the norm's output that f all-reduces backward) and `head` (the LM head's f).

Two errors per codec and site, on TP member 0's tensor:
  quant  one encode+decode of the exact run's tensor: rel_l2 = ‖x̂ − x‖ / ‖x‖, the first
         quantization of the two-shot all-reduce (`fidelity.codec_rows`);
  drift  the tensor the compressed run brings to that site against the exact run's:
         ‖x_c − x‖ / ‖x‖, the error the sites before it (in execution order: every forward
         site, then the backward ones from the head down) have accumulated.
and, end to end, the compressed run's loss and gradients against the exact ones. Per site
also the exact tensor's rms, max|x|/rms and kurtosis (`fidelity.tensor_stats`): what makes
a tensor hard for a block-scaled codec.

Writes the JSON (device, jax, commit, settings; per preset: model, loss, sites with their
stats, rows per codec and site) and prints the tables docs/fidelity.md shows.
"""
from __future__ import annotations

import argparse
import math

import jax
import numpy as np

from experiments.error_growth import train_exact
from experiments.fidelity import codec_rows, tensor_stats

KINDS = ("fwd", "bwd")


def site_names(n_layer: int) -> dict:
    """{(kind, site index): (block or None, place)}: fwd sites in trace order (block 0's
    attention, its MLP, block 1's, ...); bwd in execution order (the head, then the last
    block's MLP and attention, down to block 0's attention)."""
    names = {}
    for i in range(2 * n_layer):
        names[("fwd", i)] = (i // 2, ("attn-out", "mlp-down")[i % 2])
    names[("bwd", 0)] = (None, "head")
    for k in range(2 * n_layer):
        names[("bwd", k + 1)] = (n_layer - 1 - k // 2, ("mlp-in", "attn-in")[k % 2])
    return names


def capture(cfg, overrides: list[str], devices, params, x, y) -> tuple[dict, float, dict]:
    """One forward+backward of (x, y) with `cfg` and `overrides`, capturing every member's
    TP all-reduce tensors -> ({(kind, site): member 0's tensor}, loss, gradients)."""
    from taco_jax import telemetry
    from train import config as config_lib
    from train.loop import build, build_mesh
    c = config_lib.replace(cfg, overrides)
    prog = build(c, build_mesh(c, devices))
    fn = jax.jit(prog.model.loss_and_grad_fn())          # a fresh trace, inside the block
    with c.recipe.context(), telemetry.capture(all_devices=True) as cap:
        loss, grads = fn(jax.device_put(params, prog.model.shardings), prog.put_batch(x),
                         prog.put_batch(y))
        jax.block_until_ready(loss)
    jax.effects_barrier()
    sites = {(r["kind"], r["site"]): np.asarray(r["value"]) for r in cap.records
             if r["device"] == 0 and r["call"] == 0}
    return sites, float(loss), jax.device_get(grads)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def _tree_rel(a, b) -> float:
    u, v = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)]) for t in (a, b))
    return _rel(u, v)


def measure(cfg, steps: int, tp: int, codecs: list[str]) -> dict:
    """Train `cfg` exactly for `steps`, capture at TP `tp` -> this preset's JSON entry."""
    _, state, batches = train_exact(cfg, steps)
    params = jax.device_get(state["params"])
    x, y = batches[steps]
    devices = jax.devices()[:tp]
    mesh = [f"parallel.tp={tp}", "parallel.data=1", "parallel.pipe=1", "parallel.emulate_tp=0",
            "model.min_bytes=0", "model.codec_head=null", "model.feedback=false"]
    exact, loss0, grads0 = capture(cfg, ["codec=none", *mesh], devices, params, x, y)
    names = site_names(cfg.model.n_layer)
    if set(exact) != set(names):
        raise RuntimeError(f"captured sites {sorted(exact)} are not the model's "
                           f"{sorted(names)}")
    order = sorted(exact)                                 # (kind, site)
    records = [{"kind": k, "site": s, "op": k, "value": exact[(k, s)]} for k, s in order]
    stats = tensor_stats(records, steps)
    sites = [{"kind": k, "site": s, "block": names[(k, s)][0], "place": names[(k, s)][1],
              "shape": st["shape"], "rms": st["rms"],
              "absmax_over_rms": st["absmax_over_rms"], "kurtosis": st["kurtosis"]}
             for (k, s), st in zip(order, stats)]
    rows, end_to_end = [], []
    for name in codecs:
        quant = {r["site"]: r["per_site"] for r in codec_rows(records, [name], steps)}
        run, loss, grads = capture(cfg, [f"codec={name}", *mesh], devices, params, x, y)
        for i, (k, s) in enumerate(order):
            j = [o for o in order if o[0] == k].index((k, s))
            rows.append({"codec": name, "kind": k, "site": s, "block": names[(k, s)][0],
                         "place": names[(k, s)][1], "quant": quant[k][j],
                         "drift": _rel(run[(k, s)], exact[(k, s)])})
        end_to_end.append({"codec": name, "loss": loss, "loss_rel": abs(loss - loss0) / loss0,
                           "grad_rel": _tree_rel(grads, grads0)})
    m = cfg.model
    return {"model": {k: getattr(m, k) for k in ("arch", "n_layer", "d_model", "n_head",
                                                 "n_kv_head", "d_ff", "vocab_size", "seq_len")},
            "train_steps": steps, "train_loss_at_capture": loss0, "sites": sites,
            "rows": rows, "end_to_end": end_to_end}


def place_table(results: dict) -> list[str]:
    """Markdown: quant rel_l2 per codec and place, pooled over the blocks (root mean square
    of the per-site errors), and the tensors' max|x|/rms, for every preset."""
    places = ("attn-out", "mlp-down", "attn-in", "mlp-in", "head")
    lines = ["| preset | codec | " + " | ".join(
        f"{'fwd' if p in ('attn-out', 'mlp-down') else 'bwd'} {p}" for p in places)
        + " | loss rel. err | grad rel. err |", "|---" * (len(places) + 4) + "|"]
    for preset, res in results.items():
        cr = {}
        for r in res["rows"]:
            cr.setdefault((r["codec"], r["place"]), []).append(r["quant"])
        for e in res["end_to_end"]:
            c = e["codec"]
            cells = [f"{math.sqrt(np.mean(np.square(cr[(c, p)]))):.4f}" for p in places]
            lines.append(f"| {preset} | {c} | " + " | ".join(cells)
                         + f" | {e['loss_rel']:.1e} | {e['grad_rel']:.3f} |")
        peak = {}
        for s in res["sites"]:
            peak.setdefault(s["place"], []).append(s["absmax_over_rms"])
        lines.append(f"| {preset} | max\\|x\\|/rms | " + " | ".join(
            f"{min(peak[p]):.1f}–{max(peak[p]):.1f}" for p in places) + " | | |")
    return lines


def growth_table(results: dict) -> list[str]:
    """Markdown: drift per block and place, per preset and codec (the error each site's
    input carries from the sites before it)."""
    lines = []
    head = ["fwd attn-out", "fwd mlp-down", "bwd attn-in", "bwd mlp-in"]
    for preset, res in results.items():
        lines += [f"\n{preset} ({res['model']['arch']}): drift by block; the backward pass "
                  f"runs from the head (first) down to block 0's attn-in",
                  "| codec | bwd head | block | " + " | ".join(head) + " |",
                  "|---" * (len(head) + 3) + "|"]
        for e in res["end_to_end"]:
            c = e["codec"]
            d = {(r["block"], r["place"]): r["drift"] for r in res["rows"] if r["codec"] == c}
            for b in range(res["model"]["n_layer"]):
                lines.append(f"| {c} | {d[(None, 'head')]:.4f} | {b} | " + " | ".join(
                    f"{d[(b, p.split()[1])]:.4f}" for p in head) + " |")
    return lines


def main(argv=None) -> dict:
    from bench.common import env_facts, write_json
    from train import config as config_lib
    from train.loop import setup_backend

    ap = argparse.ArgumentParser(prog="python -m experiments.arch_fidelity",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", nargs="+", default=["tiny", "qwen-tiny"])
    ap.add_argument("--steps", type=int, default=100, help="exact training steps first")
    ap.add_argument("--tp", type=int, default=4, help="TP size of the capture")
    ap.add_argument("--codecs", nargs="+", default=["taco", "echo4"])
    ap.add_argument("--set", nargs="*", default=[], help="overrides for every preset")
    ap.add_argument("--json", default="bench/results/arch_fidelity.json")
    args = ap.parse_args(argv)

    cfgs = {p: config_lib.load_config(p, ["train.progress=false", *args.set])
            for p in args.presets}
    setup_backend(config_lib.replace(next(iter(cfgs.values())),
                                     [f"parallel.cpu_devices={args.tp}"]))
    results = {}
    for preset, cfg in cfgs.items():
        print(f"[arch_fidelity] {preset}: {args.steps} exact steps, capture at TP={args.tp}",
              flush=True)
        results[preset] = measure(cfg, args.steps, args.tp, args.codecs)
    print("\none quantization (quant rel. L2, root mean square over the blocks):")
    print("\n".join(place_table(results)))
    print("\n".join(growth_table(results)))
    facts = env_facts()
    out = {"device": facts["device"], "platform": facts["platform"], "jax": jax.__version__,
           "commit": facts["commit"], "steps": args.steps, "tp": args.tp,
           "codecs": args.codecs, "set": args.set, "presets": results, "env": facts}
    if args.json:
        write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
