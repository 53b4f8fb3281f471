"""Walsh–Hadamard transform of B-element blocks, in the factored form the kernels use.

H_B = H_r ⊗ H_c with r·c = B (Sylvester order). Viewing a block as an r×c matrix X
(row-major), (H_r ⊗ H_c)·vec(X) = vec(H_r X H_c). The kernels compute that as two small
matmuls with a per-block transpose between them, which leaves the coefficients in
transposed order: the wire stores Zᵀ (c×r, row-major). Coefficient order does not change
absmax or quantization; encode and decode only have to agree, and the reference below
defines the order everyone uses. Normalisation: Z = H_r X H_c / sqrt(B) is orthonormal,
so the inverse is the same operation on the transposed layout.
"""
from __future__ import annotations

import functools
import operator

import jax.numpy as jnp
import numpy as np
from jax import lax

MIN_BLOCK, MAX_BLOCK = 32, 512


def check_block_size(block_size: int) -> int:
    try:
        b = operator.index(block_size)          # ints and numpy integers, not 256.0 or "256"
    except TypeError:
        b = None
    if b is None or isinstance(block_size, bool) or b < MIN_BLOCK or b > MAX_BLOCK or b & (b - 1):
        raise ValueError(
            f"block_size={block_size!r} must be a power of two in [{MIN_BLOCK}, {MAX_BLOCK}]")
    return b


def factors(block_size: int) -> tuple[int, int]:
    """(r, c) with r·c = B, r = 2^floor(log2(B)/2): 256 → (16, 16), 512 → (16, 32)."""
    r = 1 << (block_size.bit_length() - 1) // 2
    return r, block_size // r


@functools.lru_cache(maxsize=None)
def sylvester(n: int) -> np.ndarray:
    """Unnormalised Sylvester Hadamard matrix, H[i, j] = (-1)^popcount(i & j)."""
    i = np.arange(n)
    bits = np.bitwise_and(i[:, None], i[None, :])
    pop = np.zeros_like(bits)
    while bits.any():
        pop += bits & 1
        bits >>= 1
    return np.where(pop % 2 == 0, 1.0, -1.0).astype(np.float32)


def forward(x: jnp.ndarray) -> jnp.ndarray:
    """(nb, B) f32 → (nb, B) f32 coefficients in wire order (eq. 8 without α)."""
    nb, b = x.shape
    r, c = factors(b)
    hr, hc = jnp.asarray(sylvester(r)), jnp.asarray(sylvester(c))
    # Scale by 1/B (a power of two: exact) before the ±1 sums, which could otherwise overflow
    # near the fp32 limit; sqrt(B) after restores the orthonormal scale.
    xm = x.reshape(nb, r, c) * np.float32(1 / b)               # (nb, r, c)
    z = jnp.einsum("im,nmk,kj->nji", hr, xm, hc, precision=lax.Precision.HIGHEST)
    return z.reshape(nb, b) * np.float32(np.sqrt(b))           # stored as Zᵀ: (nb, c, r)


def inverse(z: jnp.ndarray) -> jnp.ndarray:
    """Inverse of `forward` (eq. 12): wire-order coefficients → block values."""
    nb, b = z.shape
    r, c = factors(b)
    hr, hc = jnp.asarray(sylvester(r)), jnp.asarray(sylvester(c))
    zt = z.reshape(nb, c, r) * np.float32(1 / b)               # (nb, c, r) = Zᵀ
    x = jnp.einsum("im,njm,jk->nik", hr, zt, hc, precision=lax.Precision.HIGHEST)
    return x.reshape(nb, b) * np.float32(np.sqrt(b))


@functools.lru_cache(maxsize=None)
def wire_matrix(block_size: int) -> np.ndarray:
    """Dense M (B×B, unnormalised) with forward(x) = x @ M / sqrt(B): used by kernels whose
    factors are too small for a tensor-core dot (B < 256)."""
    r, c = factors(block_size)
    h = sylvester(block_size)
    # stored index j*r + m holds Sylvester coefficient m*c + j
    perm = (np.arange(r)[None, :] * c + np.arange(c)[:, None]).reshape(-1)
    return np.ascontiguousarray(h[perm].T)
