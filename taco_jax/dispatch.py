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


def compress(x, codec):
    mode = backend_for(codec)
    if mode == "reference":
        return _c.compress_reference(x, codec)
    return _c.compress(x, codec, interpret=mode == "interpret")


def decompress(w, codec, out_dtype):
    mode = backend_for(codec)
    if mode == "reference":
        return _d.decompress_reference(w, codec, out_dtype)
    return _d.decompress(w, codec, out_dtype=out_dtype, interpret=mode == "interpret")


def reduce(recv, own, me, codec):
    mode = backend_for(codec)
    if mode == "reference":
        return _r.reduce_reference(recv, own, me, codec)
    return _r.reduce(recv, own, me, codec, interpret=mode == "interpret")
