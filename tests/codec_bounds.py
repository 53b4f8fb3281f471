"""Comparing one lossy computation run by two programs: jax.vmap and shard_map, two jits, a
mesh and one device, a test's own call of the codec and the library's.

Their codes agree only up to XLA:CPU's last bits, and those differ between CPUs: a value
that sits on a rounding boundary, or a block whose scale choice is a near tie, can go either
way (one 256-value block of a ring ppermute was seen 0.0064 apart between vmap and the mesh
on another machine). So such pairs are compared within the codec's own error, block by block
in the codec's layout (flattened, zero-padded blocks of `codec.block_size`); bit-equality is
asserted only where the design guarantees it (one program's outputs on every device, codec
"none")."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from taco_jax import codecs

# Two programs' results each lie within the codec's round-trip error of the exact value, so
# they lie within twice it of each other; the margin covers a block whose tie went the other
# way (its error is then the alternative's, of the same size).
FACTOR = 3.0


def blocks(a, block: int, lead: int = 1) -> np.ndarray:
    """a's values as the codec blocks them: each of the first `lead` axes indexes a tensor
    encoded on its own (a device's), flattened and zero-padded -> (tensors, blocks, block)."""
    a = np.asarray(a, np.float64)
    rows = a.reshape(int(np.prod(a.shape[:lead], dtype=int)), -1)
    rows = np.pad(rows, ((0, 0), (0, (-rows.shape[1]) % block)))
    return rows.reshape(rows.shape[0], -1, block)


def block_norms(a, block: int, lead: int = 1) -> np.ndarray:
    return np.linalg.norm(blocks(a, block, lead), axis=-1)


def roundtrip_error(codec: str, x, lead: int = 1) -> float:
    """The codec's worst relative round-trip error over the blocks of x (each of the first
    `lead` axes encoded on its own), ||roundtrip(x) - x|| / ||x|| per block."""
    c = codecs.get(codec)
    x = jnp.asarray(x)
    rt = jax.jit(c.roundtrip)
    for _ in range(lead):
        rt = jax.vmap(rt)
    err = block_norms(np.asarray(rt(x)) - np.asarray(x), c.block_size, lead)
    ref = block_norms(x, c.block_size, lead)
    nz = ref > 0
    return float(np.max(err[nz] / ref[nz])) if nz.any() else 0.0   # zeros decode exactly


def assert_blockwise_close(a, b, scale, tol: float, block: int, lead: int = 1,
                           what: str = "") -> None:
    """Per block: ||a - b|| <= tol * ||scale|| (scale: what the error is relative to, e.g.
    the exact result or the quantized input). A block where scale is zero must agree
    exactly (the codecs decode zeros to zeros). Finite inputs only."""
    assert np.shape(a) == np.shape(b), (np.shape(a), np.shape(b))
    for name, v in (("a", a), ("b", b)):       # a NaN would compare as "not larger": refuse it
        assert np.isfinite(np.asarray(v, np.float64)).all(), f"{what}: {name} is not finite"
    diff = block_norms(np.asarray(a, np.float64) - np.asarray(b, np.float64), block, lead)
    bound = tol * block_norms(scale, block, lead)
    bad = diff > bound
    if bad.any():
        i = np.unravel_index(np.argmax(diff - bound), diff.shape)
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {diff.size} blocks differ by more than "
            f"{tol:.3g} x the reference block's norm; worst block {tuple(map(int, i))}: "
            f"{diff[i]:.3g} > {bound[i]:.3g}")
