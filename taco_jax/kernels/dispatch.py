"""The one place that chooses how each codec kernel runs.

Backend — the recipe's `taco_jax.config(backend=...)`: "auto" runs the GPU kernels on GPU
and the jnp references elsewhere; "pallas" the GPU kernels; "interpret" the Pallas-Triton
kernels through Pallas' interpreter (CPU tests); "reference" jnp everywhere. Codecs without
kernels (per-tensor scales, tah4) always use their references, which XLA fuses.

Kernels by codec family: each codec names its family's provider (`Codec.kernels`,
`providers`: the TACO codecs' compress, decompress, reduce and decode_sum, Triton or
Mosaic; Echo's 4-bit codecs', Triton only). `compress_feedback` (compress of x − r and the
new residual in one pass) runs its family's kernel where it has one (Echo's), else
compress then decompress.

Implementation — per kernel, on GPU: "triton" (Pallas-Triton: every codec with kernels,
block size and dtype), "mosaic" (Pallas Mosaic GPU: the B = 256 Hadamard codecs with FP8
codes, bf16/f16 data, rows a multiple of 64; the provider's `mosaic_unsupported` says what
else) or "auto": `DEFAULT_IMPL[kernel]` where that covers the call, else Triton.
`DEFAULT_IMPL` is the faster of the two per kernel, measured side by side on one H200 by
`python -m bench.kernels` (bench/results/kernels.json). Choose per call (`impl=`), for
code traced inside `kernel_impl(compress="mosaic", ...)`, or with the environment variable
TACO_JAX_KERNEL_IMPL="compress=mosaic,decompress=triton". Mosaic GPU kernels do not run
in the interpreter: asking for them there is an error. A Triton call whose wire would be
2–4 GiB runs the references instead (`triton_offsets_wrap`), counted over the whole batch
under `jax.vmap` (`_per_batch`). Where `jax.experimental.pallas.triton` is missing
(`providers.triton_missing`) the Mosaic kernels run where they cover a call and the
references elsewhere, whatever the implementation asked for.
"""
from __future__ import annotations

import contextlib
import math
import os
import threading
from typing import Iterator

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

from taco_jax import recipe
from taco_jax._scoped import ScopedStack
from taco_jax.kernels import references
from taco_jax.kernels.providers import triton_missing

IMPLS = ("auto", "triton", "mosaic")
# the kernels with a Triton and a Mosaic implementation to choose from (`kernel_impl`)
IMPL_KERNELS = ("compress", "decompress", "reduce")
# What "auto" picks on GPU where Mosaic covers the call. Device time on one H200
# (bench/results/kernels.json), taco, bf16, µs Triton / Mosaic: compress 9.56 / 12.07 at
# 16 MiB, 29.62 / 33.62 at 64, 100.96 / 119.35 at 256, 387.11 / 464.56 at 1024;
# decompress 8.51 / 9.61, 27.66 / 30.23, 102.91 / 110.69, 403.59 / 434.64. Triton is
# faster for both at every size. There is no Mosaic reduce.
DEFAULT_IMPL = {"compress": "triton", "decompress": "triton", "reduce": "triton"}

_state = threading.local()          # the batch factor under jax.vmap (`_per_batch`)
_impls = ScopedStack()              # `kernel_impl`'s choices


def _check_impls(impls: dict) -> dict:
    for k, v in impls.items():
        if k not in IMPL_KERNELS:
            raise ValueError(f"kernel_impl: unknown kernel {k!r} (kernels: {IMPL_KERNELS})")
        if v not in IMPLS:
            raise ValueError(f"kernel_impl: {k}={v!r} is not one of {IMPLS}")
    return impls


def _env_impls() -> dict:
    text = os.environ.get("TACO_JAX_KERNEL_IMPL", "").strip()
    if not text:
        return {}
    pairs = [p.split("=", 1) for p in text.split(",") if p.strip()]
    if any(len(p) != 2 for p in pairs):
        raise ValueError(f"TACO_JAX_KERNEL_IMPL={text!r}: expected kernel=impl[,kernel=impl]")
    return _check_impls({k.strip(): v.strip() for k, v in pairs})


def current_impls() -> dict:
    """kernel → implementation in effect here (innermost `kernel_impl`, else the
    environment, else "auto")."""
    return _impls.top() or {**{k: "auto" for k in IMPL_KERNELS}, **_env_impls()}


@contextlib.contextmanager
def kernel_impl(**impls: str) -> Iterator[dict]:
    """Choose implementations (compress=, decompress=, reduce=) for the code traced inside.
    A jitted function traced earlier keeps the choice it was traced with."""
    merged = {**current_impls(), **_check_impls(impls)}
    with _impls.pushed(merged):
        yield merged


def backend_for(codec) -> str:
    """'pallas', 'interpret' or 'reference' for this codec on this platform."""
    name = recipe.current().backend
    if codec.kernels is None or name == "reference":
        return "reference"
    if name == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "reference"
    return name


# Pallas-Triton addresses a ref with int32 element offsets unless the array is larger than
# 2^32 bytes (jax's Triton lowering, `_compute_offsets_from_indices`, jax 0.11 and 0.12), so
# in a byte array of more than 2^31 and at most 2^32 bytes the offsets past 2^31 wrap and the
# kernel reads and writes the wrong bytes: a wire of 2–4 GiB (taco: 2.1–4.2 · 10^9 values
# in one call, echo4 3.8–7.6 · 10^9). Every other operand of these kernels is 2 or 4 bytes
# wide and stays below 2^31 elements while at most 2^32 bytes. Such calls run the references.
def triton_offsets_wrap(wire_bytes: int) -> bool:
    """Would a Triton kernel over a uint8 wire of `wire_bytes` address it wrongly? Traced
    under `jax.vmap` (`_per_batch`), the wire is counted over the whole batch."""
    return 2 ** 31 < wire_bytes * (getattr(_state, "batch", None) or 1) <= 2 ** 32


# Under jax.vmap a kernel call is traced with one batch element's shapes, but Pallas batches
# the call into one kernel over the whole batch, which the offsets above then address: the
# size that matters is the batch's. custom_vmap hands a rule the batch size; the rule traces
# the call again under jax.vmap with the batch factor set (`_state.batch`, read by
# triton_offsets_wrap), itself inside a call with the same rule, so an enclosing jax.vmap
# multiplies its size in too. Calls made while the factor is set (compress_feedback's
# compress and decompress) take it as it is.
def _per_batch(body, codec, *args):
    """body(*args), with the kernels' addressing guard taken over every enclosing vmap's
    batch. Python scalars among args stay static; arrays are the custom_vmap's operands."""
    if backend_for(codec) == "reference" or getattr(_state, "batch", None) is not None:
        return body(*args)
    dyn = [i for i, a in enumerate(args) if isinstance(a, jax.Array)]

    def on(*operands):
        full = list(args)
        for i, a in zip(dyn, operands):
            full[i] = a
        return body(*full)

    return _guarded(on, 1)(*(args[i] for i in dyn))


def _guarded(body, factor: int):
    def run(*operands):
        prev, _state.batch = getattr(_state, "batch", None), factor
        try:
            return body(*operands)
        finally:
            _state.batch = prev

    fn = custom_vmap(run)

    @fn.def_vmap
    def rule(axis_size, in_batched, *operands):
        axes = tuple(0 if b else None for b in in_batched)
        out = _guarded(jax.vmap(body, in_axes=axes), factor * axis_size)(*operands)
        return out, jax.tree.map(lambda _: True, out)

    return fn


def impl_for(kernel: str, codec, shape, dtype, impl: str | None = None,
             wire_bytes: int = 0) -> str:
    """How `kernel` runs for this call: 'reference', 'interpret' (Triton, interpreted),
    'triton' or 'mosaic'. dtype: compress's input, decompress's output, reduce's own data;
    wire_bytes: the size of the call's largest wire array (`triton_offsets_wrap`)."""
    mode = backend_for(codec)
    choice = impl or current_impls()[kernel]
    if choice not in IMPLS:
        raise ValueError(f"{kernel}: impl={choice!r} is not one of {IMPLS}")
    if mode == "reference":
        return "reference"
    triton = codec.kernels.kernel(kernel, "triton") is not None
    if mode == "interpret":
        if choice == "mosaic":
            raise ValueError(f"{kernel}: Mosaic GPU kernels do not run in the interpreter "
                             f"(backend='interpret'); use impl='triton' or a GPU")
        return "interpret" if triton else "reference"
    why = codec.kernels.mosaic_unsupported(kernel, codec, shape, dtype)
    if choice == "mosaic":
        if why is not None:
            raise ValueError(f"{kernel}: impl='mosaic' does not cover this call: {why}")
        return "mosaic"
    if why is None and (triton_missing() is not None
                        or choice == "auto" and DEFAULT_IMPL[kernel] == "mosaic"):
        return "mosaic"
    return "reference" if not triton or triton_offsets_wrap(wire_bytes) else "triton"


def _triton_kernel(kernel: str, codec, wire_bytes: int):
    """The Triton kernel of `kernel` that runs this call of the Triton-only kernels
    (decode_sum, compress_feedback), or None: the reference (or, for compress_feedback,
    compress then decompress) runs instead."""
    mode = backend_for(codec)
    if mode == "reference" or mode == "pallas" and triton_offsets_wrap(wire_bytes):
        return None
    return codec.kernels.kernel(kernel, "triton")


# The calls themselves, under the public names' batch guard (`_per_batch`).
def _compress(x, codec, skip_start=0, skip_rows: int = 0, cfg=None, impl: str | None = None):
    how = impl_for("compress", codec, x.shape, x.dtype, impl,
                   x.shape[0] * codec.row_bytes)
    if how == "reference":
        return codec.compress_reference(x)
    if how == "mosaic":
        kernel = codec.kernels.kernel("compress", "mosaic")
        return kernel(x, codec, cfg=cfg, skip_start=skip_start, skip_rows=skip_rows)
    kernel = codec.kernels.kernel("compress", "triton")
    return kernel(x, codec, cfg=cfg, interpret=how == "interpret", skip_start=skip_start,
                  skip_rows=skip_rows)


def _decompress(w, codec, out_dtype=jnp.float32, cfg=None, impl: str | None = None):
    how = impl_for("decompress", codec, w.shape, out_dtype, impl, math.prod(w.shape))
    if how == "reference":
        return codec.decompress_reference(w, out_dtype)
    if how == "mosaic":
        return codec.kernels.kernel("decompress", "mosaic")(w, codec, out_dtype=out_dtype,
                                                             cfg=cfg)
    kernel = codec.kernels.kernel("decompress", "triton")
    return kernel(w, codec, out_dtype=out_dtype, cfg=cfg, interpret=how == "interpret")


def _reduce(recv, own, me, codec, own_row0=0, cfg=None, impl: str | None = None):
    how = impl_for("reduce", codec, recv.shape[1:], own.dtype, impl,
                   math.prod(recv.shape))
    if how == "reference":
        return references.reduce_reference(recv, own, me, codec, own_row0)
    kernel = codec.kernels.kernel("reduce", "triton")
    return kernel(recv, own, me, codec, cfg=cfg, interpret=how == "interpret",
                  own_row0=own_row0)


def _decode_sum(recv, codec, out_dtype=jnp.float32, cfg=None):
    kernel = _triton_kernel("decode_sum", codec, math.prod(recv.shape))
    if kernel is None:
        return references.decode_sum_reference(recv, codec, out_dtype)
    return kernel(recv, codec, out_dtype, cfg=cfg, interpret=backend_for(codec) == "interpret")


def _compress_feedback(x, r, codec, skip_start=0, skip_rows: int = 0, cfg=None):
    kernel = _triton_kernel("compress_feedback", codec, x.shape[0] * codec.row_bytes)
    if kernel is not None:
        return kernel(x, r, codec, cfg=cfg, interpret=backend_for(codec) == "interpret",
                      skip_start=skip_start, skip_rows=skip_rows)
    z = x.astype(jnp.float32) - r
    wire = _compress(z, codec, skip_start=skip_start, skip_rows=skip_rows)
    return wire, _decompress(wire, codec, jnp.float32) - z


def compress(x, codec, skip_start=0, skip_rows: int = 0, cfg=None, impl: str | None = None):
    """(rows, B) float → (rows, row_bytes) uint8. Rows [skip_start, skip_start + skip_rows)
    of the output may be left unwritten (the kernels skip them; the reference does not).
    cfg: the chosen kernel's config (KernelConfig for Triton, MosaicConfig for Mosaic;
    None: its default; references ignore it)."""
    return _per_batch(lambda x, s: _compress(x, codec, s, skip_rows, cfg, impl), codec,
                      x, skip_start)


def decompress(w, codec, out_dtype=jnp.float32, cfg=None, impl: str | None = None):
    """(rows, row_bytes) uint8 → (rows, B) out_dtype."""
    return _per_batch(lambda w: _decompress(w, codec, out_dtype, cfg, impl), codec, w)


def reduce(recv, own, me, codec, own_row0=0, cfg=None, impl: str | None = None):
    """The owner's step: compress(own[own_row0:][:n] + Σ_{p ≠ me} decompress(recv[p]))."""
    return _per_batch(lambda r, o, m, o0: _reduce(r, o, m, codec, o0, cfg, impl), codec,
                      recv, own, me, own_row0)


def decode_sum(recv, codec, out_dtype=jnp.float32, cfg=None):
    """(P, rows, row_bytes) uint8 → (rows, B) out_dtype: Σ_p decompress(recv[p]) in device
    order (Triton kernels only)."""
    return _per_batch(lambda r: _decode_sum(r, codec, out_dtype, cfg), codec, recv)


def compress_feedback(x, r, codec, skip_start=0, skip_rows: int = 0, cfg=None):
    """Error feedback's compress: x (rows, B) float, residual r (rows, B) float32 →
    (wire of z = x − r, new residual decompress(wire) − z in float32). One kernel for
    Echo's codecs (rows in the skipped window, as in `compress`, are left unwritten in
    both outputs); compress then decompress for the others."""
    return _per_batch(lambda x, r, s: _compress_feedback(x, r, codec, s, skip_rows, cfg),
                      codec, x, r, skip_start)
