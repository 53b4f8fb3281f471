"""Nsight Compute kernel durations (gpu_run.sh ncu_time) → JSON, with the fractions of the
roofline they imply:

    python -m bench.ncu_time LOG [LOG ...] --label L [L ...] --commit C [C ...] \
        --device D --jax V --out bench/results/ncu_time.json

Each LOG is `ncu --csv --metrics gpu__time_duration.sum,…` over `python -m
bench.one_kernel decompress taco --roofline [--impl mosaic]` (256 MiB): the roofline's
`x + 1` (loop_add_fusion), compress and decompress, Triton (taco_compress,
taco_decompress) or Mosaic GPU (taco_compress_mosaic…, taco_decompress_mosaic…) kernels.
Effective bytes as in bench/kernels.py: x + 1 reads and writes 256 MiB of f32; compress and
decompress move 256 MiB of bf16 plus the 264-byte wire rows.
"""
from __future__ import annotations

import argparse
import csv

from bench.common import write_json

MIB = 1 << 20
BYTES = {"loop_add_fusion": 2 * 256 * MIB,
         "taco_compress": 256 * MIB + 256 * MIB // 2 // 256 * 264,
         "taco_decompress": 256 * MIB + 256 * MIB // 2 // 256 * 264}


def kernel_bytes(name: str) -> int | None:
    """Effective bytes of a kernel by name: an exact BYTES key, or a Mosaic GPU kernel
    named after one (taco_compress_mosaic_mosaic_gpu_kernel)."""
    if name in BYTES:
        return BYTES[name]
    for key in ("taco_decompress", "taco_compress"):
        if name.startswith(key + "_mosaic"):
            return BYTES[key]
    return None


def durations_ns(path: str) -> dict:
    """{kernel name: gpu__time_duration in ns} for the kernels `kernel_bytes` knows."""
    with open(path) as f:
        lines = [l for l in f if l.startswith('"')]
    out = {}
    for r in csv.DictReader(lines):
        if kernel_bytes(r["Kernel Name"]) and r["Metric Name"] == "gpu__time_duration.sum":
            out[r["Kernel Name"]] = float(r["Metric Value"].replace(",", ""))
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--label", nargs="+", required=True)
    ap.add_argument("--commit", nargs="+", required=True)
    ap.add_argument("--device", required=True)
    ap.add_argument("--jax", required=True)
    ap.add_argument("--out", default="bench/results/ncu_time.json")
    a = ap.parse_args(argv)
    if not len(a.logs) == len(a.label) == len(a.commit):
        ap.error("one --label and one --commit per log")
    rows = []
    for log, label, commit in zip(a.logs, a.label, a.commit):
        ns = durations_ns(log)
        roof = BYTES["loop_add_fusion"] / ns["loop_add_fusion"]          # bytes/ns = GB/s
        for k, t in ns.items():
            gbs = kernel_bytes(k) / t
            rows.append({"run": label, "commit": commit, "kernel": k, "us": round(t / 1e3, 2),
                         "effective_gbs": round(gbs, 1),
                         "fraction_of_roofline": round(gbs / roof, 3)})
            print(rows[-1])
    out = {"device": a.device, "jax": a.jax, "tool": "ncu --clock-control none",
           "rows": rows}
    write_json(a.out, out)
    return out


if __name__ == "__main__":
    main()
