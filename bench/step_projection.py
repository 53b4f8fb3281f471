"""Projected training step on P GPUs, from tensor-parallel steps emulated on one GPU: the
per-device compute of the emulated step plus each call site's all-reduce on P GPUs.
Arithmetic on measured JSON only; every figure it prints or writes is a **projection**.

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
projected step of a variant at P GPUs and a link rate is C(P) plus, for every call site,
its all-reduces per step (a psum's forward, a pvary's backward) times one all-reduce of its
bytes on P GPUs, in series with the compute (a tensor-parallel step waits for each):

  * plain (bf16): P = 2, the 2×H200 lax.psum measured (collectives.json, interpolated
    linearly by bytes); P ≥ 3, the ring model of bench.projection: fixed + 2 (P − 1)/P ·
    bytes / link;
  * compressed over the xla transport: P = 2, the 2×H200 taco psum measured with its
    compressed path forced (collectives.json "compressed_us", by bytes); else its model
    (bench.projection.two_shot at this site's size: 2 fixed + separate kernels + wire);
  * compressed over the fused transport: fixed + max(per-device compute, wire / link), the
    compute the codec's fused kernel's loopback time per device (bench.projection
    .fused_compute: P = 2 the one-shot loopback, P ≥ 3 the one-launch two-shot's, else its
    modelled separate kernels), interpolated by bytes; wire the codec's bytes of the tensor
    (one-shot at P = 2) or 2 (P − 1)/P of them (two-shot).

A variant is priced on the sites its own emulated row traced (compressed or plain, over
which transport); where that row failed (a transport this GPU lacks under jax.vmap), on the
"none" row's sites, each taken as compressed with the variant's codec and transport (said
per row). fixed = bench.fused.FIXED_US, links 350 and 250 GB/s. The method is checked on
what two H200s measured (train_step.json, TP = 2): the bf16 and taco-over-xla steps
projected from the emulated TP2 rows, error = projected / measured − 1. Goals reported, not
enforced: 350m with fused taco at least 1.15× bf16's projected step at TP2 and 1.5× at
TP8, at both links.
"""
from __future__ import annotations

import argparse
import os
import sys

from bench import fused, projection
from bench.common import env_facts, load_rows_doc, print_table, write_json

RESULTS = projection.RESULTS
MIB = 1 << 20
INPUTS = {"emulated": "train_step_emulated.json", "collectives": "collectives.json",
          "kernels": "kernels.json", "measured_tp2": "train_step.json"}
EMULATED_CMD = ("python -m bench.train_step --presets 350m small comm_heavy --mesh 1,1,1 "
                "--emulate-tp 2 4 8 --variants none taco:xla taco:fused echo4:fused --steps 10"
                " (bash bench/gpu_run.sh train_step_emulated, on one GPU)")
LINKS = {"nvlink": fused.LINK_GBPS, "nvlink_measured": fused.MEASURED_GBPS}
ALLREDUCE_OPS = ("psum", "pvary", "psum_with_feedback", "pvary_with_feedback")
# (preset, variant) → {P: the least speedup over bf16's projected step}
GOALS = {("350m", "taco:fused"): {2: 1.15, 8: 1.5}}


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


def facts(docs: dict) -> dict:
    return {k: {"file": INPUTS[k], **{f: d.get(f) for f in
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

    def __call__(self, site: dict, p: int, gbps: float) -> tuple[float, str]:
        b = site["bytes"]
        if not site["compressed"]:
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


def step_ms(sites: list[dict], compute: float, prices: Prices, p: int, gbps: float
            ) -> tuple[float, list[dict]]:
    """(communication ms per step, per site: its all-reduce's µs and how it was priced)."""
    comm, detail = 0.0, []
    for s in allreduce_sites(sites):
        us, how = prices(s, p, gbps)
        comm += s["allreduces_per_step"] * us / 1e3
        detail.append({"op": s["op"], "shape": s["shape"], "bytes": s["bytes"],
                       "allreduces_per_step": s["allreduces_per_step"],
                       "compressed": s["compressed"], "codec": s["codec"],
                       "transport": s["transport"], "allreduce_us": round(us, 2),
                       "priced_by": how})
    return comm, detail


def _variant_route(row: dict) -> tuple[str, str]:
    """(codec, transport) a variant row asks for: its TP codec, its named transport (the
    default taken as the xla transport)."""
    t = row.get("transport") or "default"
    return row.get("codec_tp", "none"), "xla" if t in ("default", "auto") else t


def project(docs: dict, prices: Prices, hbm_gbps: float, links: dict = LINKS
            ) -> tuple[list[dict], list[dict], list[dict]]:
    """(compute per (preset, P), projected rows, gaps) from the emulated rows."""
    rows_in = docs["emulated"]["rows"]
    groups: dict = {}
    for r in rows_in:
        groups.setdefault((r["preset"], r["emulate_tp"]), []).append(r)
    computes, out, gaps = [], [], []
    for (preset, n), rows in groups.items():
        none = next((r for r in rows if r.get("codec_tp") == "none" and not r.get("error")
                     and r.get("step_ms")), None)
        if none is None:
            gaps.append({"preset": preset, "p": n, "why": "no emulated none row"})
            continue
        c = compute_ms(none, hbm_gbps)
        computes.append(c)
        variants = [("bf16", none)] + [(r["variant"], r) for r in rows
                                        if r.get("codec_tp") != "none"]
        for link, gbps in links.items():
            base = None
            for name, r in variants:
                codec, transport = _variant_route(r)
                sites, source = variant_sites(r, none, codec, transport)
                try:
                    comm, detail = step_ms(sites, c["compute_ms_per_device"], prices, n, gbps)
                except ValueError as e:
                    gaps.append({"preset": preset, "p": n, "variant": name, "link": link,
                                 "why": str(e)})
                    continue
                total = c["compute_ms_per_device"] + comm
                base = total if name == "bf16" else base
                row = {"projection": "projected step on P GPUs: per-device compute of the "
                                     "emulated step + its all-reduces on P GPUs",
                       "preset": preset, "p": n, "link": link, "link_gbps": gbps,
                       "variant": name, "codec": codec, "transport": transport,
                       "sites_from": source,
                       "compute_ms": c["compute_ms_per_device"], "comm_ms": round(comm, 3),
                       "projected_ms": round(total, 3),
                       "speedup_vs_bf16": round(base / total, 3) if base else None,
                       "emulated_step_ms": r.get("step_ms"),
                       "emulated_at": str(r.get("measured_at")
                                          or docs["emulated"].get("commit"))[:7],
                       "emulated_added_ms": r.get("added_ms"),
                       "emulated_error": r.get("error"), "sites": detail}
                goal = GOALS.get((preset, name), {}).get(n)
                if goal is not None and row["speedup_vs_bf16"] is not None:
                    row["goal_speedup"] = goal
                    row["meets_goal"] = row["speedup_vs_bf16"] >= goal
                out.append(row)
    return computes, out, gaps


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
                     and r.get("codec_tp") == "none" and not r.get("error")), None)
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
def flat(r: dict) -> dict:
    goal = r.get("goal_speedup")
    return {"preset": r["preset"], "P": r["p"], "GB/s": r["link_gbps"], "variant": r["variant"],
            "compute ms": r["compute_ms"], "comm ms": r["comm_ms"],
            "projected ms": r["projected_ms"], "x bf16": r["speedup_vs_bf16"],
            "emulated ms": r["emulated_step_ms"] or "-",
            "goal": "" if goal is None else f">= {goal} "
                    + ("met" if r["meets_goal"] else "not met")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=RESULTS, help="the directory of the input JSON")
    ap.add_argument("--out", default=os.path.join(RESULTS, "step_projection.json"))
    ap.add_argument("--any-platform", action="store_true",
                    help="accept an emulated file measured off the GPU (tests)")
    a = ap.parse_args(argv)
    docs = load_inputs(a.results, a.any_platform)
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
    computes, rows, gaps = project(docs, prices, hbm)
    checks = method_check(docs, prices, hbm)
    if rows:
        print_table([flat(r) for r in rows], list(flat(rows[0])))
    print("PROJECTED, not measured: per-device compute of the emulated step + its "
          "all-reduces on P GPUs (P = 2 bf16 and taco:xla: 2xH200 measured psums; fused: "
          "loopback compute + wire / link; P >= 3 bf16: ring model)\n")
    if checks:
        print_table(checks, ["preset", "variant", "compute_ms", "comm_ms", "projected_ms",
                             "measured_2gpu_ms", "error"])
        print("method check: TP2 projected from the emulated rows vs two H200s measured")
    for g in gaps:
        print(f"not projected: {g}")
    emu = docs["emulated"]
    payload = {"projected": True, "device": emu.get("device"), "jax": emu.get("jax"),
               "commit": env_facts()["commit"],
               "inputs": {**facts(docs), **{f"projection:{k}": v for k, v in pfacts.items()}},
               "parameters": {"fixed_us": fused.FIXED_US, "links_gbps": LINKS,
                              "hbm_gbps": hbm, "goals": {f"{p}/{v}": g for (p, v), g
                                                         in GOALS.items()}},
               "model": __doc__.split("\n\n", 2)[2].strip(),
               "fused_compute_us": {c: {str(p): {"compute": t["compute"],
                                                 "source": t["source"],
                                                 **{f"{m:g}": us for m, us in
                                                    sorted(t["mib_us"].items())}}
                                        for p, t in sorted(v.items())}
                                    for c, v in fc.items()},
               "compute": computes, "rows": rows, "method_check": checks, "gaps": gaps}
    write_json(a.out, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
