"""python -m experiments.pp_codecs: codecs on the tensors pipeline stages hand each other,
activations forward and cotangents backward, from a trained GPT.

    python -m experiments.pp_codecs [--config tiny] [--steps 300] [--stages N]
        [--microbatches 2] [--codecs tah4 taco echo4 int4-sym fp8 block-fp8 taco-int8]
        [--high taco-int8] [--set k=v ...] [--json bench/results/pp_codecs.json]

Trains the GPT exactly (codec none, one device) for --steps, then runs one forward+backward
of the next training batch pipelined over --stages stages (default: model.n_layer, a stage
boundary after every block but the last; codec none, on that many devices: simulated CPUs
here) under `taco_jax.telemetry.capture(all_devices=True)`, which hands over what every
`taco_jax.ppermute` sends: the residual stream a stage passes to the next, (B/M, T, d) per
micro-batch ("fwd"), and the cotangent the next stage sends back ("bwd"). Idle (bubble)
ticks send zeros and the last stage's output goes nowhere: both are left out.

Per codec and kind, over every tensor sent (each tensor encoded as a whole, as ppermute
sends it): rel_l2 = sqrt(Σ‖x̂ − x‖² / Σ‖x‖²) and its worst single tensor, max_abs_err =
max|x̂ − x| (and over max|x|), and bits per value on the wire (8 · codec.wire_bytes(n) / n).

Token-level adaptive bit width, measured, not a codec: the tensors are cut into tah4's groups
of 128 values along the channels, grouped per token (d/128 groups; with d < 128 the unit is
one group of 128/d tokens); the units with the largest 4-bit error (the sender can measure
it: encode, decode, compare), or with the largest max|x| (outliers), are sent with --high
(an 8-bit codec on the same groups) and the rest with tah4, plus a 1-bit flag per unit.
For each fraction f of 8-bit units: rel_l2, bits per value, and `random_rel_l2`, the error
of the same f chosen at random (expected: (1 − f)·E4 + f·E8), against which the ranking's
gain is measured; `share_err2` is the share of tah4's squared error the chosen units hold.
`f_half_error` is the smallest measured f that halves tah4's rel_l2.

Writes the JSON (device, jax, commit, config, rows, adaptive) and prints both tables.
"""
from __future__ import annotations

import argparse
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from taco_jax import codecs
from experiments.error_growth import captured_step

KINDS = ("fwd", "bwd")
DEFAULT_CODECS = ("tah4", "taco", "echo4", "int4-sym", "fp8", "block-fp8", "taco-int8")
FRACTIONS = (0.0, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
GROUP = 128                  # tah4's group along the channels


# -- capture ----------------------------------------------------------------------------------
def capture_handoffs(cfg, params, x, y, stages: int, microbatches: int) -> dict:
    """{"fwd": [(boundary, tensor)], "bwd": [...]}: what one pipelined forward+backward of
    (x, y) sends between stages (codec none), `params` in the unpipelined layout. Boundary b
    lies between stage b and b + 1."""
    from models import parallel
    records = captured_step(
        cfg, ["codec=none", "parallel.data=1", "parallel.tp=1", "parallel.emulate_tp=0",
              f"parallel.pipe={stages}", f"parallel.microbatches={microbatches}"],
        jax.devices()[:stages], lambda prog: parallel.stack_blocks(params, cfg.model.n_layer),
        x, y)
    out = {k: [] for k in KINDS}
    for r in records:
        if r["op"] != "ppermute":
            continue
        v = np.asarray(r["value"], np.float32)
        dev = r["device"]
        # fwd: stage s sends to s + 1 (the last stage to no one); bwd: stage s sends back
        boundary = dev if r["kind"] == "fwd" else dev - 1
        if 0 <= boundary < stages - 1 and np.any(v):
            out[r["kind"]].append((boundary, v))
    return out


# -- codecs -----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _roundtrip(codec, each: bool):
    return jax.jit(jax.vmap(codec.roundtrip) if each else codec.roundtrip)


def roundtrip(codec, v: np.ndarray, each: bool = False) -> np.ndarray:
    """decode(encode(v)); each: every v[i] encoded on its own, as one send (per-tensor
    scales stay per tensor)."""
    return np.asarray(_roundtrip(codec, each)(jnp.asarray(v)), np.float32)


def bits_per_value(codec, n: int) -> float:
    return 8.0 * codec.wire_bytes(n) / n


def codec_rows(tensors: dict, names) -> list[dict]:
    rows = []
    for kind in KINDS:
        if not tensors[kind]:
            continue
        vals = np.stack([v for _, v in tensors[kind]])                # (sends, ...)
        axes = tuple(range(1, vals.ndim))
        ref2 = np.sum(vals.astype(np.float64) ** 2, axis=axes)
        for name in names:
            c = codecs.get(name)
            d = roundtrip(c, vals, each=True).astype(np.float64) - vals
            err2 = np.sum(d * d, axis=axes)
            maxerr = float(np.abs(d).max())
            rows.append({"codec": name, "kind": kind,
                         "rel_l2": math.sqrt(err2.sum() / ref2.sum()),
                         "rel_l2_worst_tensor": float(np.sqrt(err2 / ref2).max()),
                         "max_abs_err": maxerr,
                         "max_abs_err_over_max": maxerr / float(np.abs(vals).max()),
                         "bits_per_value": bits_per_value(c, vals[0].size),
                         "tensors": len(vals)})
    return rows


# -- token-level adaptive bit width -----------------------------------------------------------
def units(v: np.ndarray) -> np.ndarray:
    """(n_units, values) of tah4 groups of 128 along the channels: one token per unit
    (d/128 groups) when d is a multiple of 128, else one group (128/d tokens)."""
    d = v.shape[-1]
    if d % GROUP and GROUP % d:
        raise ValueError(f"d_model={d}: neither a multiple nor a divisor of {GROUP}")
    per = d if d % GROUP == 0 else GROUP
    return v.reshape(-1, per)


def unit_errors(u: np.ndarray, low, high) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per unit of `u` (n_units, values): (‖x‖², 4-bit squared error, 8-bit squared
    error), each group of 128 encoded on its own (the codecs' block is one group)."""
    groups = u.reshape(-1, GROUP)
    e = {}
    for key, c in (("low", low), ("high", high)):
        d = roundtrip(c, groups).astype(np.float64) - groups
        e[key] = np.sum((d * d).reshape(u.shape[0], -1), axis=1)
    return np.sum(u.astype(np.float64) ** 2, axis=1), e["low"], e["high"]


def adaptive_rows(tensors: dict, low_name: str = "tah4", high_name: str = "taco-int8",
                  fractions=FRACTIONS) -> tuple[list[dict], dict]:
    """-> (rows per kind, criterion and fraction; per kind the unit, tah4's rel_l2 and
    f_half_error per criterion)."""
    low = codecs.get(low_name)
    high = codecs.get(high_name).replace(block_size=GROUP)
    b_low, b_high = 8.0 * low.row_bytes / GROUP, 8.0 * high.row_bytes / GROUP
    rows, summary = [], {}
    for kind in KINDS:
        vals = [v for _, v in tensors[kind]]
        if not vals:
            continue
        every = np.concatenate([units(v) for v in vals])    # the codecs' blocks: one group
        ref, e4, e8 = unit_errors(every, low, high)
        amax = np.abs(every).max(axis=1)
        per_unit = every.shape[1]
        ref2, e4_tot, e8_tot = ref.sum(), e4.sum(), e8.sum()
        base = math.sqrt(e4_tot / ref2)
        info = {"unit_values": per_unit, "units": int(ref.size), "tah4_rel_l2": base,
                "high_rel_l2": math.sqrt(e8_tot / ref2), "high_codec": f"{high_name}@{GROUP}"}
        for crit, score in (("error", e4), ("absmax", amax)):
            order = np.argsort(-score, kind="stable")
            half = None
            for f in fractions:
                k = int(round(f * ref.size))
                chosen = order[:k]
                err2 = e4_tot - e4[chosen].sum() + e8[chosen].sum()
                rel = math.sqrt(max(err2, 0.0) / ref2)
                rows.append({
                    "kind": kind, "criterion": crit, "fraction": f, "units_8bit": k,
                    "rel_l2": rel,
                    "random_rel_l2": math.sqrt(((1 - k / ref.size) * e4_tot
                                                + k / ref.size * e8_tot) / ref2),
                    "share_err2": float(e4[chosen].sum() / e4_tot),
                    "bits_per_value": (1 - k / ref.size) * b_low + k / ref.size * b_high
                    + 1.0 / per_unit})
                if half is None and rel <= 0.5 * base:
                    half = f
            info[f"f_half_error_{crit}"] = half
        summary[kind] = info
    return rows, summary


# -- driver -----------------------------------------------------------------------------------
def print_tables(rows, adaptive, summary) -> None:
    print(f"\n{'codec':<10}{'kind':<5}{'rel_l2':>9}{'worst':>9}{'max_err/max':>13}{'bits':>7}")
    for r in rows:
        print(f"{r['codec']:<10}{r['kind']:<5}{r['rel_l2']:>9.4f}"
              f"{r['rel_l2_worst_tensor']:>9.4f}{r['max_abs_err_over_max']:>13.4f}"
              f"{r['bits_per_value']:>7.3f}")
    for kind, info in summary.items():
        print(f"\n{kind}: tah4 + {info['high_codec']} per unit of {info['unit_values']} values"
              f" ({info['units']} units); tah4 alone {info['tah4_rel_l2']:.4f}, 8-bit alone "
              f"{info['high_rel_l2']:.4f}")
        print(f"{'criterion':<10}{'f':>6}{'rel_l2':>9}{'random':>9}{'share':>8}{'bits':>7}")
        for r in adaptive:
            if r["kind"] == kind:
                print(f"{r['criterion']:<10}{r['fraction']:>6.2f}{r['rel_l2']:>9.4f}"
                      f"{r['random_rel_l2']:>9.4f}{r['share_err2']:>8.3f}"
                      f"{r['bits_per_value']:>7.3f}")


def main(argv=None) -> dict:
    from bench.common import env_facts, write_json
    from experiments.error_growth import train_exact
    from train import config as config_lib
    from train.loop import setup_backend

    ap = argparse.ArgumentParser(prog="python -m experiments.pp_codecs",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="tiny", help="preset name or YAML (default tiny)")
    ap.add_argument("--steps", type=int, default=300, help="exact training steps first")
    ap.add_argument("--stages", type=int, default=0,
                    help="pipeline stages of the capture (default: model.n_layer)")
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--codecs", nargs="+", default=list(DEFAULT_CODECS))
    ap.add_argument("--high", default="taco-int8",
                    help="the 8-bit codec of the adaptive tokens (on groups of 128)")
    ap.add_argument("--set", nargs="*", default=[], help="extra config overrides")
    ap.add_argument("--json", default="bench/results/pp_codecs.json")
    args = ap.parse_args(argv)

    cfg = config_lib.load_config(args.config, args.set)
    stages = args.stages or cfg.model.n_layer
    if stages < 2 or cfg.model.n_layer % stages:
        raise SystemExit(f"--stages {stages} must be >= 2 and divide model.n_layer="
                         f"{cfg.model.n_layer}")
    # enough simulated CPU devices for the stages (more if the config asks for more)
    setup_backend(config_lib.replace(cfg, [
        f"parallel.cpu_devices={max(stages, cfg.parallel.cpu_devices)}"]))
    steps = max(args.steps, 0)
    _, state, batches = train_exact(cfg, steps)
    x, y = batches[steps]
    tensors = capture_handoffs(cfg, state["params"], x, y, stages, args.microbatches)
    first = tensors["fwd"][0][1]
    print(f"[pp_codecs] {cfg.name} after {steps} steps: {stages} stages, "
          f"{args.microbatches} micro-batches, {len(tensors['fwd'])} fwd and "
          f"{len(tensors['bwd'])} bwd hand-offs of {list(first.shape)} {first.dtype}",
          flush=True)
    rows = codec_rows(tensors, args.codecs)
    adaptive, summary = adaptive_rows(tensors, "tah4", args.high)
    print_tables(rows, adaptive, summary)
    facts = env_facts()
    out = {"device": facts["device"], "jax": jax.__version__, "commit": facts["commit"],
           "config": {"preset": cfg.name, "steps": steps, "stages": stages,
                      "microbatches": args.microbatches, "batch_size": cfg.train.batch_size,
                      "handoff_shape": list(first.shape), "dtype": str(first.dtype),
                      "model": {k: getattr(cfg.model, k) for k in
                                ("n_layer", "n_head", "d_model", "vocab_size", "seq_len")},
                      "overrides": args.set, "high": args.high},
           "handoffs": {k: len(v) for k, v in tensors.items()},
           "rows": rows, "adaptive": adaptive, "adaptive_summary": summary, "env": facts}
    if args.json:
        write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
