"""python -m experiments.echo_variants: rank variants of the echo4 family by how much they
degrade training, each paired with bf16 (codec none) of the same seed.

    python -m experiments.echo_variants [--preset tiny] [--tp 4] [--steps N] [--trunk K]
        [--seeds 0 1 2 3] [--variants none taco echo4 echo4+feedback tah4 ...]
        [--eval-batches 64] [--budget-s S] [--set k=v ...]
        [--json bench/results/echo4_variants_cpu.json]

A variant is `<fwd codec>[/<bwd codec>][+feedback|+feedback-bwd][,head=<codec>][,lr=<x>]`:
  - one codec for every all-reduce, or `fwd/bwd` one per direction;
  - `+feedback`: Echo error feedback at the forward sites (model.feedback);
    `+feedback-bwd`: at the backward sites too (model.feedback_bwd), the LM head's included;
  - `head=<codec>`: the LM head's backward all-reduce (model.codec_head);
  - `lr=<x>`: peak and final learning rate times x (Echo trains its 4-bit runs at
    3.5e-4 against bf16's 3.0e-4: x = 1.1667).
Every all-reduce is compressed (min_bytes 0), tensor parallelism of size `--tp` emulated on
one device (parallel.emulate_tp), as experiments.fidelity_tp does.

Codec variants defined here (jnp references, registered on import through
`taco_jax.codecs.register`; `tah4`, echo4 after a Hadamard of each group, is the library's):
  - `echo4-g256`: groups of 256;
  - `echo4-g64c`: groups of 64 with 3 bytes of group metadata (bf16 scale, uint8 zero
    point) instead of 8, so that 64 fits the byte budget;
  - `echo4-sr`: stochastic rounding. The codec interface takes no key, so the dither is a
    counter-based hash of each value's bits, its position and a fixed key: reproducible,
    and different at every call since the values differ.

Each variant is traced and compiled once; its seeds reuse the compiled step (the seed picks
the initial parameters and the training windows, as in `python -m train`). A run trains
`--steps` steps of train.loop.build's step, then scores the final parameters on the same
validation windows for every run (experiments.fidelity_tp.val_windows) under the run's own
codec. `--trunk K` makes it a branch proxy: the first K steps run in bf16 once per seed, and
every variant of that seed continues from there for the remaining steps (same schedule,
same windows), so the variants of a seed differ only in what their codec did at the end of
training, at a fraction of the cost. With `--trunk 0` (the GPU protocol) every run trains
from the start. Rows are kept in the JSON by (variant, seed) when the proxy (preset, steps,
trunk, TP, --set, validation batches) is the same, so a call cut short resumes.

JSON: {"device", "jax", "commit", "proxy": {...}, "command", "commands", "byte_budget",
"ranked": [{"variant", "wire_ratio", "within_budget", "seeds", "paired_pct", "mean_pct",
"sd_pct", "ci90_pct", "eval_se_pct", "vs", "vs_bf16_same_lr"}], "separation": [taco <
echo4+feedback < echo4, as contrasts], "bf16_seed_sd_pct", "rows": [{"variant", "seed",
"final_val_loss", "val_batch_losses", "wire_ratio", "curve", "commit", ...}]}; `vs` is the
variant minus its reference (`reference_of`) seed by seed, in % of bf16's loss.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shlex
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import taco_jax
from taco_jax.codecs import Echo
from taco_jax.numerics import quant
from taco_jax.numerics.int4 import LEVELS, SCALE_MIN, asym_params, pack_nibbles, unpack_nibbles

BASELINES = ("none", "taco", "echo4", "echo4+feedback")
VARIANTS = (*BASELINES, "tah4", "echo4-g256", "echo4-g64c", "echo4-sr",
            "echo4+feedback-bwd", "echo4+feedback,head=taco", "echo4,lr=1.1667",
            "echo4+feedback,lr=1.1667", "echo4/taco", "none,lr=1.1667",
            "echo4-g64c+feedback", "echo4-g64c+feedback,head=taco")
BYTE_BUDGET = 0.30           # of bf16's wire bytes


# -- codec variants ------------------------------------------------------------------
def _hash32(h):
    """murmur3's 32-bit finalizer: every input bit moves every output bit."""
    h = h ^ lax.shift_right_logical(h, jnp.uint32(16))
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ lax.shift_right_logical(h, jnp.uint32(13))
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ lax.shift_right_logical(h, jnp.uint32(16))


def dither(x, key: int):
    """(rows, B) f32 -> uniform [0, 1) f32 from each value's bits, its position and key."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    pos = lax.broadcasted_iota(jnp.uint32, x.shape, 0) * jnp.uint32(x.shape[1]) \
        + lax.broadcasted_iota(jnp.uint32, x.shape, 1)
    h = _hash32(bits ^ _hash32(pos * jnp.uint32(0x9E3779B9) + jnp.uint32(key)))
    return lax.shift_right_logical(h, jnp.uint32(8)).astype(jnp.float32) * np.float32(2 ** -24)


@dataclasses.dataclass(frozen=True)
class EchoVariant(Echo):
    """echo4's zero-aware asymmetric grid with stochastic rounding (`stochastic`) and/or 3
    bytes of group metadata (`compact`: the scale as bf16, rounded up so that the grid
    still spans the group; the zero point, an integer in [0, 15], as one byte). Reference
    only: the 4-bit kernels write echo4's own rows."""
    stochastic: bool = False
    compact: bool = False
    key: int = 0

    @property
    def kernels(self):
        return None

    @property
    def row_bytes(self) -> int:
        return self.block_size // 2 + (3 if self.compact else 8)

    def _params(self, x, bad):
        s, z = asym_params(x, bad)
        if not self.compact:
            return s, z
        lo = jnp.minimum(jnp.min(x, axis=1, keepdims=True), 0.0)
        # bf16 keeps fp32's exponent range; 1 + 2^-7 before rounding to nearest makes s_b >= s
        s = jnp.maximum((s * np.float32(1 + 2 ** -7)).astype(jnp.bfloat16), SCALE_MIN)
        s = s.astype(jnp.float32)
        z = jnp.clip(jnp.round(-lo * (1 / s)), 0, LEVELS).astype(jnp.int32).astype(jnp.float32)
        return s, jnp.where(bad, 0.0, z)

    def compress_reference(self, x):
        """(rows, B) float -> (rows, row_bytes) uint8."""
        x = x.astype(jnp.float32)
        bad = quant.nonfinite_rows(x)
        s, z = self._params(x, bad)
        v = jnp.where(bad, 0.0, x) * (1 / s)
        # floor(v + u) with u ~ U[0, 1) rounds up with probability frac(v): unbiased; 0 stays 0
        r = jnp.floor(v + dither(x, self.key)) if self.stochastic else jnp.round(v)
        q = jnp.clip(r + z, 0, LEVELS)
        q = jnp.where(jnp.isnan(q), 0, q).astype(jnp.int32)
        if self.compact:
            sb = lax.bitcast_convert_type(s.astype(jnp.bfloat16), jnp.uint16).astype(jnp.int32)
            meta = jnp.concatenate([sb & 0xFF, lax.shift_right_logical(sb, 8),
                                    z.astype(jnp.int32)], axis=1).astype(jnp.uint8)
        else:
            meta = quant.pack_scales([s, z])
        return quant.seal(jnp.concatenate([pack_nibbles(q), meta], axis=1))

    def decompress_reference(self, w, out_dtype=jnp.float32):
        """(rows, row_bytes) uint8 -> (rows, B) out_dtype."""
        half = self.block_size // 2
        if self.compact:
            m = w[:, half:].astype(jnp.int32)
            sb = (m[:, 0:1] | lax.shift_left(m[:, 1:2], 8)).astype(jnp.uint16)
            s = lax.bitcast_convert_type(sb, jnp.bfloat16).astype(jnp.float32)
            z = m[:, 2:3].astype(jnp.float32)
        else:
            s, z = quant.unpack_scales(w[:, half:], 2)
        x = (unpack_nibbles(w[:, :half]).astype(jnp.float32) - z) * s
        return x.astype(out_dtype)


def register_codecs() -> None:
    """The variants of this module, by name (idempotent)."""
    reg = taco_jax.codecs.register
    reg("echo4-g256", lambda **kw: EchoVariant(**{"name": "echo4-g256", "block_size": 256,
                                                  **kw}))
    reg("echo4-g64c", lambda **kw: EchoVariant(**{"name": "echo4-g64c", "block_size": 64,
                                                  "compact": True, **kw}))
    reg("echo4-sr", lambda **kw: EchoVariant(**{"name": "echo4-sr", "stochastic": True,
                                                **kw}))


register_codecs()


# -- variants ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    fwd: str
    bwd: str
    head: str | None = None          # None: the backward codec
    feedback: bool = False
    feedback_bwd: bool = False
    lr_scale: float = 1.0

    @property
    def is_baseline(self) -> bool:
        return self.name == "none"


def parse_variant(name: str) -> Variant:
    """`fwd[/bwd][+feedback|+feedback-bwd][,head=codec][,lr=x]` -> Variant. Raises
    ValueError naming the part it does not understand, or an unknown codec."""
    body, *opts = name.split(",")
    codecs, _, fb = body.partition("+")
    if fb not in ("", "feedback", "feedback-bwd"):
        raise ValueError(f"variant {name!r}: '+{fb}' is not +feedback or +feedback-bwd")
    fwd, _, bwd = codecs.partition("/")
    kw = {"fwd": fwd, "bwd": bwd or fwd, "feedback": bool(fb),
          "feedback_bwd": fb == "feedback-bwd"}
    for opt in opts:
        k, _, v = opt.partition("=")
        if k == "head" and v:
            kw["head"] = v
        elif k == "lr" and v:
            kw["lr_scale"] = float(v)
        else:
            raise ValueError(f"variant {name!r}: option {opt!r} is not head=<codec> or lr=<x>")
    for c in (kw["fwd"], kw["bwd"], kw.get("head")):
        if c is not None:
            taco_jax.codecs.get(c)      # ValueError naming the known codecs
    if kw["feedback"] and kw["fwd"] == "none" and not kw["feedback_bwd"]:
        raise ValueError(f"variant {name!r}: feedback needs a compressing forward codec")
    return Variant(name=name, **kw)


def codec_ratio(codec: str, n: int) -> float:
    """Wire bytes of one all-reduce phase of n values over bf16's 2n bytes."""
    c = taco_jax.codecs.get(codec)
    return 1.0 if c.is_identity else c.wire_bytes(n) / (2 * n)


def wire_ratio(var: Variant, n_layer: int, n: int) -> float:
    """A step's compressed all-reduce bytes over bf16's: 2 forward sites and 2 backward
    sites a block, and the LM head's backward one, each of n values (B x T x d)."""
    sites = ([var.fwd] * 2 * n_layer + [var.bwd] * 2 * n_layer
             + [var.head or var.bwd])
    return sum(codec_ratio(c, n) for c in sites) / len(sites)


def overrides(var: Variant, cfg0, tp: int, steps: int, seed: int = 0) -> list[str]:
    """Config overrides of one variant on top of the proxy's."""
    o = cfg0.optim
    out = [f"model.codec_fwd={var.fwd}", f"model.codec_bwd={var.bwd}", "model.min_bytes=0",
           f"model.feedback={str(var.feedback).lower()}",
           f"model.feedback_bwd={str(var.feedback_bwd).lower()}",
           "parallel.tp=0", "parallel.data=1", f"parallel.emulate_tp={tp}",
           f"train.steps={steps}", f"train.seed={seed}",
           f"optim.lr={o.lr * var.lr_scale!r}", f"optim.min_lr={o.min_lr * var.lr_scale!r}"]
    if var.head is not None:
        out.append(f"model.codec_head={var.head}")
    return out


# -- runs ----------------------------------------------------------------------------
def proxy_config(args):
    """The proxy's base config (the preset with --set), before any variant."""
    from train import config as config_lib
    return config_lib.load_config(args.preset, [*args.set, "parallel.tp=0", "parallel.data=1",
                                                f"parallel.emulate_tp={args.tp}",
                                                "parallel.cpu_devices=1"])


class Runner:
    """One compiled program per variant (built on first use), its seeds run on it."""

    def __init__(self, args, cfg0, corpus, starts):
        self.args, self.cfg0, self.corpus, self.starts = args, cfg0, corpus, starts
        self.progs = {}
        self._trunk = (None, None)

    def program(self, var: Variant):
        from train import config as config_lib
        from train.loop import build, build_mesh
        if var.name not in self.progs:
            cfg = config_lib.load_config(self.args.preset, [
                *self.args.set, "parallel.cpu_devices=1",
                *overrides(var, self.cfg0, self.args.tp, self.args.steps)])
            self.progs[var.name] = build(cfg, build_mesh(cfg))
        return self.progs[var.name]

    def trunk(self, seed: int):
        """The state after --trunk bf16 steps from seed (computed once per seed)."""
        if self._trunk[0] != seed:
            prog = self.program(parse_variant("none"))
            state, _, _ = self._steps(prog, prog.init(seed), seed, 0, self.args.trunk)
            self._trunk = (seed, jax.device_get(state))
        none = self.program(parse_variant("none"))
        return jax.device_put(self._trunk[1], none.state_shardings)

    def _steps(self, prog, state, seed: int, start: int, stop: int):
        """Steps start+1 .. stop of the run from `seed` -> (state, curve, first step s)."""
        from train.data import Batches
        B, T = prog.cfg.train.batch_size, prog.cfg.model.seq_len
        batches = Batches(self.corpus.train, B, T, seed, stream=0)   # as python -m train
        curve, t_first, t0 = [], None, time.perf_counter()
        for i in range(start, stop):
            x, y = batches[i]
            state, m = prog.step(state, prog.put_batch(x), prog.put_batch(y))
            if t_first is None:
                jax.block_until_ready(m)
                t_first = time.perf_counter() - t0   # compiles when the variant is new
            if (i + 1) % self.args.log_every == 0 or i + 1 == stop:
                loss = float(m["loss"])
                curve.append([i + 1, round(loss, 5)])
                if not math.isfinite(loss):
                    break
        return state, curve, t_first

    def run(self, var: Variant, seed: int) -> dict:
        """Train `var` from seed (after the shared bf16 trunk, if any) to --steps and score
        it -> a JSON row."""
        from experiments.fidelity_tp import se_pct, val_batch
        prog = self.program(var)
        t0 = time.perf_counter()
        state = self.trunk(seed) if self.args.trunk else prog.init(seed)
        t_trunk = time.perf_counter()
        state, curve, t_first = self._steps(prog, state, seed, self.args.trunk, self.args.steps)
        t1 = time.perf_counter()
        diverged = not math.isfinite(curve[-1][1])
        T = prog.cfg.model.seq_len
        losses = [] if diverged else [
            float(prog.eval_loss(state["params"],
                                 *map(prog.put_batch, val_batch(self.corpus.val, s, T))))
            for s in self.starts]
        n = prog.cfg.train.batch_size * T * prog.cfg.model.d_model
        return {"variant": f"{var.name}@seed{seed}", "codec": var.name,
                "feedback": var.feedback, "seed": seed,
                "final_val_loss": statistics.fmean(losses) if losses else float("nan"),
                "val_se_pct": se_pct(losses), "val_batch_losses": [round(v, 6) for v in losses],
                "diverged": diverged, "wire_ratio": wire_ratio(var, prog.cfg.model.n_layer, n),
                "trunk_s": t_trunk - t0, "train_s": t1 - t_trunk, "first_step_s": t_first,
                "step_s": (t1 - t_trunk - t_first) / max(self.args.steps - self.args.trunk - 1,
                                                         1),
                "eval_s": time.perf_counter() - t1, "curve": curve}


# -- statistics ----------------------------------------------------------------------
def t90(values: list[float]) -> dict:
    """mean, s.d., and the two-sided 90% Student-t interval of the mean (None for n < 2)."""
    import scipy.stats
    n = len(values)
    mean = statistics.fmean(values) if values else None
    if n < 2:
        return {"n": n, "mean_pct": mean, "sd_pct": None, "ci90_pct": None}
    sd = statistics.stdev(values)
    half = float(scipy.stats.t.ppf(0.95, n - 1)) * sd / math.sqrt(n)
    return {"n": n, "mean_pct": mean, "sd_pct": sd, "ci90_pct": [mean - half, mean + half]}


def contrast(rows: list[dict], a: str, b: str) -> dict:
    """Variant a minus variant b, seed by seed, in % of bf16's loss of that seed: the
    difference two variants make, with the seed's own noise shared by both cancelled."""
    by = {(r["codec"], r["seed"]): r["final_val_loss"] for r in rows
          if r["final_val_loss"] is not None and math.isfinite(r["final_val_loss"])}
    seeds = sorted(s for (c, s) in by if c == a and (b, s) in by and ("none", s) in by)
    d = [100 * (by[a, s] - by[b, s]) / by["none", s] for s in seeds]
    return {"a": a, "b": b, "seeds": seeds, "diff_pct": d, **t90(d)}


def reference_of(name: str) -> str | None:
    """What a variant is read against: echo4+feedback for the feedback variants, echo4
    for the other 4-bit ones (the codec variants); None for the FP8 and bf16 ones."""
    var = parse_variant(name)
    if var.fwd in ("none", "taco"):
        return None
    return "echo4+feedback" if var.feedback else "echo4"


def same_lr_baseline(name: str, present) -> str | None:
    """`none,lr=x` for a variant with lr=x, where that run exists: a learning rate that
    helps bf16 as much is no gain of the codec's."""
    lr = next((o for o in name.split(",")[1:] if o.startswith("lr=")), None)
    base = None if lr is None else f"none,{lr}"
    return base if base in present and base != name else None


def summarize(rows: list[dict], order: list[str]) -> dict:
    from experiments.fidelity_tp import paired_rows, seed_sd_pct, seed_spread_pct
    paired = {e["config"]: e for e in paired_rows(rows)}
    ratio = {r["codec"]: r["wire_ratio"] for r in rows}
    ranked = []
    for name in order:
        e = paired.get(name)
        if name == "none" or e is None or not e["n"]:
            continue
        st = t90(e["paired_pct"])
        ref, lr_base = reference_of(name), same_lr_baseline(name, paired)
        ranked.append({"variant": name, "wire_ratio": ratio.get(name),
                       "within_budget": (ratio.get(name) or 1) <= BYTE_BUDGET,
                       "seeds": e["seeds"], "paired_pct": e["paired_pct"], **st,
                       "eval_se_pct": e["eval_se_pct"], "diverged_seeds": e["diverged_seeds"],
                       "vs": (None if name in BASELINES or ref is None
                              else contrast(rows, name, ref)),
                       "vs_bf16_same_lr": None if lr_base is None else contrast(rows, name,
                                                                                lr_base)})
    ranked.sort(key=lambda e: e["mean_pct"])
    bf16 = [r["final_val_loss"] for r in rows if r["codec"] == "none"]
    separation = [contrast(rows, a, b) for a, b in (("echo4+feedback", "taco"),
                                                    ("echo4", "echo4+feedback"))]
    return {"ranked": ranked, "separation": separation,
            "bf16_seed_sd_pct": seed_sd_pct(bf16), "bf16_seed_spread_pct": seed_spread_pct(bf16)}


def _fmt_ci(ci) -> str:
    return "" if ci is None else f"[{ci[0]:+.2f}, {ci[1]:+.2f}]"


def print_table(summary: dict) -> None:
    print(f"\n{'variant':<31}{'bytes':>6}{'n':>3}{'vs bf16 %':>10}{'s.d.':>6}{'90% CI':>17}"
          f"   vs echo4(+fb) %, 90% CI")
    for e in summary["ranked"]:
        vs = e["vs"]
        tail = ("" if vs is None or vs["mean_pct"] is None else
                f"{vs['b']}: {vs['mean_pct']:+.2f} {_fmt_ci(vs['ci90_pct'])}")
        sd = "" if e["sd_pct"] is None else f"{e['sd_pct']:.2f}"
        lr = e["vs_bf16_same_lr"]
        if lr is not None and lr["mean_pct"] is not None:
            tail += f"; {lr['b']}: {lr['mean_pct']:+.2f} {_fmt_ci(lr['ci90_pct'])}"
        print(f"{e['variant']:<31}{e['wire_ratio']:>6.3f}{e['n']:>3}{e['mean_pct']:>+10.2f}"
              f"{sd:>6}{_fmt_ci(e['ci90_pct']):>17}   {tail}")
    for c in summary["separation"]:
        if c["mean_pct"] is not None:
            print(f"separation {c['a']} - {c['b']}: {c['mean_pct']:+.2f}% "
                  f"{_fmt_ci(c['ci90_pct'])} over seeds {c['seeds']}")
    if summary["bf16_seed_sd_pct"] is not None:
        print(f"bf16 seeds: s.d. {summary['bf16_seed_sd_pct']:.2f}%, spread "
              f"{summary['bf16_seed_spread_pct']:.2f}%")


# -- the driver ----------------------------------------------------------------------
def _proxy(args, cfg0, val_batches: int) -> dict:
    m = cfg0.model
    return {"preset": cfg0.name, "tp": args.tp, "emulated": True, "steps": args.steps,
            "trunk": args.trunk,
            "set": list(args.set), "n_layer": m.n_layer, "d_model": m.d_model,
            "vocab_size": m.vocab_size, "seq_len": m.seq_len,
            "batch_size": cfg0.train.batch_size, "lr": cfg0.optim.lr,
            "min_lr": cfg0.optim.min_lr, "warmup_steps": cfg0.optim.warmup_steps,
            "dtype": jnp.dtype(m.compute_dtype).name,
            "val_batches": val_batches}


def old_rows(path, proxy: dict) -> dict:
    """Rows of an earlier call with the same proxy, by run name."""
    if not (path and Path(path).exists()):
        return {}
    old = json.loads(Path(path).read_text())
    if old.get("proxy") != proxy:
        print(f"[echo_variants] {path}: another proxy; its rows are not reused", flush=True)
        return {}
    return {r["variant"]: r for r in old.get("rows", [])}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m experiments.echo_variants", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", help="preset name or YAML")
    p.add_argument("--tp", type=int, default=4, help="emulated tensor-parallel size")
    p.add_argument("--steps", type=int, default=None, help="default: the preset's")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS))
    p.add_argument("--trunk", type=int, default=0,
                   help="the first N steps in bf16, shared by every variant of a seed "
                        "(0: each variant from the start)")
    p.add_argument("--eval-batches", type=int, default=64,
                   help="validation batches scored (0 = the whole split)")
    p.add_argument("--log-every", type=int, default=25, help="steps between curve points")
    p.add_argument("--set", nargs="*", default=[], help="proxy config overrides (k=v)")
    p.add_argument("--budget-s", type=float, default=0,
                   help="stop before a run that would end more than S s after the start")
    p.add_argument("--json", default="bench/results/echo4_variants_cpu.json")
    args = p.parse_args(argv)
    t_start = time.monotonic()
    from experiments.ablation import _commit
    from experiments.fidelity_tp import val_windows
    from train.data import load_corpus
    from train.loop import setup_backend

    variants = [parse_variant(v) for v in dict.fromkeys(["none", *args.variants])]
    cfg0 = proxy_config(args)
    setup_backend(cfg0)
    args.steps = args.steps or cfg0.train.steps
    if not 0 <= args.trunk < args.steps:
        p.error(f"--trunk={args.trunk} must be in [0, --steps={args.steps})")
    corpus = load_corpus(cfg0.data, cfg0.model.vocab_size, verbose=False)
    starts = val_windows(len(corpus.val), cfg0.train.batch_size, cfg0.model.seq_len,
                         args.eval_batches)
    proxy = _proxy(args, cfg0, starts.shape[0])
    rows = old_rows(args.json, proxy)
    runner = Runner(args, cfg0, corpus, starts)
    order = [v.name for v in variants]
    command = "python -m experiments.echo_variants " + shlex.join(
        sys.argv[1:] if argv is None else argv)
    walls, stopped = {}, []
    for seed in args.seeds:            # seed by seed, bf16 first: a budget leaves pairs
        for var in variants:
            key = f"{var.name}@seed{seed}"
            if key in rows:
                continue
            est = walls.get(var.name) or (max(walls.values()) if walls else 0)
            if args.budget_s and time.monotonic() - t_start + est > args.budget_s:
                stopped.append(key)
                continue
            t0 = time.monotonic()
            rows[key] = runner.run(var, seed)
            rows[key]["commit"] = _commit()
            walls[var.name] = max(walls.get(var.name, 0), time.monotonic() - t0)
            r = rows[key]
            print(f"[echo_variants] {key}: val {r['final_val_loss']:.4f} "
                  f"(first step {r['first_step_s']:.1f} s, then {r['step_s']:.3f} s/step; "
                  f"eval {r['eval_s']:.0f} s)", flush=True)
            out = write(rows, args, proxy, order, command)
    out = write(rows, args, proxy, order, command)
    print_table(out)
    if stopped:
        print(f"[echo_variants] not started (time budget): {stopped}; the same command "
              f"continues", flush=True)
    out["unfinished"] = stopped
    return out


def write(rows: dict, args, proxy: dict, order: list[str], command: str) -> dict:
    from bench.common import write_json
    from experiments.ablation import _commit, _device
    ordered = sorted(rows.values(), key=lambda r: (r["seed"], order.index(r["codec"])
                                                   if r["codec"] in order else len(order)))
    commands = []                       # every call that added rows to this proxy's table
    if args.json and Path(args.json).exists():
        old = json.loads(Path(args.json).read_text())
        if old.get("proxy") == proxy:
            commands = old.get("commands") or [old["command"]]
    out = {"device": _device(), "jax": jax.__version__, "commit": _commit(), "proxy": proxy,
           "command": command, "commands": list(dict.fromkeys([*commands, command])),
           "byte_budget": BYTE_BUDGET,
           **summarize(ordered, list(dict.fromkeys(order + [r["codec"] for r in ordered]))),
           "rows": ordered}
    if args.json:
        write_json(args.json, out)
    return out


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
