"""Run one kernel once at 256 MiB of bf16 input, for a kernel profiler (Nsight Compute):

    ncu -k regex:taco_compress -c 1 --section SpeedOfLight --section WarpStateStats \
        python bench/one_kernel.py compress taco [--tm 8] [--warps 2] [--ieee-rowmath]
        [--roofline]

GPU only (no interpreter): a profiler needs the compiled kernel.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
from taco_jax import codecs  # noqa: E402
from taco_jax.kernels import compress, decompress, tiling as common  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("kernel", choices=("compress", "decompress"))
ap.add_argument("codec", nargs="?", default="taco")
ap.add_argument("--mib", type=int, default=256)
ap.add_argument("--tm", type=int, default=None, help="blocks per tile (default: the library's)")
ap.add_argument("--warps", type=int, default=None, help="default: the library's")
ap.add_argument("--tiles", type=int, default=None,
                help="tiles per program (default: the library's)")
ap.add_argument("--ieee-rowmath", action="store_true", help="KernelConfig(fast_rowmath=False)")
ap.add_argument("--roofline", action="store_true",
                help="first, the benchmark's roofline: XLA f32 x + 1 over --mib MiB")
a = ap.parse_args()
if a.roofline:
    f = jnp.ones(a.mib * (1 << 20) // 4, jnp.float32)
    jax.block_until_ready(jax.jit(lambda v: v + 1)(f))
    del f
c = codecs.get(a.codec)


def config(kernel):
    """The library's default for `kernel`, with the command line's overrides."""
    d = common.KernelConfig.default(c.block_size, kernel)
    return dataclasses.replace(d, blocks_per_program=a.tm or d.blocks_per_program,
                               num_warps=a.warps or d.num_warps,
                               fast_rowmath=not a.ieee_rowmath,
                               tiles_per_program=a.tiles or d.tiles_per_program)


n = a.mib * (1 << 20) // 2 // c.block_size
x = (jax.random.normal(jax.random.key(0), (n, c.block_size)) * 0.02).astype(jnp.bfloat16)
w = jax.block_until_ready(compress.compress(x, c, config("compress")))
if a.kernel == "decompress":
    jax.block_until_ready(decompress.decompress(w, c, jnp.bfloat16, config("decompress")))
print("ok", a)
