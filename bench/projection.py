"""Projected all-reduce times by link: echo4 and taco over the fused-transport method, beside
an uncompressed bf16 all-reduce at the same link rate. Arithmetic on measured JSON only.

    python -m bench.projection [--out bench/results/projection_links.json]

Nothing here is measured on more than one GPU: every figure is **projected** from one H200's
kernel device times and a link rate, by the method of `bench.fused.project` (which this
program calls for P = 2) and `bench.fused.method_check` (the check of that method against
what two H200s measured for the xla transport, carried into the JSON):

  * one launch (overlapped): fixed_us + max(per-device compute, wire bytes / link rate);
  * separate launches (serial): fixed_us × collectives + compute + wire bytes / link rate.

P = 2, one-shot: each device compresses its tensor (n values) once, sends the codes to the
peer, both decode-and-sum: compute = compress(n) + decode_sum(2 wires of n); wire =
W(n), the codec's bytes for n values. P = 4, 8, two-shot: compress the (P − 1)/P of the
tensor that is sent, all-to-all, owner reduce (decode the P − 1 received segments, sum with
the own segment in fp32, encode once), all-gather, decompress everything: compute =
(P − 1)/P · compress(n) + owner_reduce + decompress(n); wire = 2 (P − 1)/P · W(n), two
collectives. The owner reduce is extrapolated from the measured P = 2 reduce of n values
(`owner_reduce_us`). Uncompressed: bf16 all-reduce, fixed_us + 2 (P − 1)/P · 2n bytes /
link rate (P = 2: the tensor's bytes, one-shot or two-shot alike), its summation taken as
hidden under the wire (NCCL reduces in-kernel, far below HBM rate at these links).

Kernel device times (one H200, bf16 in), each size's "source" in the JSON, from
bench/results/kernels.json (`python -m bench.kernels`): taco's Triton compress, reduce and
decompress, its decode_sum from fused_loopback.json (the Triton decode_sum timed beside the
loopback; no row at 1 GiB, so no taco one-shot there); echo4's compress, decompress, reduce
and decode_sum at every size, one row per kernel and size, timed as the library runs them
(each kernel's `echo4.default_config`: its tiling and tile-math variants).

Fused kernels (P = 2, one launch, through `bench.fused.project` unchanged): each codec's
one-launch kernel as it runs today, from its per-device loopback time on one H200 at its
default launch (taco: fused_loopback.json, echo4: fused_echo4_loopback.json). Links:
350 GB/s (2×H200 NVLink, per direction, the parameter of bench.fused), 250 GB/s (what
lax.psum and NCCL reached there), the rate fitted per size to the xla transport's measured
2-GPU times (method_check: 96-267 GB/s; a pessimistic bound, since it absorbs that
transport's fixed costs), and 50 GB/s (PCIe 5.0 x16, or 400 Gb/s between hosts). fixed_us = 15 µs at every P (checked
at P = 2 only).

Fused two-shot at P ≥ 3 ("fused_two_shot" in the JSON), at 350 and 250 GB/s: fixed_us +
max(per-device compute, wire / link), wire = 2 (P − 1)/P · the codec's bytes of the tensor
(the reduce-scatter and all-gather of codes: taco 264 bytes per 256 values, echo4 72 per
128, from the codec objects), beside the uncompressed bf16 ring all-reduce under the same
link model (fixed_us + 2 (P − 1)/P · 2 bytes per value / link); ratio = projected / ring.
Per-device compute, per codec: the one-launch two-shot's loopback per-device time
(fused_two_shot_loopback.json, every checked bf16 row of its default variant, a row's
codec its own field or the file's), and beside it that file's three-launch kernels of one
device at the same P ("separate kernels, measured": the one-launch kernel at the separate
kernels' speed); a codec with no loopback row at P = 4 or 8 (echo4 today): its separate
kernels modelled from kernels.json's device times (`two_shot_compute_us`: compress of the
P − 1 segments it sends at the measured per-byte throughput of the tensor's compress, the
owner's reduce by `owner_reduce_us`, decompress of the P sums). Goals reported, not
enforced: at P = 8, 64 and 256 MiB, taco ≤ 0.55 and echo4 ≤ 0.35 of the bf16 ring.

Beside the ring, every row prices bf16 over NVLS ("bf16_nvls", "*_vs_nvls"): NCCL's
published 480 GB/s bus rate at the 350 GB/s link (× NVLS_GAIN = 1.37, scaled with the link),
at P = 8 only (at 2-4 GPUs NVLS gives no gain: the ring's figure). The third bf16 baseline,
collective matmul (all-gather / reduce-scatter hidden under the paired GEMM, `overlapped`),
needs a step's GEMMs: bench.step_projection prices it.
"""
from __future__ import annotations

import argparse
import os
import sys

from bench import fused
from bench.common import env_facts, load_rows_doc, print_table, write_json

MIB = 1 << 20
RESULTS = os.path.join(fused.ROOT, "bench", "results")
SIZES_MIB = (16, 64, 256, 1024)
PS = (2, 4, 8)
SLOW_GBPS = 50.0
ITEMSIZE = 2                                          # bf16
INPUTS = {"kernels": "kernels.json", "taco_loopback": "fused_loopback.json",
          "echo4_fused": "fused_echo4_loopback.json", "lax_psum": "collectives.json",
          "two_shot_loopback": "fused_two_shot_loopback.json"}
CODECS = ("taco", "echo4")
ONE_SHOT_KERNELS = ("compress", "decode_sum")
TWO_SHOT_KERNELS = ("compress", "reduce", "decompress")
ECHO4_KERNELS = ("compress", "decompress", "reduce", "decode_sum")
# Each codec's fused kernel as it runs today: (input, the variant of its default shape).
FUSED_INPUTS = {"taco": ("taco_loopback", "default"), "echo4": ("echo4_fused", "default")}
# The fused two-shot at P ≥ 3: the links it is projected at, and the goals it is reported
# against (projected / bf16 ring at P = GOAL_P and the GOAL_MIB sizes).
TWO_SHOT_LINKS = ("nvlink", "nvlink_measured")                   # 350 and 250 GB/s
TWO_SHOT_GOALS = {"taco": 0.55, "echo4": 0.35}
GOAL_P, GOAL_MIB = 8, (64, 256)
# What a two-shot row's per-device compute is
LOOPBACK = "one-launch loopback"              # the fused kernel's loopback, per device
SEPARATE = "separate kernels, measured"       # the three-launch kernels of one device at P
MODEL = "separate kernels, modelled"          # kernels.json throughputs (`two_shot`)


def links(fitted: dict[float, float]) -> dict[str, object]:
    """Link name → GB/s per device and direction (a float, or {mib: GB/s} per size)."""
    return {"nvlink": fused.LINK_GBPS, "nvlink_measured": fused.MEASURED_GBPS,
            "nvlink_fitted": fitted, "slow_50": SLOW_GBPS}


# -- inputs ---------------------------------------------------------------------------------
def _fail(name: str, results: str, why: str):
    raise SystemExit(f"bench.projection: input {name} "
                     f"({os.path.join(results, INPUTS[name])}) {why}")


def _load(name: str, results: str) -> dict:
    return load_rows_doc(os.path.join(results, INPUTS[name]), f"bench.projection: input {name}")


def _rows(docs: dict, name: str, results: str, key: str = "rows") -> list[dict]:
    rows = docs[name].get(key)
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        _fail(name, results, f"has no list of {key!r} rows")
    return rows


def _number(r: dict, field: str, name: str, results: str) -> float:
    v = r.get(field)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
        _fail(name, results, f"row {r.get('kernel', '')} {r.get('mib')} MiB: {field}={v!r} "
                             f"is not a positive time")
    return v


def echo4_times(docs: dict, results: str, sizes=SIZES_MIB) -> dict:
    """{mib: {kernel: µs}} from kernels.json's echo4 Triton rows: exactly one row of each
    of ECHO4_KERNELS at each size (compress_feedback, not in the projection, left out)."""
    name = "kernels"
    rows = [r for r in _rows(docs, name, results)
            if r.get("impl") == "triton" and r.get("codec") == "echo4"
            and r.get("kernel") in ECHO4_KERNELS]
    out: dict = {}
    for mib in sizes:
        for kernel in ECHO4_KERNELS:
            hits = [r for r in rows if r.get("mib") == mib and r["kernel"] == kernel]
            if len(hits) != 1:
                _fail(name, results, f"has {len(hits)} echo4 Triton rows of {kernel} at "
                                     f"{mib} MiB (one needed)")
            out.setdefault(mib, {})[kernel] = _number(hits[0], "device_us", name, results)
    return out


def kernel_times(results: str = RESULTS, sizes=SIZES_MIB) -> tuple[dict, dict]:
    """({codec: {mib: {kernel: µs, "source": file@commit}}}, {input: its device facts}).
    echo4 needs every kernel at every one of `sizes`; taco takes the sizes it has."""
    docs = {k: _load(k, results) for k in INPUTS}
    facts = {k: {"file": INPUTS[k], **{f: d.get(f) for f in
                                       ("device", "n_devices", "jax", "commit")}}
             for k, d in docs.items()}
    # a row kept from an earlier run (`bench.kernels --update`) names its own commit
    src = lambda k, r=None: (                                             # noqa: E731
        f"{INPUTS[k]}@{str((r or {}).get('measured_at') or docs[k].get('commit'))[:7]}")
    times: dict = {c: {} for c in CODECS}
    echo4_src = src("kernels")
    for r in _rows(docs, "kernels", results):
        if r.get("impl") == "triton" and r.get("codec") == "taco" and "device_us" in r:
            times["taco"].setdefault(r["mib"], {"source": src("kernels", r)})[
                r["kernel"]] = _number(r, "device_us", "kernels", results)
        elif r.get("impl") == "triton" and r.get("codec") == "echo4":
            echo4_src = src("kernels", r)
    for r in _rows(docs, "taco_loopback", results):
        if (r.get("p") == 2 and r.get("dtype") == "bf16" and r.get("decode_sum_us")
                and r.get("variant", "default") == "default"):
            t = times["taco"].setdefault(r["mib"], {"source": src("kernels")})
            t["decode_sum"] = _number(r, "decode_sum_us", "taco_loopback", results)
            t["source"] += f"; decode_sum {src('taco_loopback')}"
    for mib, t in echo4_times(docs, results, sizes).items():
        times["echo4"][mib] = {**t, "source": echo4_src}
    return times, facts


def fused_kernels(results: str = RESULTS) -> dict:
    """{codec: {"rows": its one-launch kernel's P = 2 bf16 loopback rows (per-device device
    time) at its default launch shape, "source": file@commit variant}} (FUSED_INPUTS)."""
    out = {}
    for codec, (name, variant) in FUSED_INPUTS.items():
        doc = _load(name, results)
        rows = [r for r in _rows({name: doc}, name, results)
                if r.get("p") == 2 and r.get("dtype") == "bf16" and r.get("ok")
                and r.get("checked", True) and r.get("variant", "default") == variant
                and r.get("per_device_us") is not None]
        mibs = [r.get("mib") for r in rows]
        if not rows or len(set(mibs)) != len(mibs):
            _fail(name, results, f"has {len(rows)} checked P = 2 bf16 rows of variant "
                                 f"{variant!r} (one per size needed): sizes {mibs}")
        for r in rows:
            _number(r, "per_device_us", name, results)
            if not all(k in r for k in ("bytes", "compress_us", "decode_sum_us")):
                _fail(name, results, f"row at {r.get('mib')} MiB lacks bytes, compress_us "
                                     f"or decode_sum_us")
        out[codec] = {"rows": rows, "source": f"{INPUTS[name]}@{str(doc.get('commit'))[:7]} "
                                              f"variant {variant}"
                      + (f" ({rows[0]['config']})" if rows[0].get("config") not in
                         (None, "default") else "")}
    return out


def two_shot_loopback(results: str = RESULTS) -> list[dict]:
    """The one-launch two-shot kernel's loopback rows (fused_two_shot_loopback.json): every
    checked bf16 row of the default variant at P ≥ 3, one per (codec, P, size):
    [{"codec", "p", "mib", "per_device_us", "separate_us", "source"}]. A row's codec is its
    own "codec" field, else the file's "codec" (taco where neither says); its source names
    its own "commit" where it has one, else the file's."""
    name = "two_shot_loopback"
    doc = _load(name, results)
    src = f"{INPUTS[name]}@{str(doc.get('commit'))[:7]}"
    out, seen = [], set()
    for r in _rows({name: doc}, name, results):
        if not (isinstance(r.get("p"), int) and r["p"] >= 3 and r.get("dtype") == "bf16"
                and r.get("ok") and r.get("checked", True)
                and r.get("variant", "default") == "default"
                and r.get("per_device_us") is not None):
            continue
        codec = r.get("codec") or doc.get("codec") or "taco"
        key = (codec, r["p"], r.get("mib"))
        if key in seen:
            _fail(name, results, f"has two checked bf16 rows of {codec} at P = {r['p']}, "
                                 f"{r.get('mib')} MiB (one needed)")
        seen.add(key)
        sep = r.get("separate_us")
        out.append({"codec": codec, "p": r["p"], "mib": r.get("mib"),
                    "per_device_us": _number(r, "per_device_us", name, results),
                    "separate_us": sep if isinstance(sep, (int, float)) and sep > 0 else None,
                    "source": (f"{INPUTS[name]}@{str(r['commit'])[:7]}" if r.get("commit")
                               else src)})
    return out


def two_shot_compute(times: dict, loopback: list[dict], codecs: dict,
                     ps=tuple(p for p in PS if p > 2)) -> list[dict]:
    """Per-device compute of the two-shot all-reduce at P ≥ 3, per codec and size:
    [{"codec", "p", "mib", "compute", "compute_us", "source"}]. Where the one-launch
    kernel's loopback has a row: its per-device time (LOOPBACK) and, beside it, the
    three-launch two-shot's kernels for one device at that P from the same file
    (SEPARATE: the one-launch kernel at the separate kernels' speed). A codec with no
    loopback row at a P in `ps`: its separate kernels modelled from kernels.json
    (MODEL, `two_shot_compute_us`) at every size it has there."""
    out = []
    for r in loopback:
        if r["codec"] not in codecs:
            continue
        base = {"codec": r["codec"], "p": r["p"], "mib": r["mib"], "source": r["source"]}
        out.append({**base, "compute": LOOPBACK, "compute_us": r["per_device_us"]})
        if r["separate_us"] is not None:
            out.append({**base, "compute": SEPARATE, "compute_us": r["separate_us"]})
    have = {(e["codec"], e["p"]) for e in out}
    for name, codec in codecs.items():
        for p in ps:
            if (name, p) in have:
                continue
            for mib, t in sorted(times.get(name, {}).items()):
                if all(k in t for k in TWO_SHOT_KERNELS):
                    out.append({"codec": name, "p": p, "mib": mib, "compute": MODEL,
                                "compute_us": round(two_shot_compute_us(codec, t, p), 2),
                                "source": t["source"]})
    return out


def fused_compute(results: str = RESULTS, codecs: dict | None = None) -> dict:
    """Each codec's fused all-reduce, per-device compute by P and size, as the projections
    price it: {codec: {p: {"mib_us": {mib: µs}, "compute": what it is, "source"}}}.
    P = 2: the one-shot kernel's loopback (`fused_kernels`); P ≥ 3: the one-launch
    two-shot's loopback (LOOPBACK), else the modelled separate kernels (MODEL)."""
    if codecs is None:
        from taco_jax import codecs as registry
        codecs = {c: registry.get(c) for c in CODECS}
    times, _ = kernel_times(results)
    out: dict = {c: {} for c in codecs}
    for name, k in fused_kernels(results).items():
        if name in codecs:
            out[name][2] = {"mib_us": {r["mib"]: r["per_device_us"] for r in k["rows"]},
                            "compute": "one-shot " + LOOPBACK, "source": k["source"]}
    for e in two_shot_compute(times, two_shot_loopback(results), codecs):
        if e["compute"] == SEPARATE:
            continue
        t = out[e["codec"]].setdefault(e["p"], {"mib_us": {}, "compute": e["compute"],
                                                "source": e["source"]})
        t["mib_us"][e["mib"]] = e["compute_us"]
    return out


# -- the arithmetic ---------------------------------------------------------------------------
def wire_bytes(codec, n: int) -> int:
    """Bytes on the wire for n values: the codec's rows (its own block size and scales)."""
    return codec.wire_bytes(n)


def owner_reduce_us(reduce_p2_us: float, p: int, row_bytes: int, block: int) -> float:
    """The two-shot owner's step over n/P values and P − 1 received segments, from the
    measured reduce of n values at P = 2 (one received copy read, own values, one wire out).
    By element passes: decode (P − 1)/P·n + encode n/P = n, against the measured call's 2n:
    half, at any P. By bytes: (P·r + s)/(P·(2r + s)) of it (r wire, s input bytes per
    value), half at P = 2 and less above. The larger (element passes) is taken."""
    r = row_bytes / block
    by_bytes = (p * r + ITEMSIZE) / (p * (2 * r + ITEMSIZE))
    return reduce_p2_us * max(0.5, by_bytes)


def _times(compute: float, wire_us: float, fixed_us: float, collectives: int) -> dict:
    return {"compute_us": round(compute, 2), "wire_us": round(wire_us, 2),
            "one_launch_us": round(fixed_us + max(compute, wire_us), 2),
            "separate_us": round(collectives * fixed_us + compute + wire_us, 2),
            "bound": "compute" if compute > wire_us else "wire"}


def one_shot(codec, t: dict, mib: float, gbps: float, fixed_us: float) -> dict | None:
    """P = 2 through bench.fused.project, with compute = compress + decode_sum."""
    if not all(k in t for k in ONE_SHOT_KERNELS):
        return None
    nbytes = int(mib * MIB)
    if (nbytes // ITEMSIZE) % 256:
        raise ValueError(f"{mib=} MiB: bench.fused.project counts wires in 256-value rows")
    row = {"p": 2, "mib": mib, "bytes": nbytes, "dtype": "bf16",
           "per_device_us": t["compress"] + t["decode_sum"], "compress_us": t["compress"],
           "decode_sum_us": t["decode_sum"]}
    per256 = codec.row_bytes * 256 // codec.block_size       # its bytes per 256 values
    pj = fused.project(row, per256, gbps, fixed_us)
    compute, wire_us = row["per_device_us"], pj["wire_us_nvlink"]   # "nvlink": at gbps
    return {"compute_us": round(compute, 2), "wire_us": wire_us,
            "one_launch_us": pj["projected_us_nvlink"],
            "separate_us": pj["projected_three_launch_us_nvlink"],
            "bound": "compute" if compute > wire_us else "wire",
            "wire_bytes": wire_bytes(codec, nbytes // ITEMSIZE)}


def two_shot_compute_us(codec, t: dict, p: int) -> float:
    """The separate kernels of one device in a two-shot over P: compress of the P − 1
    segments it sends ((P−1)/P of the measured compress of the tensor: its per-byte
    throughput at this size), the owner's reduce (`owner_reduce_us`), decompress of the P
    sums (the measured decompress of the tensor)."""
    return ((p - 1) / p * t["compress"]
            + owner_reduce_us(t["reduce"], p, codec.row_bytes, codec.block_size)
            + t["decompress"])


def two_shot(codec, t: dict, mib: float, p: int, gbps: float, fixed_us: float) -> dict | None:
    """P ≥ 2 two-shot: (P−1)/P compress + owner reduce + decompress; 2 (P−1)/P · W."""
    if not all(k in t for k in TWO_SHOT_KERNELS):
        return None
    n = int(mib * MIB) // ITEMSIZE
    compute = two_shot_compute_us(codec, t, p)
    w = 2 * (p - 1) / p * wire_bytes(codec, n)
    return {**_times(compute, w / gbps / 1e3, fixed_us, 2), "wire_bytes": round(w)}


def bf16_allreduce(mib: float, p: int, gbps: float, fixed_us: float,
                   baseline: str = "ring") -> dict:
    """Uncompressed: fixed + 2 (P − 1)/P · tensor bytes / bus rate (P = 2: the tensor's
    bytes); the bus rate the link's (`baseline` "ring") or NVLS's (`bf16_bus_gbps`)."""
    w = 2 * (p - 1) / p * mib * MIB
    bus = bf16_bus_gbps(p, gbps, baseline)
    return {"us": round(fixed_us + w / bus / 1e3, 2), "wire_bytes": round(w),
            **({"bus_gbps": round(bus, 1)} if baseline != "ring" else {})}


# -- the bf16 baselines -------------------------------------------------------------------------
# Three uncompressed all-reduces a tensor-parallel step can run (docs/design.md, "The
# yardstick"): the serial ring at the link rate; serial NVLS (NVLink SHARP), NCCL's default
# on 8 GPUs of one NVSwitch system, about 480 GB/s bus (275 GB/s algorithm) against the
# ring's 365-370 GB/s bus (NVIDIA/nccl-tests#212, NVIDIA/nccl#1455), no gain at 2-4 GPUs;
# and collective matmul, Megatron-SP's all-gather / reduce-scatter hidden under the paired
# GEMM (bench.step_projection prices it: it needs the step's GEMMs).
BASELINES = ("ring", "nvls", "overlap")
NVLS_BUS_GBPS = 480.0
NVLS_MIN_P = 8
# NVLS's bus rate over the link parameter: 480 GB/s at the 350 GB/s link, scaled with the
# link. The harder of two readings (over NCCL's own ring figure, 365 GB/s, it is 1.32).
NVLS_GAIN = NVLS_BUS_GBPS / fused.LINK_GBPS
# Collective matmul runs the GEMM in P chunks of the sequence: each chunk's GEMM at this
# fraction of the whole GEMM's rate (stated, not measured: `python -m bench.gemm_table`
# measures it per shape). Generous at P = 8 for small models (350m's QKV chunk is 2048 ×
# 384 × 1024: under one wave of 128 × 128 tiles on 132 multiprocessors).
CHUNK_EFFICIENCY = 0.9
# While a collective runs beside it, a GEMM runs this much slower (NCCL's and the codes'
# transfers take multiprocessors and memory bandwidth: NCCL's ring uses 16-32 of the
# H200's 132 multiprocessors). Stated, not measured.
SM_SLOWDOWN = 0.10


def bf16_bus_gbps(p: int, link_gbps: float, baseline: str = "ring") -> float:
    """The bus rate of a bf16 all-reduce at P: the link's, except NVLS at P ≥ NVLS_MIN_P
    (link × NVLS_GAIN). NVLS speeds the all-reduce only: an all-gather or reduce-scatter
    moves (P − 1)/P of the bytes at the link rate either way."""
    if baseline not in BASELINES:
        raise ValueError(f"{baseline=} must be one of {BASELINES}")
    return link_gbps * NVLS_GAIN if baseline == "nvls" and p >= NVLS_MIN_P else link_gbps


def half_collective_us(nbytes: float, p: int, gbps: float, fixed_us: float) -> float:
    """An all-gather or reduce-scatter of a tensor of `nbytes` (the gathered size) on P
    devices: fixed + (P − 1)/P · bytes / link (half an all-reduce's bytes)."""
    return fixed_us + (p - 1) / p * nbytes / gbps / 1e3


def overlapped(comm_us: float, gemm_us: float, chunked_us: float | None = None,
               sm_slowdown: float = SM_SLOWDOWN) -> dict:
    """A collective hidden under its paired GEMM (collective matmul). The GEMM runs in P
    chunks (`chunked_us`, default gemm_us / CHUNK_EFFICIENCY), at 1 / (1 + sm_slowdown) of
    its rate while the collective runs; the pair ends when both have: pair = max(comm,
    chunked + comm · s / (1 + s)). exposed = pair − gemm_us, the time the step adds over
    the GEMM alone (the step's compute holds gemm_us): max(0, comm − gemm) with no chunking
    loss and no slowdown.

    Returns {"pair_us", "exposed_us", "hidden": comm inside the GEMM}."""
    if chunked_us is None:
        chunked_us = gemm_us / CHUNK_EFFICIENCY
    s = sm_slowdown
    pair = max(comm_us, chunked_us + comm_us * s / (1 + s))
    return {"pair_us": pair, "exposed_us": pair - gemm_us,
            "hidden": comm_us <= chunked_us * (1 + s)}


def project_rows(times: dict, codecs: dict, link_rates: dict, sizes=SIZES_MIB, ps=PS,
                 fixed_us: float = fused.FIXED_US, fused_kernels: dict | None = None,
                 lax_psum=fused.lax_psum_us) -> list[dict]:
    """One row per (P, size, link): bf16, taco and echo4 projected µs and their ratios;
    at P = 2 also each codec's fused kernel (`fused_kernels`, as `fused_kernels()` reads)."""
    rows = []
    for p in ps:
        for mib in sizes:
            for link, rate in link_rates.items():
                gbps = rate.get(mib) if isinstance(rate, dict) else rate
                if gbps is None:
                    continue
                row = {"projection": "projected from one H200's kernel times and a link "
                                     "rate, not measured",
                       "p": p, "mib": mib, "link": link, "link_gbps": gbps,
                       "method": "one-shot" if p == 2 else "two-shot",
                       "bf16": bf16_allreduce(mib, p, gbps, fixed_us),
                       "bf16_nvls": bf16_allreduce(mib, p, gbps, fixed_us, "nvls")}
                for name, codec in codecs.items():
                    t = times.get(name, {}).get(mib, {})
                    row[name] = (one_shot(codec, t, mib, gbps, fixed_us) if p == 2 else
                                 two_shot(codec, t, mib, p, gbps, fixed_us))
                    if row[name] is not None:
                        row[name]["kernels"] = t.get("source")
                    else:
                        need = ONE_SHOT_KERNELS if p == 2 else TWO_SHOT_KERNELS
                        row[f"{name}_missing"] = (f"no device time of {name} " + ", ".join(
                            k for k in need if k not in t) + f" at {mib} MiB")
                if p == 2 and link.startswith("nvlink"):
                    row["lax_psum_2gpu_measured_us"] = lax_psum(mib)
                if p == 2:
                    row.update(fused_kernel_rows(mib, codecs, fused_kernels or {}, gbps,
                                                 fixed_us))
                rows.append(_ratios(row, list(codecs)))
    return rows


def fused_kernel_rows(mib, codecs, kernels: dict, gbps: float, fixed_us: float) -> dict:
    """P = 2: each codec's one-launch kernel as it runs today, its loopback per-device time
    through bench.fused.project unchanged: {"<codec>_fused_kernel": {...}}."""
    out = {}
    for name, codec in codecs.items():
        fk = [r for r in kernels.get(name, {}).get("rows", ()) if r["mib"] == mib]
        if not fk:
            continue
        pj = fused.project(fk[0], codec.row_bytes, gbps, fixed_us, block=codec.block_size)
        compute, wire_us = fk[0]["per_device_us"], pj["wire_us_nvlink"]  # "nvlink": at gbps
        out[f"{name}_fused_kernel"] = {
            "per_device_us": compute, "wire_us": wire_us,
            "one_launch_us": pj["projected_us_nvlink"],
            "bound": "compute" if compute > wire_us else "wire",
            "source": kernels[name]["source"]}
    return out


def _ratios(row: dict, names: list[str]) -> dict:
    b = row["bf16"]["us"]
    for n in names:
        if row[n] is not None:
            row[f"{n}_vs_bf16"] = round(row[n]["one_launch_us"] / b, 3)
            row[f"{n}_vs_nvls"] = round(row[n]["one_launch_us"] / row["bf16_nvls"]["us"], 3)
    if row.get("echo4") and row.get("taco"):
        row["echo4_vs_taco"] = round(row["echo4"]["one_launch_us"]
                                     / row["taco"]["one_launch_us"], 3)
    for n in names:
        if row.get(f"{n}_fused_kernel"):
            row[f"{n}_fused_kernel_vs_bf16"] = round(
                row[f"{n}_fused_kernel"]["one_launch_us"] / b, 3)
    if row.get("echo4_fused_kernel") and row.get("taco_fused_kernel"):
        row["echo4_vs_taco_fused_kernel"] = round(
            row["echo4_fused_kernel"]["one_launch_us"]
            / row["taco_fused_kernel"]["one_launch_us"], 3)
    return row


def fused_two_shot_rows(compute: list[dict], codecs: dict, link_rates: dict,
                        fixed_us: float = fused.FIXED_US) -> list[dict]:
    """The fused two-shot at P ≥ 3, one row per `two_shot_compute` entry and link of
    TWO_SHOT_LINKS: fixed + max(per-device compute, wire / link), wire = 2 (P − 1)/P · the
    codec's bytes of the tensor (reduce-scatter and all-gather of codes), beside the bf16
    ring all-reduce at the same link and fixed cost; ratio = projected / ring. At P =
    GOAL_P and the GOAL_MIB sizes, the codec's goal (TWO_SHOT_GOALS) and whether the
    ratio meets it."""
    rows = []
    for e in compute:
        codec = codecs[e["codec"]]
        n = int(e["mib"] * MIB) // ITEMSIZE
        w = 2 * (e["p"] - 1) / e["p"] * wire_bytes(codec, n)
        for link in TWO_SHOT_LINKS:
            gbps = link_rates[link]
            wire_us = w / gbps / 1e3
            projected = fixed_us + max(e["compute_us"], wire_us)
            ring = bf16_allreduce(e["mib"], e["p"], gbps, fixed_us)["us"]
            nvls = bf16_allreduce(e["mib"], e["p"], gbps, fixed_us, "nvls")["us"]
            row = {"projection": "fused two-shot, projected: fixed + max(compute, 2 (P-1)/P "
                                 "codes / link); bf16 ring: fixed + 2 (P-1)/P bf16 / link",
                   "codec": e["codec"], "p": e["p"], "mib": e["mib"], "link": link,
                   "link_gbps": gbps, "compute": e["compute"], "source": e["source"],
                   "compute_us": round(e["compute_us"], 2), "wire_bytes": round(w),
                   "wire_us": round(wire_us, 2), "fixed_us": fixed_us,
                   "projected_us": round(projected, 2), "ring_bf16_us": ring,
                   "ratio": round(projected / ring, 3), "nvls_bf16_us": nvls,
                   "ratio_vs_nvls": round(projected / nvls, 3),
                   "bound": "compute" if e["compute_us"] > wire_us else "wire"}
            if e["p"] == GOAL_P and e["mib"] in GOAL_MIB and e["codec"] in TWO_SHOT_GOALS:
                row["goal"] = TWO_SHOT_GOALS[e["codec"]]
                row["meets_goal"] = row["ratio"] <= row["goal"]
            rows.append(row)
    order = {LOOPBACK: 0, SEPARATE: 1, MODEL: 2}
    return sorted(rows, key=lambda r: (r["p"], r["mib"], TWO_SHOT_LINKS.index(r["link"]),
                                       r["codec"] != "taco", order.get(r["compute"], 3)))


def flat_two_shot(row: dict) -> dict:
    goal = row.get("goal")
    return {"P": row["p"], "MiB": f"{row['mib']:g}", "GB/s": row["link_gbps"], "codec": row["codec"],
            "compute from": row["compute"], "compute": row["compute_us"],
            "wire": row["wire_us"], "projected": row["projected_us"],
            "bf16 ring": row["ring_bf16_us"], "ratio": row["ratio"],
            "bf16 NVLS": row["nvls_bf16_us"], "vs NVLS": row["ratio_vs_nvls"],
            "goal": "" if goal is None else f"<= {goal} " + ("met" if row["meets_goal"]
                                                             else "not met")}


# -- the program ------------------------------------------------------------------------------
def flat(row: dict) -> dict:
    """A table row: µs (one launch), compute / wire µs, ratios."""
    out = {"P": row["p"], "MiB": row["mib"], "link": row["link"], "GB/s": row["link_gbps"],
           "bf16": row["bf16"]["us"], "NVLS": row["bf16_nvls"]["us"],
           "lax.psum": row.get("lax_psum_2gpu_measured_us", "")}
    for n in CODECS:
        r = row.get(n)
        out[n] = r["one_launch_us"] if r else "-"
        out[f"{n} c/w"] = f"{r['compute_us']:.0f}/{r['wire_us']:.0f}" if r else "-"
        out[f"{n} sep"] = r["separate_us"] if r else "-"
    for n in CODECS:
        out[f"{n} kernel"] = row.get(f"{n}_fused_kernel", {}).get("one_launch_us", "")
    for k in ("echo4_vs_bf16", "taco_vs_bf16", "echo4_vs_taco"):
        out[k] = row.get(k, "-")
    for n in CODECS:
        out[f"{n} kernel/bf16"] = row.get(f"{n}_fused_kernel_vs_bf16", "")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(RESULTS, "projection_links.json"))
    a = ap.parse_args(argv)
    from taco_jax import codecs as codec_registry
    codecs = {c: codec_registry.get(c) for c in CODECS}
    times, facts = kernel_times()
    kernels = fused_kernels()
    devices = {f["device"] for f in facts.values()}
    versions = {f["jax"] for f in facts.values()}
    if len(devices) != 1 or len(versions) != 1:
        raise SystemExit(f"bench.projection: inputs from different devices or jax versions: "
                         f"{devices}, {versions}")
    taco = codecs["taco"]
    checks = fused.method_check(taco.row_bytes)        # reads the committed results
    fitted = {c["mib"]: c["fitted_link_gbps"] for c in checks if c.get("fitted_link_gbps")}
    rates = links(fitted)
    rows = project_rows(times, codecs, rates, fused_kernels=kernels)
    print_table([flat(r) for r in rows], list(flat(rows[0])))
    print("PROJECTED, not measured (one H200's kernel device times + a link rate); "
          "µs = one launch; c/w = compute / wire µs; sep = separate launches; kernel = the "
          "codec's one-launch fused kernel as it runs today (P = 2)\n")
    two_shot_rows = fused_two_shot_rows(
        two_shot_compute(times, two_shot_loopback(), codecs), codecs, rates)
    print_table([flat_two_shot(r) for r in two_shot_rows], list(flat_two_shot(two_shot_rows[0])))
    print("PROJECTED fused two-shot at P >= 3, not measured: fixed + max(per-device compute, "
          "2 (P-1)/P codes / link) beside a bf16 ring all-reduce (fixed + 2 (P-1)/P bf16 / "
          "link); µs; goal: at P = 8, 64 and 256 MiB")
    payload = {"projected": True, "device": devices.pop(),
               "jax": versions.pop(),
               "commit": env_facts()["commit"],
               "command": " ".join(["python -m bench.projection",
                                    *(sys.argv[1:] if argv is None else argv)]),
               "inputs": facts,
               "parameters": {"fixed_us": fused.FIXED_US, "links_gbps": rates,
                              "sizes_mib": list(SIZES_MIB), "p": list(PS),
                              "wire_bytes_per_value": {c: codecs[c].row_bytes
                                                       / codecs[c].block_size
                                                       for c in CODECS},
                              "bf16_bytes_per_value": ITEMSIZE,
                              "nvls": {"bus_gbps_at_350": NVLS_BUS_GBPS, "gain": NVLS_GAIN,
                                       "from_p": NVLS_MIN_P}},
               "method": __doc__.split("\n\n", 2)[2].strip(),
               "kernel_times_us": {c: {f"{m:g}": t for m, t in sorted(v.items())}
                                   for c, v in times.items()},
               "fused_kernel_per_device_us": {
                   c: {"source": k["source"],
                       **{f"{r['mib']:g}": r["per_device_us"] for r in k["rows"]}}
                   for c, k in kernels.items()},
               "method_check": checks, "rows": rows,
               "fused_two_shot": {"links": list(TWO_SHOT_LINKS),
                                  "goals": {"p": GOAL_P, "mib": list(GOAL_MIB),
                                            "ratio_at_most": TWO_SHOT_GOALS},
                                  "rows": two_shot_rows}}
    write_json(a.out, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
