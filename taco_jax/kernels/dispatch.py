"""The one place that chooses between the Pallas kernels and the jnp references.

The recipe's backend (`taco_jax.config(backend=...)`): "auto" runs the Pallas kernels on
GPU and the references elsewhere; "interpret" runs the kernels through Pallas' interpreter
(CPU tests); "reference" uses jnp everywhere. Codecs without kernels (per-tensor scales,
Echo) always use their references, which XLA fuses."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from taco_jax import recipe
from taco_jax.kernels import compress as _c, decompress as _d, reduce as _r


def backend_for(codec) -> str:
    """'pallas', 'interpret' or 'reference' for this codec on this platform."""
    name = recipe.current().backend
    if not codec.has_kernel or name == "reference":
        return "reference"
    if name == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "reference"
    return name


def compress(x, codec, skip_start=0, skip_rows: int = 0, cfg=None):
    """(rows, B) float → (rows, row_bytes) uint8. Rows [skip_start, skip_start + skip_rows)
    of the output may be left unwritten (the kernel skips them; the reference does not).
    cfg: the kernels' KernelConfig (None: default; references ignore it)."""
    mode = backend_for(codec)
    if mode == "reference":
        return codec.compress_reference(x)
    return _c.compress(x, codec, cfg=cfg, interpret=mode == "interpret",
                       skip_start=skip_start, skip_rows=skip_rows)


def decompress(w, codec, out_dtype=jnp.float32, cfg=None):
    """(rows, row_bytes) uint8 → (rows, B) out_dtype."""
    mode = backend_for(codec)
    if mode == "reference":
        return codec.decompress_reference(w, out_dtype)
    return _d.decompress(w, codec, out_dtype=out_dtype, cfg=cfg, interpret=mode == "interpret")


def reduce(recv, own, me, codec, own_row0=0, cfg=None):
    """The owner's step: compress(own[own_row0:][:n] + Σ_{p ≠ me} decompress(recv[p]))."""
    mode = backend_for(codec)
    if mode == "reference":
        return _r.reduce_reference(recv, own, me, codec, own_row0)
    return _r.reduce(recv, own, me, codec, cfg=cfg, interpret=mode == "interpret",
                     own_row0=own_row0)
