"""What the Pallas-Triton kernel tests share (tests/kernels/test_triton_taco.py for TACO's kernels,
tests/kernels/test_triton_echo4.py for echo4's): where the kernels run, the dtypes by name, the ids
of parametrized cases and the set-up of one (codec, block size, dtype) case."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from taco_jax import codecs

# On CPU the kernels run in Pallas' interpreter; on a GPU the compiled kernels.
INTERPRET = jax.default_backend() != "gpu"
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}


def case_id(v) -> str:
    """A parametrized case's id for one value: block sizes as "B128", the rest as written."""
    return f"B{v}" if isinstance(v, int) else str(v)


def rows_over_tiles(tile: int) -> int:
    """Two and a half tiles of `tile` rows plus one row: full tiles, a partial tile, masking."""
    return 2 * tile + tile // 2 + 1


def case(name: str, b: int, dt: str, rows: Callable[..., np.ndarray], n: int,
         seed: int = 0):
    """-> (codec, x) of one case: codec `name` at block size b, and the test's (n, b) rows
    `rows(n, b, dt, seed)` (float32) cast to the dtype named dt."""
    return (codecs.get(name, block_size=b),
            jnp.asarray(rows(n, b, dt, seed)).astype(DTYPES[dt]))
