"""python -m experiments.error_growth: the relative error of a compressed all-reduce's result
against the number of partial sums P, on the real tensors of tensor-parallel GPT training.

    python -m experiments.error_growth [--config tiny] [--steps 200] [--tp-max 16]
        [--ps 2 4 8 16] [--codecs ...] [--load RUN_DIR] [--set k=v ...]
        [--json bench/results/error_growth.json] [--plot docs/error_growth.png]

Trains the GPT exactly (codec none, no TP: the same math as any TP size) for --steps, or
loads a finished run's latest checkpoint (--load), then runs one forward+backward of the
next training batch with TP of size --tp-max under
`taco_jax.telemetry.capture(all_devices=True)`: every member's partial sum at every
all-reduce site, "fwd" (row-parallel outputs entering the psums) and "bwd" (partial input
gradients entering the column-parallel backward all-reduces). The capture runs on a TP mesh
of --tp-max devices (on CPU: that many simulated devices), or, with fewer devices or
--emulate, with TP emulated on one (parallel.emulate_tp; its exact route hands the
backward taps totals, not partials, so only the fwd sites are kept there). TP shards are
contiguous, so the partial sums of TP size P (P dividing --tp-max) are sums of tp_max/P
adjacent members' (`group_partials`; tested equal to a TP-P capture). For each P and codec:

  two_shot  the library's compressed all-reduce (taco_jax.psum, xla transport) of the P
            partials, run under jax.vmap: each element quantized by its sender, summed
            in fp32 by its owner, quantized again;
  one_shot  Σ_j decode(encode(x_j)): one quantization per partial (the P = 2 fused
            schedule's math, and the first quantization of the two-shot alone);

and rel_l2 = sqrt(Σ_sites ‖y − S‖² / Σ_sites ‖S‖²) against the exact sum S (float64),
pooled over the sites of one kind. `spread` = sqrt(Σ_j ‖x_j‖²) / ‖S‖, pooled the same way,
is how large the partials are against their sum (1/sqrt(P) for equal partials, 1 for
uncorrelated ones, > 1 when they cancel): a block-scaled codec's error follows the size of
what it quantizes, so with independent errors ε per quantization the one-shot's relative
error is about ε · spread, the two-shot's ε · sqrt(spread² · (P − 1)/P + 1).

Writes the JSON (rows {"codec", "kind", "p", "schedule", "rel_l2", "rel_l2_max"}, the
spread per kind and P, the tensors' facts) and the plot (rel_l2 vs P per codec, fwd and
bwd). On CPU the tiny model is fp32; on GPUs the partials are bf16 (the model's dtype), as
a TP-P run's would be: grouped sums are formed in fp32 and cast back.
"""
from __future__ import annotations

import argparse
import functools
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import taco_jax
from taco_jax import codecs, telemetry

KINDS = ("fwd", "bwd")
DEFAULT_CODECS = ("taco", "taco-1scale", "taco-e5m2", "taco-int8", "hadamard-fp8",
                  "block-fp8", "fp8", "echo4", "int4-sym")


# -- partial sums ----------------------------------------------------------------------------
def group_partials(stack: np.ndarray, p: int) -> np.ndarray:
    """(N, ...) partial sums of N contiguous TP shards -> (p, ...) of p shards: member j of
    TP size p holds shards j·N/p ... (j+1)·N/p − 1, so its partial is their sum (in fp32,
    cast back to the captured dtype, as a TP-p run's matmul would round it)."""
    n = stack.shape[0]
    if n % p:
        raise ValueError(f"P={p} must divide the captured TP size {n}")
    s = stack.astype(np.float32).reshape(p, n // p, *stack.shape[1:]).sum(axis=1)
    return s.astype(stack.dtype)


def by_site(records: list[dict]) -> dict:
    """Capture records -> {(kind, site): (N, ...) array stacked in member order}."""
    sites: dict = {}
    for r in records:
        if r["call"]:
            continue
        sites.setdefault((r["kind"], r["site"]), {})[r["device"]] = np.asarray(r["value"])
    return {k: np.stack([v[i] for i in sorted(v)]) for k, v in sorted(sites.items())}


# -- the compressed sums ----------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _two_shot_fn(name: str):
    def member(x):
        return taco_jax.psum(x, "tp", codec=name, min_bytes=0, transport="xla")
    return jax.jit(lambda xs: jax.vmap(member, axis_name="tp")(xs)[0])


@functools.lru_cache(maxsize=None)
def _one_shot_fn(name: str):
    codec = codecs.get(name)

    def f(xs):
        acc = jnp.zeros(xs.shape[1:], jnp.float32)
        for j in range(xs.shape[0]):        # device order, fp32, as the one-shot decodes
            acc = acc + codec.roundtrip(xs[j]).astype(jnp.float32)
        return acc
    return jax.jit(f)


def compressed_sum(partials: np.ndarray, name: str, schedule: str) -> np.ndarray:
    """The all-reduce result of `partials` (P, ...) through codec `name`, as float64."""
    fn = (_two_shot_fn if schedule == "two_shot" else _one_shot_fn)(name)
    return np.asarray(fn(jnp.asarray(partials)), np.float64)


def two_shot_reference(partials: np.ndarray, name: str) -> np.ndarray:
    """The two-shot's result from its definition, for block-scaled codecs: the flattened
    tensor cut into P segments of whole blocks (zero-padded), segment j owned by member j;
    the owner adds its own segment exactly to the decoded segments of the others (fp32) and
    the sum is quantized once more (fp32, the library's summation order). Tests compare
    `compressed_sum` with it; per-tensor codecs (one scale per sent tensor) do not fit it."""
    codec = codecs.get(name)
    p, shape = partials.shape[0], partials.shape[1:]
    b = codec.block_size
    n = math.prod(shape)
    nb = max(1, -(-n // (p * b)))
    flat = np.zeros((p, p * nb * b), np.float32)
    flat[:, :n] = partials.reshape(p, n)
    blocks = flat.reshape(p, p, nb, b)               # [member, segment, block, value]
    q = np.asarray(codec.roundtrip(jnp.asarray(blocks.reshape(-1, b))), np.float32)
    q = q.reshape(blocks.shape)
    out = np.empty((p, nb, b), np.float32)
    for j in range(p):
        s = blocks[j, j].copy()
        for i in range(p):              # own segment first, then the peers in member order
            if i != j:
                s += q[i, j]
        out[j] = np.asarray(codec.roundtrip(jnp.asarray(s)), np.float32)
    return out.reshape(-1)[:n].reshape(shape).astype(np.float64)


# -- metrics ----------------------------------------------------------------------------------
def rel_l2(pairs) -> tuple[float, float]:
    """pairs of (y, exact) -> (pooled sqrt(Σ‖y−S‖²/Σ‖S‖²), worst single pair)."""
    err2 = sig2 = 0.0
    worst = 0.0
    for y, s in pairs:
        e, g = float(np.sum((y - s) ** 2)), float(np.sum(s ** 2))
        err2, sig2 = err2 + e, sig2 + g
        worst = max(worst, math.sqrt(e / max(g, 1e-300)))
    return math.sqrt(err2 / max(sig2, 1e-300)), worst


def spread(partials_list) -> float:
    """sqrt(Σ_sites Σ_j ‖x_j‖² / Σ_sites ‖Σ_j x_j‖²): 1/sqrt(P) for P equal partials, 1 for
    uncorrelated (orthogonal) ones, > 1 when they cancel."""
    num = den = 0.0
    for x in partials_list:
        x = x.astype(np.float64)
        num += float(np.sum(x ** 2))
        den += float(np.sum(x.sum(axis=0) ** 2))
    return math.sqrt(num / max(den, 1e-300))


def growth_rows(sites: dict, ps, names, schedules=("two_shot", "one_shot")) -> tuple[list, list]:
    """-> (rows per codec, kind, P, schedule; spread per kind and P)."""
    rows, spreads = [], []
    for kind in KINDS:
        stacks = [v for (k, _), v in sites.items() if k == kind]
        if not stacks:
            continue
        for p in ps:
            parts = [group_partials(v, p) for v in stacks]
            exact = [x.astype(np.float64).sum(axis=0) for x in parts]
            spreads.append({"kind": kind, "p": p, "spread": spread(parts)})
            for name in names:
                for sched in schedules:
                    if p == 1 and sched == "two_shot":
                        continue
                    ys = [compressed_sum(x, name, sched) for x in parts]
                    err, worst = rel_l2(zip(ys, exact))
                    rows.append({"codec": name, "kind": kind, "p": p, "schedule": sched,
                                 "rel_l2": err, "rel_l2_max": worst})
    return rows, spreads


# -- capture ----------------------------------------------------------------------------------
def capture_partials(cfg, params, x, y, tp: int, emulate: bool = False) -> dict:
    """Every member's tensor at every all-reduce site of one forward+backward with TP of
    size `tp` (codec none) on a TP mesh of `tp` devices, or emulated on one (`emulate`),
    `params` from any mesh -> by_site(...).

    Emulated with codec none, a backward tap sees the cotangent already summed over the
    members (the exact route of taco_jax.pvary under vmap hands the members one shared
    value, whose cotangent vmap sums), so there the bwd records are every member's total,
    not its partial: `partials_are_distinct` tells, and main() leaves such sites out."""
    mesh_over = ([f"parallel.emulate_tp={tp}", "parallel.tp=0"] if emulate
                 else [f"parallel.tp={tp}", "parallel.emulate_tp=0"])
    devices = jax.devices()[:1] if emulate else jax.devices()[:tp]
    return by_site(captured_step(cfg, ["codec=none", "parallel.data=1", *mesh_over], devices,
                                 lambda prog: params, x, y))


def captured_step(cfg, overrides: list[str], devices, params_of, x, y) -> list[dict]:
    """telemetry.capture(all_devices=True)'s records of one loss-and-gradient step of `cfg`
    with `overrides`, on `devices`, with the parameters `params_of(program)` (put on the
    program's shardings) and the batch (x, y)."""
    from train import config as config_lib
    from train.loop import build, build_mesh
    c = config_lib.replace(cfg, overrides)
    prog = build(c, build_mesh(c, devices))
    params = jax.device_put(params_of(prog), prog.model.shardings)
    fn = jax.jit(prog.model.loss_and_grad_fn())          # a fresh trace, inside the block
    with telemetry.capture(all_devices=True) as cap:
        loss, _ = fn(params, prog.put_batch(x), prog.put_batch(y))
        jax.block_until_ready(loss)
    jax.effects_barrier()
    return cap.records


def partials_are_distinct(stack: np.ndarray) -> bool:
    """False when every member holds the same tensor (a total, not partial sums)."""
    return not all(np.array_equal(stack[0], v) for v in stack[1:])


def train_exact(cfg, steps: int):
    """`steps` steps of cfg with codec none and no TP -> (program, state, batches)."""
    from train import config as config_lib
    from train.data import Batches, load_corpus
    from train.loop import build, build_mesh
    cfg = config_lib.replace(cfg, ["codec=none", "parallel.tp=1", "parallel.data=1",
                                   "parallel.emulate_tp=0", f"train.steps={max(steps, 1)}"])
    prog = build(cfg, build_mesh(cfg))
    corpus = load_corpus(cfg.data, cfg.model.vocab_size)
    batches = Batches(corpus.train, cfg.train.batch_size, cfg.model.seq_len, cfg.train.seed)
    state = prog.init(cfg.train.seed)
    for i in range(steps):
        state, m = prog.step(state, *map(prog.put_batch, batches[i]))
        if (i + 1) % 50 == 0:
            print(f"[error_growth] step {i + 1} loss {float(m['loss']):.4f}", flush=True)
    return prog, state, batches


def plot(rows: list[dict], spreads: list[dict], out: Path, title: str) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from train.metrics import save_figure

    kinds = [k for k in KINDS if any(r["kind"] == k for r in rows)]
    fig, axes = plt.subplots(1, len(kinds), figsize=(6.5 * len(kinds), 4.8), squeeze=False)
    names = list(dict.fromkeys(r["codec"] for r in rows))
    cmap = plt.get_cmap("tab10")
    for ax, kind in zip(axes[0], kinds):
        for i, name in enumerate(names):
            for sched, ls, mk in (("two_shot", "-", "o"), ("one_shot", ":", "")):
                pts = sorted((r["p"], r["rel_l2"]) for r in rows if r["codec"] == name
                             and r["kind"] == kind and r["schedule"] == sched)
                if pts:
                    ax.plot(*zip(*pts), ls, marker=mk, ms=4, color=cmap(i % 10),
                            label=name if sched == "two_shot" else None)
        sp = sorted((s["p"], s["spread"]) for s in spreads if s["kind"] == kind)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks([p for p, _ in sp], [str(p) for p, _ in sp])
        ax.set_xlabel("P (partial sums)   spread: " + ", ".join(f"{v:.2f}" for _, v in sp))
        ax.set_ylabel("rel. L2 error of the sum")
        ax.set_title(f"{kind}: two-shot (solid), one-shot (dotted)", fontsize=10)
        ax.grid(alpha=0.3, which="both")
    axes[0][-1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, out)


def print_table(rows: list[dict], spreads: list[dict], ps) -> None:
    for kind in KINDS:
        sp = {s["p"]: s["spread"] for s in spreads if s["kind"] == kind}
        if not sp:
            continue
        print(f"\n{kind}: rel. L2 of the two-shot sum (one-shot in parentheses)")
        print(f"{'codec':<14}" + "".join(f"{'P=' + str(p):>20}" for p in ps))
        print(f"{'spread':<14}" + "".join(f"{sp[p]:>20.3f}" for p in ps))
        for name in dict.fromkeys(r["codec"] for r in rows):
            cells = []
            for p in ps:
                get = {r["schedule"]: r["rel_l2"] for r in rows
                       if r["codec"] == name and r["kind"] == kind and r["p"] == p}
                cells.append(f"{get.get('two_shot', float('nan')):.4f} "
                             f"({get.get('one_shot', float('nan')):.4f})")
            print(f"{name:<14}" + "".join(f"{c:>20}" for c in cells))


def main(argv=None) -> dict:
    from bench.common import env_facts, write_json
    from train import config as config_lib
    from train.checkpoint import Checkpointer
    from train.data import Batches, load_corpus
    from train.loop import build, build_mesh, setup_backend

    ap = argparse.ArgumentParser(prog="python -m experiments.error_growth",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="tiny", help="preset name or YAML (default tiny)")
    ap.add_argument("--steps", type=int, default=None, help="exact training steps first "
                    "(default: the preset's)")
    ap.add_argument("--load", help="a finished run dir: its latest checkpoint, no training")
    ap.add_argument("--tp-max", type=int, default=16, help="TP size captured")
    ap.add_argument("--ps", type=int, nargs="+", default=None,
                    help="numbers of partial sums (divisors of --tp-max; default 2 4 .. tp-max)")
    ap.add_argument("--codecs", nargs="+", default=list(DEFAULT_CODECS))
    ap.add_argument("--emulate", action="store_true",
                    help="capture under emulated TP even when there are --tp-max devices "
                         "(its backward taps give totals, not partials: fwd sites only)")
    ap.add_argument("--set", nargs="*", default=[], help="extra config overrides")
    ap.add_argument("--json", default="bench/results/error_growth.json")
    ap.add_argument("--plot", default="docs/error_growth.png")
    args = ap.parse_args(argv)
    ps = args.ps or [2 ** i for i in range(1, int(math.log2(args.tp_max)) + 1)]

    if args.load:
        cfg = config_lib.load_config(Path(args.load) / "config.yaml", args.set)
    else:
        cfg = config_lib.load_config(args.config, args.set)
    # on CPU: --tp-max simulated devices for the capture's TP mesh (before JAX starts)
    setup_backend(config_lib.replace(cfg, [f"parallel.cpu_devices={max(args.tp_max, 1)}"]))
    if cfg.model.n_head % args.tp_max:
        raise SystemExit(f"model.n_head={cfg.model.n_head} must be divisible by --tp-max "
                         f"{args.tp_max} (e.g. --set model.n_head={args.tp_max})")
    if args.load:
        prog = build(cfg, build_mesh(cfg))
        ck = Checkpointer(Path(args.load) / "ckpt")
        restored = ck.restore_latest(prog.abstract_state(), name=cfg.name, set_aside=False)
        ck.close()
        if restored is None:
            raise FileNotFoundError(f"no checkpoint under {Path(args.load) / 'ckpt'}")
        state, _, step = restored
        corpus = load_corpus(cfg.data, cfg.model.vocab_size)
        batches = Batches(corpus.train, cfg.train.batch_size, cfg.model.seq_len,
                          cfg.train.seed)
    else:
        step = cfg.train.steps if args.steps is None else args.steps
        prog, state, batches = train_exact(cfg, step)
    x, y = batches[step]
    emulate = args.emulate or len(jax.devices()) < args.tp_max
    sites = capture_partials(cfg, state["params"], x, y, args.tp_max, emulate)
    dropped = [k for k, v in sites.items() if not partials_are_distinct(v)]
    if dropped:
        print(f"[error_growth] {len(dropped)} sites ({sorted({k for k, _ in dropped})}) hold "
              f"the same tensor on every member (emulated TP, exact route): left out",
              flush=True)
        sites = {k: v for k, v in sites.items() if k not in dropped}
    n_sites = {k: sum(1 for kk, _ in sites if kk == k) for k in KINDS}
    first = next(iter(sites.values()))
    print(f"[error_growth] {cfg.name} after {step} steps: TP={args.tp_max} "
          f"{'emulated' if emulate else 'mesh'}, "
          f"{n_sites} sites, partials {first.shape[1:]} {first.dtype}", flush=True)
    names = []
    for name in args.codecs:
        try:
            compressed_sum(group_partials(first, 2), name, "two_shot")
            names.append(name)
        except Exception as e:  # noqa: BLE001 - a codec psum does not take: report, go on
            print(f"[error_growth] {name}: skipped ({type(e).__name__}: {e})", flush=True)
    rows, spreads = growth_rows(sites, ps, names)
    print_table(rows, spreads, ps)
    facts = env_facts()
    out = {"device": facts["device"], "commit": facts["commit"], "jax": jax.__version__,
           "preset": cfg.name, "train_steps": step, "tp_captured": args.tp_max, "ps": ps,
           "captured_on": "emulated TP" if emulate else "TP mesh",
           "dtype": str(first.dtype), "partial_shape": list(first.shape[1:]),
           "sites": n_sites, "model": {k: getattr(cfg.model, k) for k in
                                       ("n_layer", "n_head", "d_model", "vocab_size",
                                        "seq_len")},
           "batch_size": cfg.train.batch_size, "rows": rows, "spread": spreads, "env": facts}
    if args.json:
        write_json(args.json, out)
    if args.plot:
        title = (f"error growth with P: {cfg.name} GPT ({cfg.model.n_layer}x{cfg.model.d_model},"
                 f" {first.dtype}) after {step} steps, partials of a TP{args.tp_max} "
                 f"{'emulated ' if emulate else ''}capture ({facts['device']})")
        print(f"wrote {plot(rows, spreads, Path(args.plot), title)}")
    return out


if __name__ == "__main__":
    main()
