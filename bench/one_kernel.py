"""Run one kernel once at 256 MiB of bf16 input, for a kernel profiler (Nsight Compute):

    ncu -k regex:taco_compress -c 1 --section SpeedOfLight --section WarpStateStats \
        python bench/one_kernel.py compress taco [--tm 16] [--warps 4] [--fast-rowmath]
"""
from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
from taco_jax import codecs  # noqa: E402
from taco_jax.ops import common, compress, decompress  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("kernel", choices=("compress", "decompress"))
ap.add_argument("codec", nargs="?", default="taco")
ap.add_argument("--mib", type=int, default=256)
ap.add_argument("--tm", type=int, default=None)
ap.add_argument("--warps", type=int, default=4)
ap.add_argument("--fast-rowmath", action="store_true", help="KernelConfig(fast_rowmath=True)")
a = ap.parse_args()
c = codecs.get(a.codec)
cfg = common.KernelConfig(a.tm or common.KernelConfig.default(c.block_size).blocks_per_program,
                          a.warps, fast_rowmath=a.fast_rowmath)
n = a.mib * (1 << 20) // 2 // c.block_size
x = (jax.random.normal(jax.random.key(0), (n, c.block_size)) * 0.02).astype(jnp.bfloat16)
w = jax.block_until_ready(compress.compress(x, c, cfg))
if a.kernel == "decompress":
    jax.block_until_ready(decompress.decompress(w, c, jnp.bfloat16, cfg))
print("ok", a)
