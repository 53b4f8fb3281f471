"""Run one kernel once on --mib MiB (default 256) of bf16 input, for a kernel profiler
(Nsight Compute):

    ncu -k regex:taco_compress -c 1 --section SpeedOfLight --section WarpStateStats \
        python -m bench.one_kernel compress taco [--impl triton|mosaic] [--mib 16] [--tm 8]
        [--warps 2] [--tiles 4] [--ieee-rowmath] [--row-masks] [--ctas-per-sm 2] [--steps 2]
        [--parts 1] [--tma-store] [--roofline]

Kernel names: taco_compress / taco_decompress (Triton), taco_compress_mosaic… /
taco_decompress_mosaic… (Mosaic GPU); for the 4-bit codecs (`compress echo4`, Triton only)
echo4_compress / echo4_decompress, with the variants each kernel runs
(`echo4.default_config`). GPU only (no interpreter): a profiler needs the compiled kernel. --tm/--warps/--tiles/--ieee-rowmath/--row-masks set the Triton
KernelConfig (default: the library's for that size), --ctas-per-sm/--steps/--parts/
--tma-store the Mosaic one (default: the library's).
"""
from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp

from taco_jax import codecs
from taco_jax.kernels import mosaic
from taco_jax.kernels.triton import compress, decompress, echo4, tiling as common


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kernel", choices=("compress", "decompress"))
    ap.add_argument("codec", nargs="?", default="taco")
    ap.add_argument("--impl", choices=("triton", "mosaic"), default="triton")
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--tm", type=int, default=None, help="Triton: blocks per tile")
    ap.add_argument("--warps", type=int, default=None, help="Triton: warps per program")
    ap.add_argument("--tiles", type=int, default=None, help="Triton: tiles per program")
    ap.add_argument("--ieee-rowmath", action="store_true", help="Triton: fast_rowmath=False")
    ap.add_argument("--row-masks", action="store_true",
                    help="Triton: row masks on every load and store (row_masks=True)")
    ap.add_argument("--ctas-per-sm", type=int, default=None, help="Mosaic: blocks per SM")
    ap.add_argument("--steps", type=int, default=None, help="Mosaic: input tiles in flight")
    ap.add_argument("--parts", type=int, default=None, help="Mosaic: column passes (1, 2)")
    ap.add_argument("--tma-store", action="store_true", help="Mosaic: outputs through TMA")
    ap.add_argument("--roofline", action="store_true",
                    help="first, the benchmark's roofline: XLA f32 x + 1 over --mib MiB")
    a = ap.parse_args(argv)
    if a.roofline:
        f = jnp.ones(a.mib * (1 << 20) // 4, jnp.float32)
        jax.block_until_ready(jax.jit(lambda v: v + 1)(f))
        del f
    c = codecs.get(a.codec)

    n = a.mib * (1 << 20) // 2 // c.block_size

    four_bit = echo4.covers(c)
    if four_bit and a.impl != "triton":
        ap.error(f"{a.codec}: the 4-bit kernels are Triton only, not --impl {a.impl}")

    def triton_cfg(kernel):
        d = (echo4.default_config(c.block_size, kernel, n) if four_bit
             else common.KernelConfig.default(c.block_size, kernel, n))
        return dataclasses.replace(d, blocks_per_program=a.tm or d.blocks_per_program,
                                   num_warps=a.warps or d.num_warps,
                                   fast_rowmath=not a.ieee_rowmath,
                                   row_masks=a.row_masks or None,
                                   tiles_per_program=a.tiles or d.tiles_per_program)

    d = mosaic.MosaicConfig()
    mcfg = mosaic.MosaicConfig(ctas_per_sm=a.ctas_per_sm or d.ctas_per_sm,
                               steps=a.steps or d.steps, parts=a.parts or d.parts,
                               tma_store=a.tma_store or d.tma_store)
    x = (jax.random.normal(jax.random.key(0), (n, c.block_size)) * 0.02).astype(jnp.bfloat16)
    if a.impl == "mosaic":
        w = jax.block_until_ready(mosaic.compress(x, c, mcfg) if a.kernel == "compress"
                                  else compress.compress(x, c))
        if a.kernel == "decompress":
            jax.block_until_ready(mosaic.decompress(w, c, jnp.bfloat16, mcfg))
    else:
        comp, decomp = ((echo4.compress, echo4.decompress) if four_bit
                        else (compress.compress, decompress.decompress))
        w = jax.block_until_ready(comp(x, c, triton_cfg("compress")))
        if a.kernel == "decompress":
            jax.block_until_ready(decomp(w, c, jnp.bfloat16, triton_cfg("decompress")))
    print("ok", a)


if __name__ == "__main__":
    main()
