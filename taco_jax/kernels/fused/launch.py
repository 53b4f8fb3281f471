"""Launching a fused kernel body: its scratch list (buffers, barriers, semaphores; None
where a configuration does not use one; a tuple for the tile codec's operand copies)
flattened for `plgpu.kernel` and handed back to the body one argument per entry, and the
`plgpu.kernel` call over the peers' programs."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from taco_jax.kernels.tile_codec import BLOCK, LINE, ROWS
from taco_jax.kernels.mosaic import registers


def scratch_types(scratch) -> list:
    """The scratch list without its Nones, the operand copies spliced in."""
    out = []
    for s in scratch:
        out += list(s) if isinstance(s, tuple) else [] if s is None else [s]
    return out


def scratch_args(scratch, refs) -> list:
    """The kernel's scratch refs → one argument per scratch entry."""
    it = iter(refs)
    return [tuple(next(it) for _ in s) if isinstance(s, tuple) else
            None if s is None else next(it) for s in scratch]


def buffer_bytes(scratch) -> int:
    """The shared-memory buffers of a scratch list (semaphores left out), each rounded up to
    1 KiB."""
    return sum(-(-int(np.prod(s.shape)) * jnp.dtype(s.dtype).itemsize // 1024) * 1024
               for s in scratch_types(scratch) if hasattr(s, "shape"))


def call(kernel_body, blocks, tiles, out_dtype, peers, cfg, scratch, mat, **mesh):
    """Launch kernel_body(x, consts, y, recv, *scratch refs, …) over `peers.grid()` programs
    (`mesh`: plgpu.kernel's warpgroup arguments): returns y, (…, n_rows, 256)."""
    n_rows = blocks.shape[-2]
    n_tiles = n_rows // ROWS
    lead = blocks.shape[:-2]
    lines = ROWS * tiles.row_bytes // LINE

    def struct(shape, dtype):
        if mat is None:
            return jax.ShapeDtypeStruct(shape, dtype)
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)

    out_type = (struct((*lead, n_rows, BLOCK), out_dtype),
                struct((*lead, peers.p, n_tiles * lines, LINE), jnp.uint8))   # receive buffers
    operands = [a for a, _ in tiles.operands(blocks.dtype)]
    n_ops = len(operands)

    def body(x, *refs):
        consts, (y, recv), refs = refs[:n_ops], refs[n_ops:n_ops + 2], refs[n_ops + 2:]
        kernel_body(x, consts, y, recv, *scratch_args(scratch, refs), peers=peers, tiles=tiles,
                    n_tiles=n_tiles, out_dtype=out_dtype, cfg=cfg)

    kernel = plgpu.kernel(
        body, out_type=out_type, scratch_types=scratch_types(scratch),
        grid=(peers.grid(),), grid_names=("prog",), kernel_name="taco_fused_allreduce",
        compiler_params=plgpu.CompilerParams(lowering_semantics=registers.LANE), **mesh)
    y, _ = kernel(blocks, *operands)
    return y
