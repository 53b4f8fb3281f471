"""Triton kernel tilings per input size, by device time: which KernelConfig suits which size.

    python -m bench.tilings [--kernels compress decompress] [--sizes-mib 16 64 256]
                            [--rounds 2] [--out bench/results/kernels_tilings.json]

Each (kernel, size) is timed under the library default for that size ({}) and alternatives
(tiles per program, blocks per tile, warps), interleaved over `--rounds` so drift shows; the figure is
the fraction of the device-timed roofline (XLA f32 `x + 1`, 256 MiB). A row `x + 1` per
size gives what XLA's own bf16 `x + 1` reaches there (its launch and tail included), the
ceiling a kernel of that size can be read against."""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json

import jax
import jax.numpy as jnp

from bench.common import device_time, env_facts, print_table, write_json
from taco_jax import codecs
from taco_jax.kernels.triton import compress, decompress, tiling

MIB = 1 << 20
CANDIDATES = [{}, {"tiles_per_program": 1}, {"tiles_per_program": 2},
              {"blocks_per_program": 4, "tiles_per_program": 1},
              {"blocks_per_program": 4, "num_warps": 1, "tiles_per_program": 1},
              {"blocks_per_program": 16, "num_warps": 4, "tiles_per_program": 1}]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernels", nargs="+", default=["compress", "decompress"])
    ap.add_argument("--sizes-mib", type=float, nargs="+", default=[16, 64, 256])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--candidates", default=None,
                    help='JSON list of KernelConfig overrides, e.g. \'[{}, {"num_stages": 2}]\' '
                         '({} is the default); default: CANDIDATES')
    ap.add_argument("--out", default="bench/results/kernels_tilings.json")
    a = ap.parse_args(argv)
    candidates = json.loads(a.candidates) if a.candidates else CANDIDATES
    c = codecs.get("taco")
    roof = device_time(lambda v: v + 1, jnp.ones(256 * MIB // 4, jnp.float32))["us"]
    roof_gbs = 2 * 256 * MIB / roof / 1e3
    rows = []
    for rnd, mib, kind in itertools.product(range(a.rounds), a.sizes_mib, a.kernels):
        n = int(mib * MIB) // 2
        x = (jax.random.normal(jax.random.key(0), (n // c.block_size, c.block_size)) * 0.02
             ).astype(jnp.bfloat16)
        w = compress.compress(x, c)
        if kind == a.kernels[0]:     # what XLA's own elementwise op reaches at this size
            t = device_time(lambda v: v + 1, x)
            rows.append({"kernel": "x + 1", "mib": mib, "round": rnd, "config": "xla",
                         "device_us": round(t["us"], 2), "host_us": round(t["host_us"], 2),
                         "device_fraction": round(4 * n / t["us"] / 1e3 / roof_gbs, 3)})
            print(rows[-1], flush=True)
        for over in candidates:
            cfg = dataclasses.replace(tiling.KernelConfig.default(c.block_size, kind, x.shape[0]),
                                      **over)
            if kind == "compress":
                fn, arg, nbytes = (lambda v, cfg=cfg: compress.compress(v, c, cfg)), x, \
                    n * 2 + w.size
            else:
                fn, arg, nbytes = (lambda v, cfg=cfg: decompress.decompress(v, c, jnp.bfloat16,
                                                                            cfg)), w, \
                    w.size + n * 2
            t = device_time(fn, arg)
            rows.append({"kernel": kind, "mib": mib, "round": rnd,
                         "config": ",".join(f"{k}={v}" for k, v in over.items()) or "default",
                         "device_us": round(t["us"], 2), "host_us": round(t["host_us"], 2),
                         "device_fraction": round(nbytes / t["us"] / 1e3 / roof_gbs, 3)})
            print(rows[-1], flush=True)
        write_json(a.out, {**env_facts(), "roofline_device_gbs": roof_gbs, "rows": rows})
    print_table(rows, list(rows[0]))


if __name__ == "__main__":
    main()
