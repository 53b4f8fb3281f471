"""bench.gemm_table on CPU: the per-device shapes of Megatron's GEMMs at TP = P, and the
chunked GEMM (P pieces of the tokens) equal to the whole one."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import gemm_table, step_projection

SHAPE = {"layers": 24, "d_model": 1024, "ff": 4096, "vocab": 32768, "seq_len": 1024,
         "tokens": 16 * 1024}


def test_shapes_at_tp8():
    got = {(s["gemm"], s["pass"]): (s["m"], s["k"], s["n"], s["split"])
           for s in gemm_table.shapes(SHAPE, 8)}
    t = SHAPE["tokens"]
    assert got["qkv", "fwd"] == (t, 1024, 384, "m")            # column-parallel: N / P
    assert got["qkv", "dx"] == (t, 384, 1024, "m")
    assert got["qkv", "dw"] == (1024, t, 384, "k")             # the tokens contracted
    assert got["fc2", "fwd"] == (t, 512, 1024, "m")            # row-parallel: K / P
    assert got["head", "fwd"] == (t, 1024, 4096, "m")
    flops = step_projection.matmul_flops(SHAPE, 8)["gemm_fwd"]
    assert all(2 * m * k * n == flops[g] for (g, _), (m, k, n, _) in got.items())
    assert {g for g, _ in got} == set(step_projection.gemms(SHAPE))


@pytest.mark.parametrize("split,a_shape,b_shape", [("m", (64, 32), (32, 16)),
                                                   ("k", (16, 64), (64, 24))])
def test_chunked_equals_whole(split, a_shape, b_shape):
    a = jax.random.normal(jax.random.key(0), a_shape, jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), b_shape, jnp.bfloat16)
    whole = jax.jit(gemm_table.matmul(split, 1))((a, b))
    chunked = jax.jit(gemm_table.matmul(split, 4))((a, b))
    np.testing.assert_allclose(np.float32(chunked), np.float32(whole), rtol=2e-2, atol=2e-2)
