"""Projected training step on P GPUs, from tensor-parallel steps emulated on one GPU: the
per-device compute of the emulated step plus each call site's collectives on P GPUs, against
three bf16 baselines. Arithmetic on measured JSON only; every figure it prints or writes is a
**projection**.

    python -m bench.step_projection [--results bench/results]
                                    [--out bench/results/step_projection.json]

Model. An emulated step at N (`python -m bench.train_step --emulate-tp N`) runs the N
tensor-parallel members under jax.vmap on one device: N members' compute, and each
all-reduce a sum over the vmapped axis, a memory-bound reduction that reads the N members'
copies and writes the sum (N + 1 tensors of the site's bytes; the broadcast back to the
members taken as fused into their consumers), priced at the measured HBM rate
(kernels.json's roofline, device time). Per-device compute at TP = P is

    C(P) = (step of the "none" row at N = P − Σ_sites all-reduces × (P + 1) · bytes / HBM) / P

(the N members' kernels taken to cost N times one member's; smaller per-member shards on a
real GPU can run below that efficiency, which the check below measures at P = 2). The
projected step of a serial variant at P GPUs and a link rate is C(P) plus, for every call
site, its all-reduces per step (a psum's forward, a pvary's backward) times one all-reduce of
its bytes on P GPUs, in series with the compute (a tensor-parallel step waits for each):

  * plain (bf16), baseline "ring": P = 2, the 2×H200 lax.psum measured (collectives.json,
    interpolated linearly by bytes); P ≥ 3, the ring model of bench.projection: fixed +
    2 (P − 1)/P · bytes / link;
  * plain (bf16), baseline "nvls": the same, at NVLS's bus rate where NVLS runs (P = 8:
    bench.projection.bf16_bus_gbps, NCCL's published 480 GB/s at the 350 GB/s link; at
    P ≤ 4 the ring's figure);
  * compressed over the xla transport: P = 2, the 2×H200 taco psum measured with its
    compressed path forced (collectives.json "compressed_us", by bytes); else its model
    (bench.projection.two_shot at this site's size: 2 fixed + separate kernels + wire);
  * compressed over the fused transport: fixed + max(per-device compute, wire / link), the
    compute the codec's fused kernel's loopback time per device (bench.projection
    .fused_compute: P = 2 the one-shot loopback, P ≥ 3 the one-launch two-shot's, else its
    modelled separate kernels), interpolated by bytes; wire the codec's bytes of the tensor
    (one-shot at P = 2) or 2 (P − 1)/P of them (two-shot).

Overlapped (baseline "overlap" for bf16; variants `<codec>:overlap`): Megatron-SP with
collective matmul. Each all-reduce of the none row becomes a reduce-scatter and an
all-gather of the sequence, each hidden under its paired GEMM: forward, the all-gather
before QKV / FC1 / the LM head under that GEMM, the reduce-scatter after the attention
projection / FC2 under that GEMM; backward, the conjugates under the same GEMM's dX and dW
(twice its forward work; the compressed variants' under dX alone, as taco_jax's collective
matmuls run). A pair costs bench.projection.overlapped: the GEMM in P chunks at
CHUNK_EFFICIENCY of its rate, slowed by SM_SLOWDOWN while the collective runs; the step adds
pair − GEMM (max(0, comm − GEMM) without those losses). comm = fixed + (P − 1)/P · bytes /
link for bf16 (NVLS does not speed an all-gather or reduce-scatter), the codec's bytes for
the compressed variants, whose codec kernels add half the fused all-reduce's per-device
compute per collective (a reduce-scatter and an all-gather of codes make the passes of one
two-shot) in series, and whose LM-head all-gather and reduce-scatter run in series (model
.tp_overlap leaves them plain collectives); `<codec>:overlap-in-gemm` takes the codec as
inside the GEMM's prologue and epilogue, free: a bound (no such kernel exists). GEMM
times: per shape from gemm_table.json (`python -m bench.gemm_table`) where it has the
(preset, P), else from FLOP counts at one rate per (preset, P) calibrated so that the
step's matmul FLOPs (GEMMs and causal attention, forward and backward) take GEMM_SHARE of
C(P); GEMM_SHARE = 1 gives the GEMMs their longest times, the most they can hide, the
hardest overlapped bf16 at the stated losses (the headline's). "headline_sensitivity"
gives the headline again without chunking loss and slowdown, and with the GEMMs at the
share of the compute the 2×H200 profile shows (profile_train.json). C(P) is of the
emulated step without sequence parallelism (as the emulated rows ran): the LayerNorms it
would split are counted whole, for every overlapped variant alike.

Rows: one per (preset, P, link, baseline, variant), speedup_vs_bf16 = that baseline's bf16
step / the variant's. Headline: for 350m at TP 4 and 8 and each link, the best compressed
variant against each baseline, and against the hardest (fastest) of the three. A variant
is priced on the sites its own emulated row traced (compressed or plain, over which
transport); where that row failed (a transport this GPU lacks under jax.vmap), on the "none"
row's sites, each taken as compressed with the variant's codec and transport (said per
row). fixed = bench.fused.FIXED_US, links 350 and 250 GB/s. The method is checked on what
two H200s measured (train_step.json, TP = 2): the bf16 and taco-over-xla steps projected
from the emulated TP2 rows, error = projected / measured − 1 (the ring at P = 2; the
overlapped and NVLS figures are not checked). Goals reported, not enforced: 350m, the best
compressed variant at least 1.12× the hardest bf16 at TP4 and 1.5× at TP8, at both links.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

from bench import fused, projection
from bench.common import env_facts, load_rows_doc, print_table, write_json

RESULTS = projection.RESULTS
MIB = 1 << 20
INPUTS = {"emulated": "train_step_emulated.json", "collectives": "collectives.json",
          "kernels": "kernels.json", "measured_tp2": "train_step.json"}
# read where present: per-shape GEMM times (`python -m bench.gemm_table`), and the 2×H200
# step's kernel profile (the GEMM kernels' share of its compute, a cross-check)
OPTIONAL = {"gemm_table": "gemm_table.json", "profile": "profile_train.json"}
EMULATED_CMD = ("python -m bench.train_step --presets 350m small comm_heavy --mesh 1,1,1 "
                "--emulate-tp 2 4 8 --variants none taco:xla taco:fused echo4:fused --steps 10"
                " (bash bench/gpu_run.sh train_step_emulated, on one GPU)")
LINKS = {"nvlink": fused.LINK_GBPS, "nvlink_measured": fused.MEASURED_GBPS}
ALLREDUCE_OPS = ("psum", "pvary", "psum_with_feedback", "pvary_with_feedback")
BASELINES = projection.BASELINES
# preset → {P: the least speedup of its best compressed variant over the hardest bf16}
GOALS = {"350m": {4: 1.12, 8: 1.5}}
# Overlapped compressed variants: name → (codec, the codec inside the GEMM: a bound)
OVERLAP_VARIANTS = {"taco:overlap": ("taco", False), "echo4:overlap": ("echo4", False),
                    "taco:overlap-in-gemm": ("taco", True),
                    "echo4:overlap-in-gemm": ("echo4", True)}
# The share of C(P) the matmuls' FLOPs are taken to fill (module docstring).
GEMM_SHARE = 1.0
# Megatron's GEMMs of a block and the head: name → (column-parallel: an all-gather before it
# forward, a reduce-scatter of dX after it backward; else row-parallel: a reduce-scatter
# after it forward, an all-gather of dY before it backward)
COLUMN, ROW = ("qkv", "fc1", "head"), ("proj", "fc2")
# GEMMs whose collectives model.tp_overlap leaves serial: the LM head's all-gather and its
# transpose are plain collectives (models/gpt.py, GPT.head). The compressed overlapped
# variants price them in series; bf16's overlap (XLA's collective matmul takes every GEMM)
# hides them too.
SERIAL_IN_PRODUCT = ("head",)
# The backward GEMM a compressed variant's collective hides under: taco_jax's collective
# matmuls are each other's transpose, so a backward collective runs beside the dX GEMM's
# chunks and dW follows it (docs/design.md, "Collective matmuls"); bf16's overlap, as
# Megatron and Transformer Engine run it, pairs it with dX and dW ("bwd").
PRODUCT_BWD_PASS = "dx"
GEMM_KERNEL = r"gemm|nvjet|xmma|cutlass|dot"           # GEMM kernels' names in a profile
# what each collective of an overlapped variant's pricing lists ("priced" in the JSON)
OVERLAP_COLUMNS = ("gemm", "pass", "collective", "per_step", "bytes", "comm_us", "gemm_us",
                   "chunked_gemm_us", "exposed_us", "codec_us")


# -- inputs ---------------------------------------------------------------------------------
def _load(name: str, results: str) -> dict:
    how = f"; produce it with `{EMULATED_CMD}`" if name == "emulated" else ""
    return load_rows_doc(os.path.join(results, INPUTS[name]),
                         f"bench.step_projection: input {name}", how)


def load_inputs(results: str = RESULTS, any_platform: bool = False) -> dict:
    docs = {k: _load(k, results) for k in INPUTS}
    emu = docs["emulated"]
    if emu.get("platform") != "gpu" and not any_platform:
        raise SystemExit(f"bench.step_projection: input emulated "
                         f"({os.path.join(results, INPUTS['emulated'])}) was measured on "
                         f"{emu.get('platform')!r}, not a GPU; produce it with "
                         f"`{EMULATED_CMD}`")
    return docs


def load_optional(results: str) -> dict:
    """{name: doc} of the OPTIONAL inputs present in `results`."""
    out = {}
    for name, file in OPTIONAL.items():
        path = os.path.join(results, file)
        if os.path.exists(path):
            out[name] = load_rows_doc(path, f"bench.step_projection: input {name}")
    return out


def facts(docs: dict) -> dict:
    return {k: {"file": {**INPUTS, **OPTIONAL}[k], **{f: d.get(f) for f in
                                      ("device", "n_devices", "jax", "commit")}}
            for k, d in docs.items()}


# -- interpolation by bytes -------------------------------------------------------------------
def interp(points: dict, x: float) -> tuple[float, bool]:
    """(y at x, extrapolated): linear between the points ({x: y}) around x; outside their
    range, proportional to x from the nearest point (a fixed cost is not extrapolated)."""
    xs = sorted(points)
    if not xs:
        raise ValueError("no points to interpolate")
    if x <= xs[0] or x >= xs[-1]:
        near = xs[0] if x <= xs[0] else xs[-1]
        return points[near] * x / near, x != near
    for a, b in zip(xs, xs[1:]):
        if a <= x <= b:
            return points[a] + (points[b] - points[a]) * (x - a) / (b - a), False
    raise AssertionError


# -- one all-reduce on P GPUs -------------------------------------------------------------------
class Prices:
    """One all-reduce's µs on P GPUs at a link rate, by route (see the module's model)."""

    def __init__(self, docs: dict, fused_compute: dict, kernel_times: dict, codecs: dict,
                 fixed_us: float = fused.FIXED_US):
        rows = [r for r in docs["collectives"]["rows"] if r.get("codec") == "taco"]
        self.lax_psum = {r["mib_per_device"] * MIB: r["lax_psum_us"] for r in rows
                         if r.get("lax_psum_us")}
        self.taco_xla = {r["mib_per_device"] * MIB: r["compressed_us"] for r in rows
                         if r.get("compressed_us")}
        self.fused = fused_compute
        self.kernels = kernel_times
        self.codecs = codecs
        self.fixed_us = fixed_us

    def __call__(self, site: dict, p: int, gbps: float, baseline: str = "ring"
                 ) -> tuple[float, str]:
        b = site["bytes"]
        if not site["compressed"]:
            bus = projection.bf16_bus_gbps(p, gbps, baseline)
            if bus != gbps:
                return self.fixed_us + 2 * (p - 1) / p * b / bus / 1e3, "bf16 NVLS model"
            if p == 2 and self.lax_psum:
                us, ext = interp(self.lax_psum, b)
                return us, "2xH200 lax.psum measured" + (" (extrapolated)" if ext else "")
            return self.fixed_us + 2 * (p - 1) / p * b / gbps / 1e3, "bf16 ring model"
        codec = self._codec(site["codec"])
        n = b // _itemsize(site["dtype"])
        # "fused (loopback)": the one-launch kernel ran; "fused (exchange emulated)": the
        # fused transport's separate kernels, priced as the three-launch schedule below
        if site["transport"] in ("fused", "fused (loopback)"):
            table = self.fused.get(site["codec"], {}).get(p)
            if not table or not table["mib_us"]:
                raise ValueError(f"no fused compute of {site['codec']} at P = {p}")
            compute, ext = interp({m * MIB: us for m, us in table["mib_us"].items()}, b)
            w = codec.wire_bytes(n) * (1 if p == 2 else 2 * (p - 1) / p)
            return (self.fixed_us + max(compute, w / gbps / 1e3),
                    f"fused: {table['compute']} {table['source']}"
                    + (" (extrapolated)" if ext else ""))
        if p == 2 and site["codec"] == "taco" and self.taco_xla:
            us, ext = interp(self.taco_xla, b)
            return us, "2xH200 taco psum (xla) measured" + (" (extrapolated)" if ext else "")
        kt = self.kernels.get(site["codec"], {})
        if not kt:
            raise ValueError(f"no kernel times of {site['codec']} for the xla transport")
        t = {k: interp({m * MIB: v[k] for m, v in kt.items() if k in v}, b)[0]
             for k in projection.TWO_SHOT_KERNELS}
        compute = projection.two_shot_compute_us(codec, t, p)
        w = 2 * (p - 1) / p * codec.wire_bytes(n)
        return 2 * self.fixed_us + compute + w / gbps / 1e3, "xla transport model"

    def codec_us(self, codec: str, nbytes: float, p: int) -> tuple[float, str]:
        """Half the codec's fused all-reduce per-device compute at P (by bytes): its
        kernels' work in one reduce-scatter or all-gather of codes."""
        table = self.fused.get(codec, {}).get(p)
        if not table or not table["mib_us"]:
            raise ValueError(f"no fused compute of {codec} at P = {p}")
        us, _ = interp({m * MIB: v for m, v in table["mib_us"].items()}, nbytes)
        return us / 2, f"half of {table['compute']} {table['source']}"

    def overlap(self, colls: list[dict], times: dict, p: int, gbps: float,
                codec: str | None = None, in_gemm: bool = False,
                sm_slowdown: float = projection.SM_SLOWDOWN) -> tuple[float, dict]:
        """(ms the step adds over C(P), {"codec": how its kernels were priced,
        "collectives": per (GEMM, pass, collective) a list of OVERLAP_COLUMNS}): each
        collective hidden under its GEMM (projection.overlapped); bf16 (codec None) or the
        codec's codes on the wire, its kernels in series unless `in_gemm`."""
        total, detail, how = 0.0, [], "bf16"
        for c in colls:
            if codec is None:
                comm = projection.half_collective_us(c["bytes"], p, gbps, self.fixed_us)
                codec_us, how = 0.0, "bf16"
            else:
                w = self._codec(codec).wire_bytes(c["bytes"] // c["itemsize"])
                comm = projection.half_collective_us(w, p, gbps, self.fixed_us)
                codec_us, how = ((0.0, "codec inside the GEMM (bound)") if in_gemm
                                 else self.codec_us(codec, c["bytes"], p))
            ps = PRODUCT_BWD_PASS if codec is not None and c["pass"] == "bwd" else c["pass"]
            gemm, chunked = times[c["gemm"], ps]
            if codec is not None and c["gemm"] in SERIAL_IN_PRODUCT:
                o, chunked = {"exposed_us": comm}, gemm                  # in series
            else:
                o = projection.overlapped(comm, gemm, chunked, sm_slowdown)
            total += c["count"] * (o["exposed_us"] + codec_us) / 1e3
            detail.append([c["gemm"], c["pass"], c["collective"], c["count"], c["bytes"],
                           *(round(x, 2) for x in (comm, gemm, chunked, o["exposed_us"],
                                                   codec_us))])
        return total, {"codec": how, "collectives": detail}

    def _codec(self, name: str):
        if name not in self.codecs:
            from taco_jax import codecs
            self.codecs[name] = codecs.get(name)
        return self.codecs[name]


def _itemsize(dtype: str) -> int:
    import jax.numpy as jnp
    return jnp.dtype(dtype).itemsize


# -- the step -------------------------------------------------------------------------------
def allreduce_sites(sites: list[dict]) -> list[dict]:
    """The sites that run all-reduces on more than one device; any other collective over
    such an axis is not priced: ValueError naming it."""
    out = []
    for s in sites:
        if s["p"] <= 1:
            continue
        if s["op"] not in ALLREDUCE_OPS:
            raise ValueError(f"site {s['op']}{s['shape']} over {s['axes']}: only all-reduces "
                             f"are priced")
        if s["allreduces_per_step"]:
            out.append(s)
    return out


def emulated_reduce_ms(sites: list[dict], n: int, hbm_gbps: float) -> float:
    """The emulated all-reduces' own work in the emulated step: per all-reduce, (N + 1) ·
    bytes at the HBM rate (the N members' copies read, the sum written)."""
    return sum(s["allreduces_per_step"] * (n + 1) * s["bytes"] for s in
               allreduce_sites(sites)) / hbm_gbps / 1e6


def compute_ms(none_row: dict, hbm_gbps: float) -> dict:
    n = none_row["emulate_tp"]
    e = emulated_reduce_ms(none_row["sites"], n, hbm_gbps)
    return {"preset": none_row["preset"], "p": n, "emulated_none_step_ms":
            none_row["step_ms"], "emulated_reduce_ms": round(e, 3),
            "compute_ms_per_device": round((none_row["step_ms"] - e) / n, 3)}


def variant_sites(row: dict | None, none_row: dict, codec: str, transport: str
                  ) -> tuple[list[dict], str]:
    """The sites a variant is priced on, and where they come from."""
    if row is not None and not row.get("error") and row.get("sites") is not None:
        return row["sites"], "its emulated row"
    if codec == "none":
        return none_row["sites"], "the none row"
    why = "its row failed" if row is not None else "no row of it"
    return ([{**s, "compressed": True, "codec": codec, "transport": transport}
             for s in none_row["sites"]],
            f"the none row's, taken as compressed with {codec} over {transport} ({why})")


def step_ms(sites: list[dict], compute: float, prices: Prices, p: int, gbps: float,
            baseline: str = "ring") -> tuple[float, list[dict]]:
    """(communication ms per step, per site: its all-reduce's µs and how it was priced);
    plain sites at the `baseline`'s rate ("ring" or "nvls")."""
    comm, detail = 0.0, []
    for s in allreduce_sites(sites):
        us, how = prices(s, p, gbps, baseline)
        comm += s["allreduces_per_step"] * us / 1e3
        detail.append({"op": s["op"], "bytes": s["bytes"],
                       "allreduces_per_step": s["allreduces_per_step"],
                       "codec": s["codec"] if s["compressed"] else "none",
                       "allreduce_us": round(us, 2), "priced_by": how})
    return comm, detail


# -- Megatron-SP: the collectives and the GEMMs they hide under -------------------------------
def model_shape(preset: str, overrides: list[str] = ()) -> dict:
    """The sizes the overlap model needs, from the preset as the emulated run loaded it."""
    from train import config as config_lib
    cfg = config_lib.load_config(preset, list(overrides))
    m = cfg.model
    if getattr(m, "arch", "gpt") != "gpt":
        raise ValueError(f"model.arch={m.arch!r}: the overlap model knows the GPT's GEMMs")
    return {"layers": m.n_layer, "d_model": m.d_model, "ff": m.ff, "vocab": m.vocab_size,
            "seq_len": m.seq_len, "tokens": cfg.train.batch_size * m.seq_len}


def gemms(shape: dict) -> dict:
    """Megatron's GEMMs: name → (K, N, calls per forward pass), the whole weight's
    contraction and output sizes (TP splits N of a column-parallel one, K of a row-parallel
    one)."""
    h, n_layer = shape["d_model"], shape["layers"]
    return {"qkv": (h, 3 * h, n_layer), "proj": (h, h, n_layer),
            "fc1": (h, shape["ff"], n_layer), "fc2": (shape["ff"], h, n_layer),
            "head": (h, shape["vocab"], 1)}


def matmul_flops(shape: dict, p: int) -> dict:
    """FLOPs per device: {"gemm_fwd": {name: one forward call}, "step": the step's matmuls,
    GEMMs and causal attention (QKᵀ and AV, 2 · tokens · seq_len · d_model a layer),
    forward and backward (3 × forward)}."""
    t = shape["tokens"]
    fwd = {g: 2 * t * k * n / p for g, (k, n, _) in gemms(shape).items()}
    attn = 2 * t * shape["seq_len"] * shape["d_model"] / p
    calls = {g: c for g, (_, _, c) in gemms(shape).items()}
    return {"gemm_fwd": fwd,
            "step": 3 * (sum(fwd[g] * calls[g] for g in fwd) + shape["layers"] * attn)}


def sp_collectives(sites: list[dict], shape: dict) -> list[dict]:
    """The none row's all-reduce sites as Megatron-SP's collectives, each with the GEMM it
    hides under: [{"gemm", "pass", "collective", "count" per step, "bytes" (the gathered
    tensor), "itemsize"}]. The sites must be Megatron's: 2 · layers psums (the row-parallel
    outputs) and 2 · layers + 1 pvarys (the column-parallel inputs and the head), each of
    tokens · d_model values; else ValueError."""
    sites = allreduce_sites(sites)
    counts = {"psum": 0, "pvary": 0}
    for s in sites:
        counts[s["op"].removesuffix("_with_feedback")] += s["allreduces_per_step"]
    n_layer = shape["layers"]
    want = {"psum": 2 * n_layer, "pvary": 2 * n_layer + 1}
    itemsize = {_itemsize(s["dtype"]) for s in sites}
    nbytes = {s["bytes"] for s in sites}
    if (counts != want or len(itemsize) != 1
            or nbytes != {shape["tokens"] * shape["d_model"] * min(itemsize)}):
        raise ValueError(f"sites ({counts}, bytes {sorted(nbytes)}) are not Megatron's "
                         f"({want} all-reduces of {shape['tokens']} × {shape['d_model']} "
                         f"values)")
    b, i = nbytes.pop(), itemsize.pop()
    out = []
    for g in ROW + COLUMN:
        count = 1 if g == "head" else n_layer
        fwd, bwd = (("reduce_scatter", "all_gather") if g in ROW
                    else ("all_gather", "reduce_scatter"))
        out += [{"gemm": g, "pass": "fwd", "collective": fwd, "count": count, "bytes": b,
                 "itemsize": i},
                {"gemm": g, "pass": "bwd", "collective": bwd, "count": count, "bytes": b,
                 "itemsize": i}]
    return out


def gemm_times(shape: dict, p: int, compute_ms: float, preset: str, table: dict | None = None,
               share: float = GEMM_SHARE,
               chunk_efficiency: float = projection.CHUNK_EFFICIENCY) -> tuple[dict, dict]:
    """({(gemm, "fwd" | "dx" | "bwd"): (µs whole, µs in P chunks)}, how they were had). From
    gemm_table.json's rows of (preset, P) where every GEMM and pass (fwd, dx, dw) is there
    with the FLOPs of this shape (bwd = dx + dw); else FLOP counts at the rate that makes
    the step's matmul FLOPs fill `share` of C(P), the chunks at `chunk_efficiency`, bwd
    twice fwd."""
    f = matmul_flops(shape, p)
    rows = {(r.get("gemm"), r.get("pass")): r for r in (table or {}).get("rows", ())
            if r.get("preset") == preset and r.get("p") == p}
    want = {(g, ps) for g in f["gemm_fwd"] for ps in ("fwd", "dx", "dw")}
    if want <= set(rows) and all(
            abs(2 * rows[k]["m"] * rows[k]["k"] * rows[k]["n"] - f["gemm_fwd"][k[0]])
            <= 1e-6 * f["gemm_fwd"][k[0]] and rows[k].get("us") and rows[k].get("chunked_us")
            for k in want):
        times = {}
        for g in f["gemm_fwd"]:
            times[g, "fwd"] = (rows[g, "fwd"]["us"], rows[g, "fwd"]["chunked_us"])
            times[g, "dx"] = (rows[g, "dx"]["us"], rows[g, "dx"]["chunked_us"])
            times[g, "bwd"] = (rows[g, "dx"]["us"] + rows[g, "dw"]["us"],
                               rows[g, "dx"]["chunked_us"] + rows[g, "dw"]["chunked_us"])
        return times, {"gemm_times": "measured per shape",
                       "source": f"{OPTIONAL['gemm_table']}@{str(table.get('commit'))[:7]}",
                       "gemm_ms": _gemm_ms(times, shape)}
    rate = f["step"] / (share * compute_ms * 1e-3)                       # FLOP/s
    times = {}
    for g, fl in f["gemm_fwd"].items():
        us = fl / rate * 1e6
        times[g, "fwd"] = times[g, "dx"] = (us, us / chunk_efficiency)
        times[g, "bwd"] = (2 * us, 2 * us / chunk_efficiency)
    return times, {"gemm_times": f"FLOP count at the rate that fills {share:g} of C(P) with "
                                 f"the step's matmul FLOPs (not measured per shape)",
                   "gemm_share": share, "step_matmul_tflop": round(f["step"] / 1e12, 3),
                   "matmul_tflops": round(rate / 1e12, 1), "gemm_ms": _gemm_ms(times, shape)}


def _gemm_ms(times: dict, shape: dict) -> float:
    """The step's paired GEMMs, whole, ms per device (a check against C(P))."""
    return round(sum(c * (times[g, "fwd"][0] + times[g, "bwd"][0])
                     for g, (_, _, c) in gemms(shape).items()) / 1e3, 3)


def profile_gemm_share(doc: dict | None) -> dict:
    """{preset: the GEMM kernels' share of the compute} in the 2×H200 profile of the bf16
    step (profile_train.json): a lower bound, the profile listing its top kernels only."""
    out = {}
    for r in (doc or {}).get("rows", ()):
        if r.get("codec") == "none" and r.get("compute_us") and r.get("top_kernels"):
            g = sum(k.get("us_per_iter", 0.0) for k in r["top_kernels"]
                    if re.search(GEMM_KERNEL, k.get("name", "")))
            out[r["preset"]] = round(g / r["compute_us"], 3)
    return out


def _variant_route(row: dict) -> tuple[str, str]:
    """(codec, transport) a variant row asks for: its TP codec, its named transport (the
    default taken as the xla transport)."""
    t = row.get("transport") or "default"
    return row.get("codec_tp", "none"), "xla" if t in ("default", "auto") else t


def project(docs: dict, prices: Prices, hbm_gbps: float, links: dict = LINKS,
            gemm_share: float | dict = GEMM_SHARE, table: dict | None = None,
            chunk_efficiency: float = projection.CHUNK_EFFICIENCY,
            sm_slowdown: float = projection.SM_SLOWDOWN
            ) -> tuple[list[dict], list[dict], list[dict], list[dict]]:
    """(compute per (preset, P), rows, pricing detail per (preset, P, link, variant), gaps)
    from the emulated rows. gemm_share: one share, or {preset: share} (GEMM_SHARE for a
    preset without one); table: gemm_table.json's document; chunk_efficiency, sm_slowdown:
    the overlap's assumptions (bench.projection)."""
    groups: dict = {}
    for r in docs["emulated"]["rows"]:
        groups.setdefault((r["preset"], r["emulate_tp"]), []).append(r)
    overrides = docs["emulated"].get("overrides") or []
    computes, out, priced, gaps = [], [], [], []
    for (preset, n), rows in groups.items():
        none = next((r for r in rows if r.get("codec_tp") == "none" and not r.get("error")
                     and r.get("step_ms") and r.get("transport") != "overlap"), None)
        if none is None:
            gaps.append({"preset": preset, "p": n, "why": "no emulated none row"})
            continue
        c = compute_ms(none, hbm_gbps)
        share = (gemm_share.get(preset, GEMM_SHARE) if isinstance(gemm_share, dict)
                 else gemm_share)
        try:
            shape = model_shape(preset, overrides)
            colls = sp_collectives(none["sites"], shape)
            times, how = gemm_times(shape, n, c["compute_ms_per_device"], preset, table, share,
                                    chunk_efficiency)
            c.update(how)
        except (ValueError, FileNotFoundError) as e:
            colls = None
            gaps.append({"preset": preset, "p": n, "why": f"overlap not priced: {e}"})
        computes.append(c)
        for link, gbps in links.items():
            variants = _price_variants(rows, none, c, prices, n, gbps, colls,
                                       times if colls else None, gaps, preset, link,
                                       sm_slowdown)
            for v in variants:
                r = v.pop("emulated")
                v["emulated"] = r and {
                    "emulated_step_ms": r.get("step_ms"),
                    "emulated_at": str(r.get("measured_at")
                                       or docs["emulated"].get("commit"))[:7],
                    "emulated_added_ms": r.get("added_ms"), "emulated_error": r.get("error")}
            head = {"preset": preset, "p": n, "link": link, "link_gbps": gbps}
            priced += [{**head, "variant": v["variant"],
                        **({"baseline": v["baseline"]} if "baseline" in v else {}),
                        "sites_from": v["sites_from"], "priced": v.pop("detail")}
                       for v in variants]
            out += _baseline_rows(head, variants, c["compute_ms_per_device"])
    return computes, out, priced, gaps


def _price_variants(rows, none, c, prices, n, gbps, colls, times, gaps, preset, link,
                    sm_slowdown) -> list[dict]:
    """bf16 under each baseline, then the compressed variants: [{"variant", "codec",
    "transport", "comm_ms", "detail", ...}] (bf16's with "baseline")."""
    out = []
    for baseline in BASELINES:
        if baseline == "overlap":
            if colls is None:
                continue
            comm, detail = prices.overlap(colls, times, n, gbps, sm_slowdown=sm_slowdown)
        else:
            comm, detail = step_ms(none["sites"], c["compute_ms_per_device"], prices, n, gbps,
                                   baseline)
        out.append({"variant": "bf16", "baseline": baseline, "codec": "none",
                    "transport": "overlap" if baseline == "overlap" else baseline,
                    "sites_from": "the none row", "comm_ms": comm, "detail": detail,
                    "emulated": none})
    for r in rows:
        codec, transport = _variant_route(r)
        # the overlapped variants are priced from the none row below, by the same names
        if codec == "none" or transport == "overlap":
            continue
        sites, source = variant_sites(r, none, codec, transport)
        try:
            comm, detail = step_ms(sites, c["compute_ms_per_device"], prices, n, gbps)
        except ValueError as e:
            gaps.append({"preset": preset, "p": n, "variant": r["variant"], "link": link,
                         "why": str(e)})
            continue
        out.append({"variant": r["variant"], "codec": codec, "transport": transport,
                    "sites_from": source, "comm_ms": comm, "detail": detail, "emulated": r})
    for name, (codec, in_gemm) in (OVERLAP_VARIANTS.items() if colls else ()):
        try:
            comm, detail = prices.overlap(colls, times, n, gbps, codec, in_gemm, sm_slowdown)
        except ValueError as e:
            gaps.append({"preset": preset, "p": n, "variant": name, "link": link,
                         "why": str(e)})
            continue
        out.append({"variant": name, "codec": codec, "transport": "overlap",
                    "sites_from": "the none row's, as Megatron-SP's collectives",
                    "comm_ms": comm, "detail": detail, "emulated": None,
                    **({"bound": "codec inside the GEMM, taken as free: no such kernel"}
                       if in_gemm else {})})
    return out


def _baseline_rows(head: dict, variants: list[dict], compute: float) -> list[dict]:
    """One row per baseline and variant: the variant's step against that baseline's bf16."""
    out = []
    bf16 = {v["baseline"]: compute + v["comm_ms"] for v in variants if v["variant"] == "bf16"}
    for baseline, base in bf16.items():
        for v in variants:
            if v["variant"] == "bf16" and v["baseline"] != baseline:
                continue
            total = compute + v["comm_ms"]
            row = {"projection": "projected", **head, "baseline": baseline,
                   "variant": v["variant"], "codec": v["codec"], "transport": v["transport"],
                   "compute_ms": compute, "comm_ms": round(v["comm_ms"], 3),
                   "projected_ms": round(total, 3), "bf16_ms": round(base, 3),
                   "speedup_vs_bf16": round(base / total, 3)}
            if "bound" in v:
                row["bound"] = v["bound"]
            row.update(v["emulated"] or {})
            out.append(row)
    return out


def headline(rows: list[dict], goals: dict = GOALS) -> list[dict]:
    """Per (preset, P) of `goals` and link: each baseline's bf16 step, the best compressed
    variant against it, the hardest (fastest) bf16 and the best variant's speedup over it,
    beside the best bound (the codec inside the GEMM), and each codec's best. The goal is
    judged on the best variant that is not a bound."""
    out = []
    for preset, by_p in goals.items():
        for p, goal in sorted(by_p.items()):
            sel = [r for r in rows if r["preset"] == preset and r["p"] == p]
            for link_gbps in sorted({r["link_gbps"] for r in sel}, reverse=True):
                here = [r for r in sel if r["link_gbps"] == link_gbps]
                bf16 = {r["baseline"]: r["projected_ms"] for r in here if r["variant"] == "bf16"}
                comp = {r["variant"]: r for r in here
                        if r["variant"] != "bf16" and r["baseline"] == "ring"}
                if not bf16 or not comp:
                    continue
                built = {k: v for k, v in comp.items() if "bound" not in v}
                best = min(built, key=lambda k: built[k]["projected_ms"])
                bounds = {k: v for k, v in comp.items() if "bound" in v}
                bound = min(bounds, key=lambda k: bounds[k]["projected_ms"]) if bounds else None
                hardest = min(bf16, key=bf16.get)
                ms = built[best]["projected_ms"]
                e = {"preset": preset, "p": p, "link_gbps": link_gbps,
                     "bf16_ms": bf16, "hardest": hardest,
                     "best": best, "best_ms": ms,
                     "speedup": {b: round(t / ms, 3) for b, t in bf16.items()},
                     "speedup_vs_hardest": round(bf16[hardest] / ms, 3),
                     "goal": goal}
                e["meets_goal"] = e["speedup_vs_hardest"] >= goal
                e["best_by_codec"] = {}                    # each codec's best, bounds apart
                for codec in sorted({v["codec"] for v in built.values()}):
                    k = min((k for k in built if built[k]["codec"] == codec),
                            key=lambda k: built[k]["projected_ms"])
                    e["best_by_codec"][codec] = {
                        "variant": k, "projected_ms": built[k]["projected_ms"],
                        "speedup_vs_hardest": round(bf16[hardest] / built[k]["projected_ms"], 3)}
                if bound:
                    bms = bounds[bound]["projected_ms"]
                    e.update(bound=bound, bound_ms=bms,
                             bound_speedup={b: round(t / bms, 3) for b, t in bf16.items()},
                             bound_speedup_vs_hardest=round(bf16[hardest] / bms, 3))
                out.append(e)
    return out


def method_check(docs: dict, prices: Prices, hbm_gbps: float) -> list[dict]:
    """The bf16 and taco (xla transport) TP2 steps two H200s measured (train_step.json),
    projected from the emulated TP2 rows: error = projected / measured − 1."""
    emu = [r for r in docs["emulated"]["rows"] if r.get("emulate_tp") == 2]
    commit = str(docs["measured_tp2"].get("commit"))[:7]
    out = []
    for m in docs["measured_tp2"]["rows"]:
        if m.get("tp") != 2 or m.get("codec_fwd") not in ("none", "taco"):
            continue
        none = next((r for r in emu if r["preset"] == m["preset"]
                     and r.get("codec_tp") == "none" and not r.get("error")
                     and r.get("transport") != "overlap"), None)
        if none is None:
            continue
        c = compute_ms(none, hbm_gbps)
        codec = m["codec_fwd"]
        row = next((r for r in emu if r["preset"] == m["preset"] and r.get("codec_tp") == codec
                    and (r.get("transport") == "xla" or codec == "none")), None)
        sites, source = variant_sites(row, none, codec, "xla")
        comm, _ = step_ms(sites, c["compute_ms_per_device"], prices, 2, fused.LINK_GBPS)
        proj = c["compute_ms_per_device"] + comm
        out.append({"projection": "projected from the emulated TP2 rows, checked on 2xH200",
                    "preset": m["preset"], "variant": "bf16" if codec == "none" else "taco:xla",
                    "sites_from": source, "compute_ms": c["compute_ms_per_device"],
                    "comm_ms": round(comm, 3), "projected_ms": round(proj, 3),
                    "measured_2gpu_ms": m["step_ms"], "measured": f"train_step.json@{commit}",
                    "error": round(proj / m["step_ms"] - 1, 3)})
    return out


# -- the program ------------------------------------------------------------------------------
def flat(rows: list[dict]) -> list[dict]:
    """A table row per (preset, P, link, variant): its projected step, speedup against each
    baseline's bf16."""
    out: dict = {}
    for r in rows:
        k = (r["preset"], r["p"], r["link_gbps"], r["variant"])
        e = out.setdefault(k, {"preset": r["preset"], "P": r["p"], "GB/s": r["link_gbps"],
                               "variant": r["variant"], "compute ms": r["compute_ms"],
                               "projected ms": r["projected_ms"]})
        if r["variant"] == "bf16":
            e["variant"] = f"bf16 {r['baseline']}"
            e["projected ms"] = r["projected_ms"]
            k = (*k[:3], e["variant"])
            out[k] = out.pop((r["preset"], r["p"], r["link_gbps"], "bf16"))
        else:
            e[f"x {r['baseline']}"] = r["speedup_vs_bf16"]
    return list(out.values())


def flat_headline(e: dict) -> dict:
    out = {"preset": e["preset"], "P": e["p"], "GB/s": e["link_gbps"]}
    for b in BASELINES:
        if b in e["bf16_ms"]:
            out[f"bf16 {b} ms"] = e["bf16_ms"][b]
    out.update({"best": e["best"], "ms": e["best_ms"],
                **{f"x {b}": v for b, v in e["speedup"].items()},
                "hardest": e["hardest"], "x hardest": e["speedup_vs_hardest"],
                "goal": f">= {e['goal']} " + ("met" if e["meets_goal"] else "not met"),
                "bound": e.get("bound", "-"),
                "bound x hardest": e.get("bound_speedup_vs_hardest", "-")})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=RESULTS, help="the directory of the input JSON")
    ap.add_argument("--out", default=os.path.join(RESULTS, "step_projection.json"))
    ap.add_argument("--any-platform", action="store_true",
                    help="accept an emulated file measured off the GPU (tests)")
    a = ap.parse_args(argv)
    docs = load_inputs(a.results, a.any_platform)
    optional = load_optional(a.results)
    from taco_jax import codecs as registry
    codecs = {c: registry.get(c) for c in projection.CODECS}
    times, pfacts = projection.kernel_times(a.results)
    fc = projection.fused_compute(a.results, codecs)
    hbm = docs["kernels"].get("roofline", {}).get("device_gbs")
    if not isinstance(hbm, (int, float)) or not hbm > 0:
        raise SystemExit(f"bench.step_projection: input kernels "
                         f"({os.path.join(a.results, INPUTS['kernels'])}) has no roofline "
                         f"device_gbs")
    prices = Prices(docs, fc, times, dict(codecs))
    table = optional.get("gemm_table")
    computes, rows, priced, gaps = project(docs, prices, hbm, table=table)
    head = headline(rows)
    shares = profile_gemm_share(optional.get("profile"))
    cases = {"no chunking loss, no slowdown beside a collective":
             {"chunk_efficiency": 1.0, "sm_slowdown": 0.0}}
    if shares:
        cases["the GEMMs at the 2xH200 profile's share of the compute (profile_train.json, "
              "a lower bound)"] = {"gemm_share": shares}
    sensitivity = []
    for what, kw in cases.items():
        _, srows, _, _ = project(docs, prices, hbm, table=table, **kw)
        sensitivity += [{"case": what, **{k: e.get(k) for k in (
            "preset", "p", "link_gbps", "bf16_ms", "hardest", "best", "speedup_vs_hardest",
            "bound", "bound_speedup_vs_hardest")}} for e in headline(srows)]
    checks = method_check(docs, prices, hbm)
    if rows:
        table_rows = flat(rows)
        print_table(table_rows, list(dict.fromkeys(k for r in table_rows for k in r)))
    print("PROJECTED, not measured: per-device compute of the emulated step + its "
          "collectives on P GPUs; x ring / nvls / overlap: speedup over that bf16 "
          "baseline's projected step\n")
    if head:
        flat_head = [flat_headline(e) for e in head]
        print_table(flat_head, list(dict.fromkeys(k for r in flat_head for k in r)))
        print("headline, PROJECTED: the best compressed variant (bounds apart) against each "
              "bf16 baseline and the hardest of them\n")
    if checks:
        print_table(checks, ["preset", "variant", "compute_ms", "comm_ms", "projected_ms",
                             "measured_2gpu_ms", "error"])
        print("method check: TP2 projected from the emulated rows vs two H200s measured")
    for g in gaps:
        print(f"not projected: {g}")
    emu = docs["emulated"]
    payload = {"projected": True, "device": emu.get("device"), "jax": emu.get("jax"),
               "commit": env_facts()["commit"],
               "command": " ".join(["python -m bench.step_projection",
                                    *(sys.argv[1:] if argv is None else argv)]),
               "inputs": {**facts({**docs, **optional}),
                          **{f"projection:{k}": v for k, v in pfacts.items()}},
               "parameters": {"fixed_us": fused.FIXED_US, "links_gbps": LINKS,
                              "hbm_gbps": hbm, "baselines": list(BASELINES),
                              "nvls": {"bus_gbps_at_350": projection.NVLS_BUS_GBPS,
                                       "gain": round(projection.NVLS_GAIN, 4),
                                       "from_p": projection.NVLS_MIN_P},
                              "chunk_efficiency": projection.CHUNK_EFFICIENCY,
                              "overlap_columns": list(OVERLAP_COLUMNS),
                              "sm_slowdown": projection.SM_SLOWDOWN,
                              "gemm_share": GEMM_SHARE,
                              "gemm_times": ("gemm_table.json where it has the (preset, P), "
                                             "else FLOP counts" if table else
                                             "FLOP counts (no gemm_table.json): "
                                             "see compute[].gemm_times"),
                              "goals": {f"{p}/TP{n}": g for p, v in GOALS.items()
                                        for n, g in v.items()}},
               "model": __doc__.split("\n\n", 2)[2].strip(),
               "fused_compute_us": {c: {str(p): {"compute": t["compute"],
                                                 "source": t["source"],
                                                 **{f"{m:g}": us for m, us in
                                                    sorted(t["mib_us"].items())}}
                                        for p, t in sorted(v.items())}
                                    for c, v in fc.items()},
               "profile_gemm_share": shares,
               "compute": computes, "headline": head,
               "headline_sensitivity": sensitivity, "rows": rows,
               "method_check": checks, "priced": priced, "gaps": gaps}
    write_json(a.out, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
