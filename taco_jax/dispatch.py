"""The one place that chooses between the Pallas kernels and the jnp references.

"auto" (default): Pallas-Triton kernels on GPU, references elsewhere. "interpret": the
kernels through Pallas' interpreter (CPU tests). "reference": jnp everywhere. Set with
`use_backend(...)` or the TACO_JAX_BACKEND environment variable. Per-tensor-scale codecs
have no kernel and always use the reference (XLA fuses it)."""
from __future__ import annotations

import contextlib
import os
import threading

import jax
import jax.numpy as jnp

from taco_jax.ops import compress as _c, decompress as _d, reduce as _r

BACKENDS = ("auto", "pallas", "interpret", "reference")
_state = threading.local()


def _requested() -> str:
    name = getattr(_state, "backend", None) or os.environ.get("TACO_JAX_BACKEND", "auto")
    if name not in BACKENDS:
        raise ValueError(f"taco_jax backend {name!r} is not one of {BACKENDS}")
    return name


@contextlib.contextmanager
def use_backend(name: str):
    if name not in BACKENDS:
        raise ValueError(f"taco_jax backend {name!r} is not one of {BACKENDS}")
    old = getattr(_state, "backend", None)
    _state.backend = name
    try:
        yield
    finally:
        _state.backend = old


def backend_for(codec) -> str:
    """'pallas', 'interpret' or 'reference' for this codec on this platform."""
    name = _requested()
    if not getattr(codec, "has_kernel", False) or name == "reference":
        return "reference"
    if name == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "reference"
    return name


def _compress_ref(x, codec):
    """Codecs defined outside codecs.Codec (e.g. Echo) bring their own references."""
    own = getattr(codec, "compress_reference", None)
    return own(x) if own else _c.compress_reference(x, codec)


def _decompress_ref(w, codec, out_dtype=jnp.float32):
    own = getattr(codec, "decompress_reference", None)
    return own(w, out_dtype) if own else _d.decompress_reference(w, codec, out_dtype)


def compress(x, codec, row0: int = 0, n_rows: int | None = None, skip_start=0,
             skip_rows: int = 0, cfg=None):
    """Compress rows [row0, row0 + n_rows) of the (rows, B) array x; output rows
    [skip_start, skip_start + skip_rows) may be left unwritten (kernels skip them).
    cfg: the kernels' KernelConfig (None: default; references ignore it)."""
    mode = backend_for(codec)
    if mode == "reference":
        n = x.shape[0] - row0 if n_rows is None else n_rows
        if row0 < 0 or n < 0 or row0 + n > x.shape[0]:
            raise ValueError(f"compress: window {row0=} n_rows={n} outside {x.shape[0]} rows")
        return _compress_ref(x[row0:row0 + n], codec)
    return _c.compress(x, codec, cfg=cfg, interpret=mode == "interpret", row0=row0,
                       n_rows=n_rows, skip_start=skip_start, skip_rows=skip_rows)


def decompress(w, codec, out_dtype, into=None, row0: int = 0, total_rows: int | None = None,
               cfg=None):
    """Decode w; windowed into rows [row0, …) of a (total_rows, B) buffer (see ops)."""
    mode = backend_for(codec)
    if mode == "reference":
        y = _decompress_ref(w, codec, out_dtype)
        rows_out = into.shape[0] if into is not None else (total_rows or row0 + w.shape[0])
        if row0 < 0 or row0 + w.shape[0] > rows_out:
            raise ValueError(f"decompress: window {row0=} + {w.shape[0]} rows outside "
                             f"{rows_out} rows")
        if into is None and (row0 or total_rows not in (None, w.shape[0])):
            into = jnp.zeros((total_rows or row0 + w.shape[0], y.shape[1]), out_dtype)
        return y if into is None else jax.lax.dynamic_update_slice_in_dim(into, y, row0, 0)
    return _d.decompress(w, codec, out_dtype=out_dtype, cfg=cfg, interpret=mode == "interpret",
                         into=into, row0=row0, total_rows=total_rows)


def reduce(recv, own, me, codec, own_row0=0, cfg=None):
    mode = backend_for(codec)
    if mode == "reference":
        if hasattr(codec, "compress_reference"):
            acc = jax.lax.dynamic_slice_in_dim(own, own_row0, recv.shape[1]).astype(jnp.float32)
            for p in range(recv.shape[0]):
                acc = acc + jnp.where(me == p, 0.0, _decompress_ref(recv[p], codec))
            return _compress_ref(acc, codec)
        return _r.reduce_reference(recv, own, me, codec, own_row0)
    return _r.reduce(recv, own, me, codec, cfg=cfg, interpret=mode == "interpret",
                     own_row0=own_row0)
