"""The row-parallel GEMM with the codec in its epilogue, on one GPU through a loopback:
checks and device time.

    python -m bench.gemm_codec [--p 2 4 8] [--codecs taco echo4] [--shapes 350m.attn_out …]
                               [--exchanges all owner] [--calls 3] [--no-time]
                               [--gemm-config KEY=VALUE …] [--impl kernel|emulated]
                               [--checks-out …] [--times-out …] [--update]

P virtual devices are P groups of programs of one launch (`kernels.gemm`): device d
computes x_d @ w_d, its GEMM's epilogue encodes each output tile and stores the wire into
its destinations' receive buffers (`loopback_gemm_encode`), then each device decodes the P
wires it holds, sums them in f32 and adds the residual (`decode_sum_residual`). Exchange
"all": every tile to every device, each device's result the whole all-reduce; "owner":
each tile to the owner of its rows (M in P ranges), each device's result its rows (the
reduce-scatter of sequence parallelism). Shapes are the per-device GEMMs of tensor
parallelism (M = tokens, K = the contraction shard, N = d_model), from the presets'
configs/<preset>.yaml:

  <preset>.attn_out  (T, d_model / P, d_model): the attention output projection;
  <preset>.mlp_out   (T, d_ff / P, d_model): the MLP's second GEMM;
  odd                (64·37, 320, 768) at every P: 37 row tiles (one compute warpgroup),
                     5 K steps, 3 column tiles; "owner": (64·8·37, 320, 768), 37·8/P
                     row tiles an owner;
  MxKxN              any other.

Checks (`--calls` calls, fresh inputs each; bf16): every virtual device gets the same bits
("owner": the owners' rows are the all-reduce's, bit for bit); a NaN put into
x_0[M // 3, 3] makes exactly that output row NaN; the error against the exact sum
(Σ_j x_j @ w_j in f32, + residual; rows without the NaN), relative to the all-reduced part,
is at most SLACK × that of the jnp reference (`gemm_allreduce_reference`, one quantization
of round(x_j @ w_j)); "wire_rows_equal" is the share of device 0's wire rows, as device
P − 1 received them, equal to the reference's bytes (the rounding of the f32 sums and the
encoder's approximate reciprocals make a few differ). Rows → --checks-out, each with its
codec, P, dtype, exchange, shape, the GEMM's launch ("config": `--gemm-config` over the
default), ok, reason, the library's sources hash and the commit, and (the kernels at their
default launch) the fingerprint of the modules they ran (`kernels.fused.checked`): the
fused transport selects the GEMMs where such rows pass (`python -m bench.fused
--write-checked`).

Times (device time, per virtual device; a configuration is timed only after its checks
pass): "per_device_us" the GEMM with its encode and exchange, "decode_us" the decode,
sum and residual add, "fused_us" both; "gemm_us" the same GEMM with a plain epilogue in the
same launch shape (`kernels.gemm.matmul`, P groups), "xla_gemm_us" XLA's dot on the same
shapes; "separate_us" one device's three-launch path on its own data: XLA's dot, the
codec's compress, decode_sum of P wires (of its rows: "owner"), XLA's residual add. Rows →
--times-out.

Each (codec, P) runs in its own process under --timeout per shape and exchange (a hang
costs only its group; `--isolate none` runs in this one); the files are written after each
group, and `--update` keeps their rows of what this run does not measure. On CPU (tests)
`--impl emulated` stands the jnp reference in for the kernels, per device, and
`--wrong-exchange slot|stale` breaks its exchange, so the checks can be seen failing; it
times nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import child_rows, device_time, env_facts, print_table, write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = ["350m.attn_out", "350m.mlp_out", "comm_heavy.attn_out", "comm_heavy.mlp_out",
          "odd"]
ODD = (64 * 37, 320, 768)
# The odd shape where each of P ≤ 8 owners needs whole tiles of rows: 37 of them an owner at
# P = 8 (two compute warpgroups: M a multiple of 128)
ODD_OWNER = (64 * 8 * 37, 320, 768)
EXCHANGES = ("all", "owner")
SLACK = 1.05          # the kernel's error within this factor of its jnp reference's
DTYPE = "bf16"


# -- shapes -------------------------------------------------------------------------------------
def preset_dims(preset: str) -> dict:
    """Tokens per step and widths of configs/<preset>.yaml."""
    import yaml
    with open(os.path.join(ROOT, "configs", f"{preset}.yaml")) as f:
        cfg = yaml.safe_load(f)
    model, train = cfg["model"], cfg["train"]
    d = int(model["d_model"])
    return {"tokens": int(train["batch_size"]) * int(model["seq_len"]), "d_model": d,
            "d_ff": int(model.get("d_ff") or 0) or 4 * d}


def gemm_shape(name: str, p: int, exchange: str = "all") -> tuple[int, int, int]:
    """A shape name (module docstring) at P devices → (M, K, N) per device."""
    if name == "odd":
        return ODD_OWNER if exchange == "owner" else ODD
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)", name)
    if m:
        return tuple(int(v) for v in m.groups())
    preset, _, gemm = name.partition(".")
    dims = preset_dims(preset)
    inner = {"attn_out": dims["d_model"], "mlp_out": dims["d_ff"]}.get(gemm)
    if inner is None:
        raise SystemExit(f"bench.gemm_codec: shape {name!r}: want <preset>.attn_out, "
                         f"<preset>.mlp_out, odd or MxKxN")
    if inner % p:
        raise SystemExit(f"bench.gemm_codec: {name}: {inner} does not split over P={p}")
    return dims["tokens"], inner // p, dims["d_model"]


# -- the implementations ------------------------------------------------------------------------
def emulated(xs, ws, residual, codec, wrong: str | None = None):
    """The two launches in jnp: every device's wire (`gemm_encode_reference`) in every
    device's receive buffer, each device decoding its P slots. wrong="slot": the last
    device finds its own wire in slot 0 (a store to the wrong place); "stale": slot P − 1
    holds, on every device, the wire of other values of the same scale (a store that never
    landed, an earlier call's bytes left)."""
    from taco_jax.kernels import gemm
    p = xs.shape[0]
    wires = [gemm.gemm_encode_reference(xs[j], ws[j], codec) for j in range(p)]
    out = []
    for d in range(p):
        recv = list(wires)
        if wrong == "slot" and d == p - 1:
            recv[0] = wires[d]
        if wrong == "stale":
            recv[p - 1] = gemm.gemm_encode_reference(xs[p - 1][::-1], ws[p - 1], codec)
        out.append(gemm.decode_sum_residual_reference(jnp.stack(recv), residual, codec))
    return jnp.stack(out)


def owned_rows(y):
    """(P, M, N), row d device d's all-reduce → (P, M / P, N): device o's rows of its own
    (what the reduce-scatter gives device o)."""
    p, m, n = y.shape
    return jnp.stack([y[o, o * (m // p):(o + 1) * (m // p)] for o in range(p)])


def gemm_config(pairs, m: int):
    """["pingpong=true", "steps=2"] → kernels.gemm.GemmConfig: those fields over the
    default for M rows; none → None (the default, as the kernels take it)."""
    import dataclasses
    from taco_jax.kernels.gemm import GemmConfig, encode_epilogue
    if not pairs:
        return None
    fields = {f.name: f.type for f in dataclasses.fields(GemmConfig)}
    kw = {}
    for item in pairs:
        key, _, value = item.partition("=")
        if key not in fields:
            raise SystemExit(f"bench.gemm_codec: --gemm-config {item!r}: not a GemmConfig "
                             f"field ({', '.join(fields)})")
        kw[key] = (value in ("1", "true", "True") if "bool" in str(fields[key]) else
                   None if value == "None" else int(value))
    try:
        return dataclasses.replace(encode_epilogue.default_config(m), **kw)
    except ValueError as e:
        raise SystemExit(f"bench.gemm_codec: --gemm-config {' '.join(pairs)}: {e}") from None


def implementation(impl: str, codec, wrong: str | None = None, exchange: str = "all",
                   cfg=None):
    """(xs, ws, residual) → exchange "all": (P, M, N), row d what device d computed;
    "owner": (P, M / P, N), device o's rows. cfg: the GEMM's launch (None: its default)."""
    scatter = exchange == "owner"
    if impl == "kernel":
        from taco_jax.kernels import gemm
        return jax.jit(lambda xs, ws, r: gemm.loopback_gemm_allreduce(xs, ws, r, codec, cfg,
                                                                      scatter=scatter))
    if scatter:
        return jax.jit(lambda xs, ws, r: owned_rows(emulated(xs, ws, r, codec, wrong)))
    return jax.jit(lambda xs, ws, r: emulated(xs, ws, r, codec, wrong))


# -- checks -----------------------------------------------------------------------------------
def make_inputs(key, p: int, m: int, k: int, n: int):
    """xs (P, M, K) with a scale per device, a NaN at xs[0, M // 3, 3]; ws (P, K, N) of
    unit-variance products; residual (M, N). Returns them and the NaN's row."""
    k1, k2, k3, k4 = jax.random.split(key, 4)
    scale = jnp.exp(jax.random.normal(k4, (p, 1, 1)))
    xs = (jax.random.normal(k1, (p, m, k)) * scale).astype(jnp.bfloat16)
    ws = (jax.random.normal(k2, (p, k, n)) / np.sqrt(k)).astype(jnp.bfloat16)
    res = jax.random.normal(k3, (m, n)).astype(jnp.bfloat16)
    row = m // 3
    return xs.at[0, row, 3].set(jnp.nan), ws, res, row


@jax.jit
def _exact(xs, ws, res):
    part = jnp.einsum("pmk,pkn->mn", xs.astype(jnp.float32), ws.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
    return part + res.astype(jnp.float32), part


@jax.jit
def _rel_err(y, exact, part, finite):
    """‖y − exact‖ / ‖Σ_j x_j @ w_j‖ over the finite rows."""
    d = jnp.where(finite[:, None], y.astype(jnp.float32) - exact, 0.0)
    e = jnp.where(finite[:, None], part, 0.0)
    return jnp.sqrt(jnp.sum(d * d)) / jnp.sqrt(jnp.sum(e * e))


@jax.jit
def _same_bits(y):
    u = jax.lax.bitcast_convert_type(y, jnp.uint16)
    return jnp.all(u == u[:1])


def check_call(fn, reference, xs, ws, res, nan_row, wire=None,
               all_reduce=None) -> tuple[dict, str | None]:
    """One call's checks → (figures, failure reason or None). reference(xs, ws, res) → the
    (M, N) result the jnp reference gives; wire: (kernel's, reference's) wire rows of
    device 0, or None; all_reduce: for the reduce-scatter (fn's result (P, M / P, N)), the
    all-reduce, whose rows its shards must be, bit for bit."""
    y = fn(xs, ws, res)
    if all_reduce is None:
        same = bool(_same_bits(y))
        y = y[0]
    else:
        y = y.reshape(-1, y.shape[-1])                      # the owners' rows, in order
        same = bool(_same_bits(jnp.stack([y, all_reduce(xs, ws, res)[0]])))
    want_nan = np.zeros(y.shape[0], bool)
    want_nan[nan_row] = True
    nan_rows = np.asarray(jnp.any(jnp.isnan(y), axis=1))
    all_nan = bool(jnp.all(jnp.isnan(y[nan_row])))
    exact, part = _exact(xs, ws, res)
    finite = jnp.asarray(~want_nan)
    figures = {("same_on_every_device" if all_reduce is None else
                "shards_are_the_all_reduce"): same,
               "nan_rows_ok": bool(np.array_equal(nan_rows, want_nan) and all_nan),
               "rel_err": float(_rel_err(y, exact, part, finite)),
               "reference_rel_err": float(_rel_err(reference(xs, ws, res), exact, part,
                                                   finite))}
    if wire is not None:
        got, want = wire
        figures["wire_rows_equal"] = float(jnp.mean(jnp.all(got == want, axis=-1)))
    why = None
    if not same:
        why = ("results differ between virtual devices" if all_reduce is None else
               "the owners' rows are not the all-reduce's")
    elif not figures["nan_rows_ok"]:
        why = "NaN outside the row the input's NaN reaches, or that row not all NaN"
    elif not figures["rel_err"] <= SLACK * figures["reference_rel_err"]:     # NaN fails too
        why = (f"rel_err {figures['rel_err']:.4g} > its reference's "
               f"{figures['reference_rel_err']:.4g} × {SLACK}")
    return figures, why


def row_fingerprint(impl: str, codec, p: int, exchange: str, config=None) -> str | None:
    """The fingerprint of the modules a check row vouches for (`kernels.fused.checked.
    fingerprint` of kernel "gemm_all" or "gemm_owner", bf16): the kernels on a GPU (--impl
    kernel) at their default launch; None for a --gemm-config or the jnp reference. The
    fused transport selects the row-parallel GEMMs from such rows (`python -m bench.fused
    --write-checked`)."""
    if impl != "kernel" or config:
        return None
    from taco_jax.kernels.fused import checked
    return checked.fingerprint("gemm_owner" if exchange == "owner" else "gemm_all", codec,
                               jnp.bfloat16, p)


def describe(a) -> str:
    return " ".join(a.gemm_config or ()) or "default"


def run_checks(a, codec, p: int, shape: str, exchange: str = "all") -> dict:
    from taco_jax.kernels import gemm
    m, k, n = gemm_shape(shape, p, exchange)
    cfg = gemm_config(a.gemm_config, m)
    row = {"kind": "check", "kernel": "gemm_encode", "codec": a.codec_name, "p": p,
           "dtype": DTYPE, "shape": shape, "exchange": exchange, "config": describe(a),
           "m": m, "k": k, "n": n, "impl": a.impl}
    fp = row_fingerprint(a.impl, codec, p, exchange, a.gemm_config)
    if fp is not None:
        row["fingerprint"] = fp
    why = gemm.unsupported(codec, p, (m, k), (k, n), jnp.bfloat16, cfg,
                           scatter=exchange == "owner")
    if why is not None:
        return {**row, "ok": False, "reason": f"not covered: {why}", "calls": 0}
    fn = implementation(a.impl, codec, a.wrong_exchange, exchange, cfg)
    all_reduce = (implementation(a.impl, codec, a.wrong_exchange, cfg=cfg)
                  if exchange == "owner" else None)
    reference = jax.jit(lambda xs, ws, r: gemm.gemm_allreduce_reference(xs, ws, r, codec))
    wire_fn = None
    if a.impl == "kernel":
        encode = jax.jit(lambda xs, ws: gemm.loopback_gemm_encode(
            xs, ws, codec, cfg, exchange=exchange)[p - 1, 0])
        ref_wire = jax.jit(lambda x, w: gemm.gemm_encode_reference(x, w, codec))
        rows = m * n // 256 // (p if exchange == "owner" else 1)       # device P − 1's
        first = rows * (p - 1) if exchange == "owner" else 0
        wire_fn = lambda xs, ws: (encode(xs, ws),                       # noqa: E731
                                  ref_wire(xs[0], ws[0])[first:first + rows])
    worst, why = None, None
    for call in range(a.calls):
        xs, ws, res, nan_row = make_inputs(jax.random.key(1000 * p + call), p, m, k, n)
        wire = wire_fn(xs, ws) if wire_fn is not None and call == 0 else None
        figures, why = check_call(fn, reference, xs, ws, res, nan_row, wire, all_reduce)
        if worst is None or figures["rel_err"] > worst["rel_err"] or why:
            worst = {**(worst or {}), **figures}
        if why:
            why = f"call #{call + 1} of {a.calls}: {why}"
            break
    worst = {k: round(v, 6) if isinstance(v, float) else v for k, v in worst.items()}
    return {**row, **worst, "calls": a.calls, "ok": why is None, "reason": why}


# -- times -------------------------------------------------------------------------------------
def _us(t: dict) -> float:
    return t["us"] if t.get("us") is not None else t["host_us"]


def run_times(a, codec, p: int, shape: str, exchange: str = "all") -> dict:
    """Device time per virtual device of the two launches, the plain GEMM in the same launch
    shape, XLA's dot, and one device's three-launch path."""
    from taco_jax.kernels import gemm
    m, k, n = gemm_shape(shape, p, exchange)
    cfg = gemm_config(a.gemm_config, m)
    xs, ws, res, _ = make_inputs(jax.random.key(7), p, m, k, n)
    xs = jnp.nan_to_num(xs)
    resp = (res.reshape(p, m // p, n) if exchange == "owner" else
            jnp.broadcast_to(res, (p, m, n)))
    iters = 3 if p * m * n * 2 >= 1 << 28 else 10
    t = lambda fn, x: device_time(fn, x, iters=iters)                     # noqa: E731
    enc = t(lambda a_: gemm.loopback_gemm_encode(*a_, codec, cfg, exchange=exchange),
            (xs, ws))
    recv = gemm.loopback_gemm_encode(xs, ws, codec, cfg, exchange=exchange)
    dec = t(lambda a_: gemm.decode_sum_residual(*a_, codec), (recv, resp))
    plain = t(lambda a_: gemm.matmul(*a_, cfg), (xs, ws))
    xla = t(lambda a_: jnp.matmul(*a_, preferred_element_type=jnp.float32).astype(
        jnp.bfloat16), (xs, ws))
    row = {"kind": "time", "kernel": "gemm_encode", "codec": a.codec_name, "p": p,
           "dtype": DTYPE, "shape": shape, "exchange": exchange, "config": describe(a),
           "m": m, "k": k, "n": n,
           "timer": "device" if enc.get("us") is not None else "host",
           "per_device_us": round(_us(enc) / p, 2), "decode_us": round(_us(dec) / p, 2),
           "gemm_us": round(_us(plain) / p, 2), "xla_gemm_us": round(_us(xla) / p, 2)}
    row["fused_us"] = round(row["per_device_us"] + row["decode_us"], 2)
    try:
        row.update(separate(codec, xs[0], ws[0], res, p, t, exchange == "owner"))
        row["fused_over_separate"] = round(row["fused_us"] / row["separate_us"], 3)
    except Exception as e:            # noqa: BLE001 - a figure beside the measured ones
        row["separate_error"] = f"{type(e).__name__}: {e}"[:300]
    return row


def separate(codec, x, w, res, p: int, t, scatter: bool = False) -> dict:
    """One device's three-launch path, each launch timed alone: XLA's dot (rounded to
    bf16), the codec's compress of its blocks (Triton), decode_sum of P such wires
    (Triton; scatter: of its 1/P of the rows) and XLA's residual add (of those rows)."""
    from taco_jax import codecs
    provider = codec.kernels
    compress, decode_sum = (provider.kernel("compress", "triton"),
                            provider.kernel("decode_sum", "triton"))
    y = jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    blocks = codecs.to_blocks(y, codec.block_size)
    wire = compress(blocks, codec)
    mine = (y.shape[0] // p if scatter else y.shape[0])
    recv = jnp.stack([wire[:wire.shape[0] * mine // y.shape[0]]] * p)
    total = decode_sum(recv, codec, jnp.bfloat16).reshape(mine, y.shape[1])
    parts = {
        "xla_dot_us": _us(t(lambda a_: jnp.matmul(*a_, preferred_element_type=jnp.float32)
                            .astype(jnp.bfloat16), (x, w))),
        "compress_us": _us(t(lambda b: compress(b, codec), blocks)),
        "decode_sum_us": _us(t(lambda r: decode_sum(r, codec, jnp.bfloat16), recv)),
        "residual_add_us": _us(t(lambda a_: a_[0] + a_[1], (total, res[:mine])))}
    return {"separate_us": round(sum(parts.values()), 2),
            **{k: round(v, 2) for k, v in parts.items()}}


# -- the driver ---------------------------------------------------------------------------------
def run_group(a, p: int) -> list[dict]:
    """This process: every shape of one (codec, P), checked, then timed if it passed."""
    from taco_jax import codecs
    codec = codecs.get(a.codec_name)
    rows = []
    for exchange in a.exchanges:
        for shape in a.shapes:
            check = run_checks(a, codec, p, shape, exchange)
            rows.append(check)
            if a.time and check["ok"] and a.impl == "kernel":
                rows.append(run_times(a, codec, p, shape, exchange))
    return rows


def child_cmd(a, p: int) -> list[str]:
    cmd = [sys.executable, "-m", "bench.gemm_codec", "--one", a.codec_name, str(p),
           "--shapes", *a.shapes, "--exchanges", *a.exchanges, "--calls", str(a.calls),
           "--impl", a.impl]
    if a.gemm_config:
        cmd += ["--gemm-config", *a.gemm_config]
    if not a.time:
        cmd.append("--no-time")
    if a.wrong_exchange:
        cmd += ["--wrong-exchange", a.wrong_exchange]
    return cmd


def run_children(a, groups, save=lambda rows: None) -> list[dict]:
    """Each (codec, P) in its own process under a.timeout per shape, one at a time; a hang
    or crash costs its group, reported as failed rows. save(rows so far) after each group,
    so what is done survives a kill of the whole run."""
    rows = []
    for codec_name, p in groups:
        a.codec_name = codec_name
        if a.isolate == "none":
            got = run_group(a, p)
            why = None
        else:
            limit = a.timeout * len(a.shapes) * len(a.exchanges)
            got, why = child_rows(child_cmd(a, p), limit, ROOT)
        done = {(r["exchange"], r["shape"]) for r in got if r["kind"] == "check"}
        # a configuration that did not finish fails against the modules it stands for
        from taco_jax import codecs
        codec = codecs.get(codec_name)
        marks = {e: {} if fp is None else {"fingerprint": fp} for e in a.exchanges
                 for fp in [row_fingerprint(a.impl, codec, p, e, a.gemm_config)]}
        got += [{"kind": "check", "kernel": "gemm_encode", "codec": codec_name, "p": p,
                 "dtype": DTYPE, "shape": s, "exchange": e, "config": describe(a),
                 "ok": False, "reason": why or "no result", **marks[e]}
                for e in a.exchanges for s in a.shapes if (e, s) not in done]
        for r in got:
            if r["kind"] == "check":
                print(f"{codec_name} P={p} {r['exchange']} {r['shape']}: "
                      + ("ok" if r["ok"] else r["reason"]), flush=True)
        rows += got
        save(rows)
    return rows


def row_key(r: dict) -> tuple:
    return (r.get("codec"), r.get("p"), r.get("dtype"), r.get("exchange"), r.get("shape"),
            r.get("config", "default"))


def merged(path: str, rows: list[dict], update: bool) -> list[dict]:
    """rows, after (--update) the rows of the file at `path` that they do not measure
    again (another codec, P or shape)."""
    if not update:
        return rows
    try:
        with open(path) as f:
            old = json.load(f).get("rows", [])
    except (OSError, ValueError, AttributeError):
        old = []
    mine = {row_key(r) for r in rows}
    return [r for r in old if row_key(r) not in mine] + rows


def results_saver(a, name: str, argv, slack: float = SLACK):
    """save(rows) → (check rows, time rows): writes both files of a `bench.<name>` run
    (a.checks_out, a.times_out; --update keeps the rows they do not measure again), each
    row naming the commit and library sources, the run's facts and command beside them."""
    facts = env_facts()
    meta = {**facts, "impl": a.impl, "calls": a.calls, "slack": slack,
            "command": f"python -m bench.{name} " + " ".join(
                sys.argv[1:] if argv is None else argv)}

    def save(rows):
        rows = [{**r, "commit": facts["commit"], "sources": facts["sources"]} for r in rows]
        checks = [r for r in rows if r["kind"] == "check"]
        times = [r for r in rows if r["kind"] == "time"]
        write_json(a.checks_out, {**meta, "rows": merged(a.checks_out, checks, a.update)})
        if times:
            write_json(a.times_out, {**meta, "per_device": "µs per virtual device",
                                     "rows": merged(a.times_out, times, a.update)})
        return checks, times
    return save


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--p", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--codecs", nargs="+", default=["taco", "echo4"])
    ap.add_argument("--shapes", nargs="+", default=SHAPES)
    ap.add_argument("--exchanges", nargs="+", choices=EXCHANGES, default=list(EXCHANGES),
                    help="all: the all-reduce (every tile to every device); owner: the "
                         "reduce-scatter (each tile to the owner of its rows)")
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--gemm-config", nargs="+", metavar="KEY=VALUE", default=None,
                    help="GemmConfig fields over the default, e.g. pingpong=true steps=2 "
                         "(rows name them as their \"config\")")
    ap.add_argument("--no-time", dest="time", action="store_false",
                    help="checks only (times follow passed checks by default, on a GPU)")
    ap.add_argument("--impl", choices=["kernel", "emulated"], default=None,
                    help="kernel: the loopback on one GPU (default on GPU); emulated: the "
                         "jnp reference per device (default elsewhere; times nothing)")
    ap.add_argument("--wrong-exchange", choices=["slot", "stale"], default=None)
    ap.add_argument("--isolate", choices=["group", "none"], default="group")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per shape")
    ap.add_argument("--checks-out", default="bench/results/gemm_codec_checks.json")
    ap.add_argument("--times-out", default="bench/results/gemm_codec_loopback.json")
    ap.add_argument("--update", action="store_true",
                    help="keep the output files' rows of what this run does not measure "
                         "(another codec, P or shape)")
    ap.add_argument("--one", nargs=2, metavar=("CODEC", "P"), default=None,
                    help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.impl is None:
        a.impl = "kernel" if jax.default_backend() == "gpu" else "emulated"
    if a.impl == "kernel" and jax.default_backend() != "gpu":
        raise SystemExit(f"bench.gemm_codec: cannot run here: the kernels need a Hopper GPU "
                         f"(platform {jax.default_backend()!r}; --impl emulated runs the "
                         f"checks on the jnp reference)")
    for shape in a.shapes:
        for p in a.p:
            for exchange in a.exchanges:     # a bad name, split or config fails here
                gemm_config(a.gemm_config, gemm_shape(shape, p, exchange)[0])
    if a.one:
        a.codec_name = a.one[0]
        for r in run_group(a, int(a.one[1])):
            print("ROW " + json.dumps(r), flush=True)
        return 0
    save = results_saver(a, "gemm_codec", argv)
    checks, times = save(run_children(a, [(c, p) for c in a.codecs for p in a.p], save))
    print_table(checks, ["codec", "p", "exchange", "shape", "m", "k", "n", "ok", "rel_err",
                         "reference_rel_err", "wire_rows_equal"])
    if times:
        print_table(times, ["codec", "p", "exchange", "shape", "per_device_us", "decode_us",
                            "fused_us", "gemm_us", "xla_gemm_us", "separate_us",
                            "fused_over_separate"])
    failed = [r for r in checks if not r["ok"]]
    if failed:
        r = failed[0]
        print(f"bench.gemm_codec: FAILED {r['codec']} P={r['p']} {r['exchange']} "
              f"{r['shape']}: {r['reason']} ({len(failed)} of {len(checks)} configurations "
              f"failed)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
