"""Summarize an Nsight Compute source-page CSV (SASS lines) of one kernel:

    python -m bench.ncu_source bench/results/logs/s5/ncu_src_compress.csv.gz \
        [--label compress-taco] [--out bench/results/ncu_src.json] [--top 25]

The CSV is what `bash bench/gpu_run.sh ncu_src` brings back (`ncu -i REPORT --page source
--csv --print-source sass`). Prints and writes: warp instructions per warp, the share of
stall samples and of executed instructions per opcode, the stall reasons, the global and
shared memory instructions with their access size and excess sectors, and the top SASS
lines by stall samples. Several CSVs (e.g. the default kernel and a variant) are put side by
side, one entry each.
"""
from __future__ import annotations

import argparse
import collections
import csv
import gzip
import json
import os
import sys
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def _num(v: str) -> float:
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return 0.0


def read_sass(path: str) -> list[dict]:
    """Rows of the CSV's SASS table as dicts (the first line names the kernel)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        lines = list(csv.reader(f))
    start = next((i for i, r in enumerate(lines) if r[:2] == ["Address", "Source"]), None)
    if start is None:
        raise ValueError(f"{path}: no SASS table (a row starting Address,Source) in the CSV")
    hdr = lines[start]
    return [dict(zip(hdr, r)) for r in lines[start + 1:] if len(r) == len(hdr)]


def opcode(source: str) -> str:
    parts = source.split()
    if parts and parts[0].startswith("@"):   # predicate
        parts = parts[1:]
    return parts[0].split(".")[0] if parts else "?"


def summarize(rows: list[dict], top: int = 25) -> dict:
    samples = sum(_num(r[SAMPLES]) for r in rows) or 1.0
    executed = sum(_num(r[EXECUTED]) for r in rows) or 1.0
    per_warp = max((_num(r[EXECUTED]) for r in rows), default=0.0)
    stalls = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    by_op_s, by_op_i = collections.Counter(), collections.Counter()
    for r in rows:
        by_op_s[opcode(r["Source"])] += _num(r[SAMPLES])
        by_op_i[opcode(r["Source"])] += _num(r[EXECUTED])
    memory = [{"sass": r["Source"].strip(), "executed": _num(r[EXECUTED]),
               "access_bits": r.get("Access Size"),
               "l2_sectors": _num(r.get("L2 Theoretical Sectors Global", "0")),
               "l2_sectors_ideal": _num(r.get("L2 Theoretical Sectors Global Ideal", "0"))}
              for r in rows if opcode(r["Source"]) in ("LDG", "STG", "LDS", "STS", "LDSM",
                                                        "STSM")]
    return {
        # straight-line kernels execute each line once per warp: the max count is the warps
        "sass_lines": len(rows),
        "warps": per_warp,
        "warp_instructions_per_warp": round(executed / per_warp, 1) if per_warp else None,
        "stall_reasons": {k[6:]: round(sum(_num(r[k]) for r in rows) / samples, 4)
                          for k in sorted(stalls, key=lambda k: -sum(_num(r[k]) for r in rows))
                          if sum(_num(r[k]) for r in rows)},
        "opcodes": [{"opcode": o, "stall_share": round(v / samples, 4),
                     "instruction_share": round(by_op_i[o] / executed, 4)}
                    for o, v in by_op_s.most_common()],
        "memory_instructions": memory,
        "top_lines": [{"sass": r["Source"].strip(), "stall_share": round(_num(r[SAMPLES])
                                                                         / samples, 4),
                       "top_reasons": sorted(stalls, key=lambda k: -_num(r[k]))[:2]}
                      for r in sorted(rows, key=lambda r: -_num(r[SAMPLES]))[:top]],
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", nargs="+")
    ap.add_argument("--label", nargs="*", default=None, help="one per CSV (default: file name)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--device", default=None, help="the GPU the CSVs were profiled on")
    ap.add_argument("--jax", default=None, help="its jax version")
    ap.add_argument("--commit", default=os.environ.get("GIT_COMMIT"),
                    help="the profiled code (default $GIT_COMMIT)")
    a = ap.parse_args(argv)
    labels = a.label or [Path(p).name.split(".")[0] for p in a.csv]
    if len(labels) != len(a.csv):
        ap.error(f"{len(labels)} labels for {len(a.csv)} CSVs")
    out = {"device": a.device, "jax": a.jax, "commit": a.commit, "kernels": []}
    for label, path in zip(labels, a.csv):
        s = {"label": label, "csv": path, **summarize(read_sass(path), a.top)}
        out["kernels"].append(s)
        print(f"\n== {label}: {s['warp_instructions_per_warp']} warp instructions per warp, "
              f"{s['sass_lines']} SASS lines")
        print("stall reasons:", ", ".join(f"{k} {v:.1%}" for k, v in
                                          list(s["stall_reasons"].items())[:8]))
        print(f"{'opcode':<12}{'stalls':>8}{'instr':>8}")
        for o in s["opcodes"][:15]:
            print(f"{o['opcode']:<12}{o['stall_share']:>8.1%}{o['instruction_share']:>8.1%}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1))
        print(f"wrote {a.out}")
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
