"""The column-parallel GEMM with its all-gather compressed (one launch), on one GPU through
a loopback: checks and device time.

    python -m bench.gather_gemm [--p 2 4 8] [--codecs taco echo4] [--shapes 350m.qkv …]
                                [--calls 3] [--no-time] [--impl kernel|emulated]
                                [--wrong-exchange slot|stale] [--checks-out …]
                                [--times-out …] [--update]

P virtual devices are P groups of programs of one launch (`kernels.gemm.
loopback_gather_gemm`): device d encodes its shard x_d (M/P rows), stores its codes into
every device's receive buffer, and computes the gathered, decoded x @ w, every device
with the same w (so every device's result must be the same bits). Shapes are the
column-parallel GEMMs of tensor parallelism, (M, K, N) with M the gathered rows (tokens),
K = d_model and N a device's columns, from configs/<preset>.yaml:

  <preset>.qkv   (T, d_model, 3·d_model / P): the attention's QKV projection;
  <preset>.fc1   (T, d_model, d_ff / P): the MLP's first GEMM;
  odd            (64·37·P, 768, 768): 37 row bands a device, 3 codec tiles of K, 3
                 column tiles;
  MxKxN          any other (M / P a multiple of 64).

Checks (`--calls` calls, fresh inputs each; bf16): every virtual device gets the same bits;
a NaN put into x_0[M/(3P), 3] makes exactly that gathered row NaN; the error against the
exact product (gathered x @ w in f32; rows without the NaN), relative to it, is at most
SLACK × that of the jnp reference (`gather_gemm_reference`: each shard's codec round
trip); "wire_rows_equal" the share of device 0's wire rows, as device P − 1 received them,
equal to the reference's bytes. A shape the kernel does not cover (e.g. 350m.qkv at P = 8:
384 columns a device) gets ok null and the reason, and fails nothing. Rows → --checks-out:
codec, p, shape, ok, reason, the
kernel's module fingerprint (12 hex digits of sha256 over its Mosaic GPU module lowered
for CUDA: what ran), the library's sources hash and the commit.

Times (device time, per virtual device; after passed checks): "per_device_us" the
launch; "gemm_us" the plain GEMM of the gathered shape (`kernels.gemm.matmul`, P groups:
each device's (M, K) @ (K, N), no exchange, no codec); "xla_us" XLA's all_gather and dot
in the loopback (the gathered x written once per device, then the dot). Rows →
--times-out.

Each (codec, P) runs in its own process under --timeout per shape (a hang, e.g. of the
band semaphores, costs only its group); `--isolate none` runs in this one. On CPU (tests)
`--impl emulated` stands the jnp reference in for the kernel, per device, and
`--wrong-exchange slot|stale` breaks its exchange, so the checks can be seen failing; it
times nothing.
"""
from __future__ import annotations

import argparse
import hashlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import child_rows, device_time, print_table
from bench.gemm_codec import ROOT, _same_bits, _us, preset_dims, results_saver

SHAPES = ["350m.qkv", "350m.fc1", "odd"]
SLACK = 1.05          # the kernel's error within this factor of its jnp reference's
DTYPE = "bf16"
ODD_BANDS, ODD_K, ODD_N = 37, 768, 768


def gemm_shape(name: str, p: int) -> tuple[int, int, int]:
    """A shape name (module docstring) at P devices → (M gathered, K, N per device)."""
    if name == "odd":
        return 64 * ODD_BANDS * p, ODD_K, ODD_N
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)", name)
    if m:
        return tuple(int(v) for v in m.groups())
    preset, _, gemm = name.partition(".")
    dims = preset_dims(preset)
    cols = {"qkv": 3 * dims["d_model"], "fc1": dims["d_ff"]}.get(gemm)
    if cols is None:
        raise SystemExit(f"bench.gather_gemm: shape {name!r}: want <preset>.qkv, "
                         f"<preset>.fc1, odd or MxKxN")
    if cols % p or dims["tokens"] % p:
        raise SystemExit(f"bench.gather_gemm: {name}: {cols} columns or {dims['tokens']} "
                         f"tokens do not split over P={p}")
    return dims["tokens"], dims["d_model"], cols // p


# -- the implementations ------------------------------------------------------------------------
def emulated(xs, w, codec, wrong: str | None = None):
    """The kernel in jnp: every device decodes every shard's codes (`decoded_shards`) and
    multiplies. wrong="slot": the last device finds its own shard's codes in slot 0 (a
    store to the wrong place); "stale": slot P − 1 holds, on every device, the codes of
    other values of the same scale (a store that never landed)."""
    from taco_jax.kernels.gemm import gather_gemm as gg, pipeline
    p = xs.shape[0]
    dec = gg.decoded_shards(xs, codec)                         # (P, M/P, K)
    out = []
    for d in range(p):
        slots = list(dec)
        if wrong == "slot" and d == p - 1:
            slots[0] = dec[d]
        if wrong == "stale":
            slots[p - 1] = gg.decoded_shards(xs[p - 1:][:, ::-1], codec)[0]
        out.append(pipeline.matmul_reference(jnp.concatenate(slots), w))
    return jnp.stack(out)


def implementation(impl: str, codec, wrong: str | None = None):
    """(xs, w) → (P, M, N), row d what device d computed."""
    if impl == "kernel":
        from taco_jax.kernels import gemm
        return jax.jit(lambda xs, w: gemm.loopback_gather_gemm(xs, w, codec))
    return jax.jit(lambda xs, w: emulated(xs, w, codec, wrong))


def fingerprint(codec, p: int, m: int, k: int, n: int) -> str:
    """12 hex digits of sha256 over the loopback kernel's Mosaic GPU module(s) at this
    shape, lowered for CUDA with the installed jax (`_jax_private.mosaic_gpu_modules`)."""
    from taco_jax import _jax_private
    from taco_jax.kernels import gemm
    lowered = jax.jit(lambda xs, w: gemm.loopback_gather_gemm(xs, w, codec)).trace(
        jax.ShapeDtypeStruct((p, m // p, k), jnp.bfloat16),
        jax.ShapeDtypeStruct((k, n), jnp.bfloat16)).lower(lowering_platforms=("cuda",))
    h = hashlib.sha256()
    for text in _jax_private.mosaic_gpu_modules(lowered):
        h.update(text.encode() + b"\0")
    return h.hexdigest()[:12]


# -- checks -----------------------------------------------------------------------------------
def make_inputs(key, p: int, m: int, k: int, n: int):
    """xs (P, M/P, K) with a scale per device, a NaN at xs[0, M/(3P), 3]; w (K, N) of
    unit-variance products. Returns them and the NaN's gathered row."""
    k1, k2, k3 = jax.random.split(key, 3)
    scale = jnp.exp(jax.random.normal(k3, (p, 1, 1)))
    xs = (jax.random.normal(k1, (p, m // p, k)) * scale).astype(jnp.bfloat16)
    w = (jax.random.normal(k2, (k, n)) / np.sqrt(k)).astype(jnp.bfloat16)
    row = m // p // 3
    return xs.at[0, row, 3].set(jnp.nan), w, row


@jax.jit
def _exact(xs, w):
    return jnp.matmul(xs.reshape(-1, xs.shape[-1]).astype(jnp.float32), w.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


@jax.jit
def _rel_err(y, exact, finite):
    """‖y − exact‖ / ‖exact‖ over the finite rows."""
    d = jnp.where(finite[:, None], y.astype(jnp.float32) - exact, 0.0)
    e = jnp.where(finite[:, None], exact, 0.0)
    return jnp.sqrt(jnp.sum(d * d)) / jnp.sqrt(jnp.sum(e * e))


def check_call(fn, reference, xs, w, nan_row, wire=None) -> tuple[dict, str | None]:
    """One call's checks → (figures, failure reason or None). fn(xs, w) → (P, M, N);
    reference(xs, w) → (M, N); wire: (kernel's, reference's) wire rows, or None."""
    y = fn(xs, w)
    same = bool(_same_bits(y))
    y = y[0]
    want_nan = np.zeros(y.shape[0], bool)
    want_nan[nan_row] = True
    nan_rows = np.asarray(jnp.any(jnp.isnan(y), axis=1))
    all_nan = bool(jnp.all(jnp.isnan(y[nan_row])))
    exact = _exact(xs, w)
    finite = jnp.asarray(~want_nan)
    figures = {"same_on_every_device": same,
               "nan_rows_ok": bool(np.array_equal(nan_rows, want_nan) and all_nan),
               "rel_err": float(_rel_err(y, exact, finite)),
               "reference_rel_err": float(_rel_err(reference(xs, w), exact, finite))}
    if wire is not None:
        got, want = wire
        figures["wire_rows_equal"] = float(jnp.mean(jnp.all(got == want, axis=-1)))
    why = None
    if not same:
        why = "results differ between virtual devices"
    elif not figures["nan_rows_ok"]:
        why = "NaN outside the row the input's NaN reaches, or that row not all NaN"
    elif not figures["rel_err"] <= SLACK * figures["reference_rel_err"]:     # NaN fails too
        why = (f"rel_err {figures['rel_err']:.4g} > its reference's "
               f"{figures['reference_rel_err']:.4g} × {SLACK}")
    return figures, why


def run_checks(a, codec, p: int, shape: str) -> dict:
    from taco_jax.kernels.gemm import gather_gemm as gg
    m, k, n = gemm_shape(shape, p)
    row = {"kind": "check", "kernel": "gather_gemm", "codec": a.codec_name, "p": p,
           "dtype": DTYPE, "shape": shape, "m": m, "k": k, "n": n, "impl": a.impl,
           "fingerprint": None}
    why = (f"M={m} does not split over P={p}" if m % p else
           gg.unsupported(codec, p, (m // p, k), (k, n), jnp.bfloat16))
    if why is not None:                 # not a failure: a dispatcher falls back there
        return {**row, "ok": None, "reason": f"not covered: {why}", "calls": 0}
    if a.impl == "kernel":
        row["fingerprint"] = fingerprint(codec, p, m, k, n)
    fn = implementation(a.impl, codec, a.wrong_exchange)
    reference = jax.jit(lambda xs, w: gg.gather_gemm_reference(xs, w, codec))
    wire_fn = None
    if a.impl == "kernel":
        launch = jax.jit(lambda xs, w: gg.loopback_launch(xs, w, codec)[1][p - 1, 0])
        ref_wire = jax.jit(lambda x: gg.gather_wire_reference(x, codec))
        row_bytes = gg.ee.tile_codec(codec).row_bytes
        wire_fn = lambda xs, w: (launch(xs, w).reshape(-1, row_bytes),   # noqa: E731
                                 ref_wire(xs[0]))
    worst, why = None, None
    for call in range(a.calls):
        xs, w, nan_row = make_inputs(jax.random.key(1000 * p + call), p, m, k, n)
        wire = wire_fn(xs, w) if wire_fn is not None and call == 0 else None
        figures, why = check_call(fn, reference, xs, w, nan_row, wire)
        if worst is None or figures["rel_err"] > worst["rel_err"] or why:
            worst = {**(worst or {}), **figures}
        if why:
            why = f"call #{call + 1} of {a.calls}: {why}"
            break
    worst = {k_: round(v, 6) if isinstance(v, float) else v for k_, v in worst.items()}
    return {**row, **worst, "calls": a.calls, "ok": why is None, "reason": why}


# -- times -------------------------------------------------------------------------------------
def run_times(a, codec, p: int, shape: str, fp: str | None) -> dict:
    """Device time per virtual device of the launch, the plain GEMM of the gathered shape,
    and XLA's all_gather + dot in the loopback."""
    from taco_jax.kernels import gemm
    m, k, n = gemm_shape(shape, p)
    xs, w, _ = make_inputs(jax.random.key(7), p, m, k, n)
    xs = jnp.nan_to_num(xs)
    iters = 3 if p * m * (k + n) * 2 >= 1 << 28 else 10
    t = lambda fn, x: device_time(fn, x, iters=iters)                     # noqa: E731
    fused = t(lambda a_: gemm.loopback_gather_gemm(*a_, codec), (xs, w))
    gathered = jnp.broadcast_to(xs.reshape(1, m, k), (p, m, k))
    ws = jnp.broadcast_to(w, (p, k, n))
    plain = t(lambda a_: gemm.matmul(*a_), (gathered, ws))

    def xla(a_):
        x, w_ = a_
        # the all-gather's result, written once per virtual device, then each one's dot
        g = jnp.broadcast_to(x.reshape(1, m, k), (p, m, k)) + jnp.zeros((p, 1, 1), x.dtype)
        return jnp.matmul(g, w_, preferred_element_type=jnp.float32).astype(x.dtype)
    ref = t(xla, (xs, w))
    return {"kind": "time", "kernel": "gather_gemm", "codec": a.codec_name, "p": p,
            "dtype": DTYPE, "shape": shape, "m": m, "k": k, "n": n, "fingerprint": fp,
            "timer": "device" if fused.get("us") is not None else "host",
            "per_device_us": round(_us(fused) / p, 2), "gemm_us": round(_us(plain) / p, 2),
            "xla_us": round(_us(ref) / p, 2),
            "over_gemm": round(_us(fused) / _us(plain), 3),
            "over_xla": round(_us(fused) / _us(ref), 3)}


# -- the driver ---------------------------------------------------------------------------------
def run_group(a, p: int) -> list[dict]:
    """This process: every shape of one (codec, P), checked, then timed if it passed."""
    from taco_jax import codecs
    codec = codecs.get(a.codec_name)
    rows = []
    for shape in a.shapes:
        check = run_checks(a, codec, p, shape)
        rows.append(check)
        if a.time and check["ok"] and a.impl == "kernel":
            rows.append(run_times(a, codec, p, shape, check["fingerprint"]))
    return rows


def child_cmd(a, p: int) -> list[str]:
    cmd = [sys.executable, "-m", "bench.gather_gemm", "--one", a.codec_name, str(p),
           "--shapes", *a.shapes, "--calls", str(a.calls), "--impl", a.impl]
    if not a.time:
        cmd.append("--no-time")
    if a.wrong_exchange:
        cmd += ["--wrong-exchange", a.wrong_exchange]
    return cmd


def run_children(a, groups, save=lambda rows: None) -> list[dict]:
    """Each (codec, P) in its own process under a.timeout per shape, one at a time; a hang
    or crash costs its group, reported as failed rows. save(rows so far) after each."""
    rows = []
    for codec_name, p in groups:
        a.codec_name = codec_name
        if a.isolate == "none":
            got, why = run_group(a, p), None
        else:
            got, why = child_rows(child_cmd(a, p), a.timeout * len(a.shapes), ROOT)
        done = {r["shape"] for r in got if r["kind"] == "check"}
        got += [{"kind": "check", "kernel": "gather_gemm", "codec": codec_name, "p": p,
                 "dtype": DTYPE, "shape": s, "ok": False, "reason": why or "no result",
                 "fingerprint": None}
                for s in a.shapes if s not in done]
        for r in got:
            if r["kind"] == "check":
                print(f"{codec_name} P={p} {r['shape']}: "
                      + ("ok" if r["ok"] else r["reason"]), flush=True)
        rows += got
        save(rows)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--p", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--codecs", nargs="+", default=["taco", "echo4"])
    ap.add_argument("--shapes", nargs="+", default=SHAPES)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--no-time", dest="time", action="store_false",
                    help="checks only (times follow passed checks by default, on a GPU)")
    ap.add_argument("--impl", choices=["kernel", "emulated"], default=None,
                    help="kernel: the loopback on one GPU (default on GPU); emulated: the "
                         "jnp reference per device (default elsewhere; times nothing)")
    ap.add_argument("--wrong-exchange", choices=["slot", "stale"], default=None)
    ap.add_argument("--isolate", choices=["group", "none"], default="group")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per shape")
    ap.add_argument("--checks-out", default="bench/results/gather_gemm_checks.json")
    ap.add_argument("--times-out", default="bench/results/gather_gemm_loopback.json")
    ap.add_argument("--update", action="store_true",
                    help="keep the output files' rows of what this run does not measure")
    ap.add_argument("--one", nargs=2, metavar=("CODEC", "P"), default=None,
                    help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.impl is None:
        a.impl = "kernel" if jax.default_backend() == "gpu" else "emulated"
    if a.impl == "kernel" and jax.default_backend() != "gpu":
        raise SystemExit(f"bench.gather_gemm: cannot run here: the kernel needs a Hopper GPU "
                         f"(platform {jax.default_backend()!r}; --impl emulated runs the "
                         f"checks on the jnp reference)")
    for shape in a.shapes:
        for p in a.p:
            gemm_shape(shape, p)                   # a bad name or split fails here
    if a.one:
        a.codec_name = a.one[0]
        import json
        for r in run_group(a, int(a.one[1])):
            print("ROW " + json.dumps(r), flush=True)
        return 0
    save = results_saver(a, "gather_gemm", argv, SLACK)
    checks, times = save(run_children(a, [(c, p) for c in a.codecs for p in a.p], save))
    print_table(checks, ["codec", "p", "shape", "m", "k", "n", "ok", "rel_err",
                         "reference_rel_err", "wire_rows_equal", "fingerprint"])
    if times:
        print_table(times, ["codec", "p", "shape", "per_device_us", "gemm_us", "xla_us",
                            "over_gemm", "over_xla", "fingerprint"])
    failed = [r for r in checks if r["ok"] is False]
    if failed:
        r = failed[0]
        print(f"bench.gather_gemm: FAILED {r['codec']} P={r['p']} {r['shape']}: "
              f"{r['reason']} ({len(failed)} of {len(checks)} configurations failed)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
