"""taco_jax.tuning.calibrate_min_bytes on this machine, all local devices as one "tp" axis:

    python bench/calibrate.py [--sizes-mib 1 4 16 64 256 1024] [--margin 0.97]
                              [--out bench/results/calibrate.json]

Prints the table and the threshold a user would get, and writes them with the device,
versions and commit. On the GPU machine it should agree with bench/collectives.py's
`fresh_ratio` column (same method), and so with collectives.DEFAULT_MIN_BYTES.
"""
from __future__ import annotations

import argparse
import sys

import jax

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
from bench.common import env_facts, write_json  # noqa: E402
from taco_jax import calibrate as tuning  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    ap.add_argument("--codec", default="taco")
    ap.add_argument("--margin", type=float, default=0.97)
    ap.add_argument("--out", default="bench/results/calibrate.json")
    a = ap.parse_args(argv)
    mesh = jax.make_mesh((jax.device_count(),), ("tp",))
    cal = tuning.calibrate_min_bytes(mesh, "tp", codec=a.codec, sizes_mib=a.sizes_mib,
                                     margin=a.margin)
    print(cal.table())
    out = {**env_facts(), "codec": cal.codec, "margin": cal.margin,
           "min_bytes": cal.min_bytes, "never": cal.min_bytes == tuning.NEVER,
           "rows": [{k: round(v, 3) for k, v in r.items()} for r in cal.rows]}
    if a.out:
        write_json(a.out, out)
    return out


if __name__ == "__main__":
    main()
