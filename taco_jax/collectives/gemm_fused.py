"""The row-parallel GEMM and its collective as one GEMM launch and one decode launch: the
fused route of `matmul_reduce_scatter` and `matmul_psum`.

    matmul_reduce_scatter(x, w, residual=r)  = r + psum_scatter(x @ w)  exchange "owner"
    matmul_psum(x, w, residual=r)            = r + psum(x @ w)          exchange "all"

`kernels.gemm.row_parallel`: the GEMM's epilogue rounds each (64, 256) output tile, encodes
it and stores the wire into its destinations' receive buffers (the owner of its rows, or
every device); the second launch decodes the P wires, sums them in f32 in device order and
adds the residual. x @ w never reaches HBM in bf16, and the residual add costs no launch of
its own. One quantization per element; every device decodes the same bytes in the same
order.

Where it runs (`plan`): the transport "fused" (passed, or the recipe's), or "auto", over one
mesh axis of GPUs of one process (peers by `Remote` stores), or under `jax.vmap` on a GPU
(emulated tensor parallelism: the members are the virtual devices of one launch, the
kernels' loopback), where the kernels cover the call (`reason`: 2-D x, or x whose leading
dimensions flatten into the GEMM's rows, scattered along dimension 0; bf16 or f16; M, K, N
multiples of the kernels' tiles; a codec with tile math) and their loopback checks passed
on a GPU for the modules emitted now (`kernels.fused.checked`, kernels "gemm_owner" and
"gemm_all"). Telemetry names the transport "fused" ("fused (loopback)" under vmap).
Elsewhere with transport "fused": XLA's GEMM, then the fused transport's separate kernels
(`psum_scatter`'s, `psum`'s), named "fused (separate kernels): <why not the GEMM>"; with
"auto" the xla route (`matmul_reduce_scatter`'s collective-permutes, `psum`'s two-shot).

Gradients of the fused route are the other routes' (the conjugate collectives):
matmul_reduce_scatter's dx and dw come from the compressed `all_gather_matmul` of the
cotangent, matmul_psum's from psum's transpose of it (under check_vma the cotangent itself,
else its compressed psum); the residual's cotangent is the output's.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from taco_jax import codecs, telemetry
from taco_jax.collectives import allreduce, axes as axes_lib, fused, gather, matmul
from taco_jax.collectives.call import Call
from taco_jax.kernels.fused import checked
from taco_jax.kernels.gemm import decode_residual, encode_epilogue, row_parallel


def kernel(scatter: bool) -> str:
    """The checked table's name of the GEMM kernels: exchange "owner" (the reduce-scatter)
    or "all" (the all-reduce)."""
    return "gemm_owner" if scatter else "gemm_all"


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a call runs when its collective is compressed: `label` is its telemetry
    transport; `run()` returns the result, residual added."""
    label: str
    run: Callable


# -- what is covered ----------------------------------------------------------------------
def reason(op: Call, x, w, residual, dim: int, scatter: bool) -> str | None:
    """Why the two launches do not run this call (None: they do): an operand they do not
    take (x whose leading dimensions do not flatten into rows with the scattered ones
    first, dtypes), the shapes or codec they do not cover (`row_parallel.unsupported`), a
    residual varying over the axis of the all-reduce under check_vma, or no passing GPU
    checks of the modules they emit now (`checked.unchecked`)."""
    if scatter and dim != 0:
        return (f"scatter_dimension={dim} (the GEMM's owners take contiguous ranges of its "
                f"rows: dimension 0)")
    if w.dtype != x.dtype:
        return f"x is {x.dtype}, w is {w.dtype}"
    if residual is not None and residual.dtype != x.dtype:
        return f"residual of {residual.dtype}, x of {x.dtype}"
    if (not scatter and residual is not None and op.vma and not axes_lib.emulated(op.axes)
            and axes_lib.varying(residual, op.axes)):
        return f"residual varying over {op.axis!r} (each device's decode adds the same one)"
    m = x.size // x.shape[-1]
    why = row_parallel.unsupported(op.codec, op.p, (m, x.shape[-1]), w.shape, x.dtype,
                                   scatter=scatter)
    return why or checked.unchecked(kernel(scatter), op.codec, x.dtype)


def plan(op: Call, x, w, residual, dim: int, scatter: bool) -> Plan | None:
    """The fused route of one call, or None: the caller's own route (lax or xla). Trace
    time. Raises ValueError for transport="fused" where the fused transport cannot run
    (as `taco_jax.psum`)."""
    if (op.transport == "xla" or op.p == 1 or op.codec.is_identity
            or x.dtype not in codecs.FLOAT_DTYPES):
        return None        # lax's collective, or the xla route's bf16 baseline (codec "none")
    unavailable = fused.unavailable_reason(op.axes)
    if unavailable is not None:
        if op.transport == "fused":
            raise ValueError(f"taco_jax.{op.op}: transport='fused' cannot run here: "
                             f"{unavailable}; use transport='auto' or 'xla'")
        return None
    why = reason(op, x, w, residual, dim, scatter)
    emulated = axes_lib.emulated(op.axes)
    if why is None:
        label = "fused (loopback)" if emulated else "fused"
        return Plan(label, functools.partial(_one_gemm, op, x, w, residual, scatter))
    if op.transport != "fused":
        return None
    how = "separate kernels, exchange emulated" if emulated else "separate kernels"
    return Plan(f"fused ({how}): {why}",
                functools.partial(_separate, op, x, w, residual, dim, scatter))


# -- the routes -----------------------------------------------------------------------------
def _add(y, residual):
    return y if residual is None else y + residual


def _separate(op: Call, x, w, residual, dim: int, scatter: bool):
    """XLA's GEMM, then the fused transport's separate kernels (an all-reduce: the
    one-launch all-reduce where it is checked), then the residual add."""
    z = axes_lib.per_member(jnp.matmul(x, w), op.axes, force=True)
    if scatter:
        y = gather._psum_scatter(z, op.axis, op.codec, op.p, dim, True, "fused")
    else:
        y = allreduce._psum(z, op.axis, op.codec, op.p, op.vma, "fused")
    return _add(y, residual)


def _one_gemm(op: Call, x, w, residual, scatter: bool):
    """The two launches on x's rows (its leading dimensions flattened), residual zeros
    where there is none."""
    k, n = w.shape
    m = x.size // k
    rows = m // op.p if scatter else m
    out_shape = ((x.shape[0] // op.p if scatter else x.shape[0]), *x.shape[1:-1], n)
    emulated = axes_lib.emulated(op.axes)
    r2 = jnp.zeros((rows, n), x.dtype) if residual is None else residual.reshape(rows, n)
    if scatter and op.vma and not emulated and not axes_lib.varying(r2, op.axes):
        # its cotangent is this device's rows of the result's: varying, as the result
        r2 = lax.pcast(r2, op.axis, to="varying")
    x2, w = matmul._operands(op, x.reshape(m, k), w)
    r2 = axes_lib.per_member(r2, op.axes, force=True)
    y = _gemm(x2, w, r2, op.axis, op.codec, op.p, op.vma, scatter)
    if telemetry.enabled():       # against the exact collective, in f32, residual included
        z = jnp.matmul(x2, w).astype(jnp.float32)
        exact = (lax.psum_scatter(z, op.axis, tiled=True) if scatter else
                 lax.psum(z, op.axis)) + r2.astype(jnp.float32)
        got = y
        if not scatter and op.vma and not emulated:   # the record sums over the axis
            exact, got = (lax.pcast(v, op.axis, to="varying") for v in (exact, y))
        wire = rows * n // 256 * encode_epilogue.tile_codec(op.codec).row_bytes
        # a device sends its wire of the others' rows ("owner"), or all of it to each peer;
        # the bf16 reduce-scatter or (ring) all-reduce it stands for
        telemetry.report_send(op.op, exact, got, op.axis, op.codec,
                              wire_bytes=(op.p - 1) * wire,
                              bf16_bytes=2 * (op.p - 1) * rows * n * (1 if scatter else 2)
                              // (1 if scatter else op.p))
    return y.reshape(out_shape)


def _mat(x, w, residual, axis, scatter: bool, vma: bool):
    """The results' manual_axis_type inside shard_map: what any operand varies over; the
    reduce-scatter's varies over the axis, the all-reduce's does not (every device decodes
    the same bytes). None without check_vma."""
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    if mat is None or not vma:
        return mat
    varying = set()
    for v in (x, w, residual):
        m = getattr(jax.typeof(v), "manual_axis_type", None)
        varying |= set(m.varying) if m is not None else set()
    varying = varying | {axis} if scatter else varying - {axis}
    return mat.update(varying=frozenset(varying))


def _launches(x, w, residual, axis, codec, p: int, vma: bool, scatter: bool):
    """residual + this device's (rows of the) compressed sum over `axis` of x @ w: over a
    mesh axis the kernels with Remote peers; over a jax.vmap axis their loopback."""
    if axes_lib.emulated(axes_lib.as_tuple(axis)):
        # under vmap: the members' operands, one (P, …) array each
        xs, ws, rs = (lax.all_gather(v, axis) for v in (x, w, residual))
        ys = LOOPBACK_KERNELS.get(loopback, loopback)(xs, ws, rs, codec, scatter)
        return ys[lax.axis_index(axis)]
    out_mat = _mat(x, w, residual, axis, scatter, vma)
    if scatter:
        return row_parallel.gemm_reduce_scatter(x, w, residual, axis, p, codec,
                                                out_mat=out_mat)
    return row_parallel.gemm_allreduce(x, w, residual, axis, p, codec, out_mat=out_mat)


def loopback(xs, ws, rs, codec, scatter: bool):
    """The two launches for the P = xs.shape[0] members of a vmap axis, each with its own
    residual rs[d] ((M / P, N) rows of its own, or (M, N)): (P, rows, N), row d member d's."""
    recv = encode_epilogue.loopback_gemm_encode(xs, ws, codec,
                                                exchange="owner" if scatter else "all")
    return decode_residual.decode_sum_residual(recv, rs, codec)


# The loopback by the function a test may stand in for it (a CPU test runs the route with
# the kernels' jnp references, which Mosaic GPU cannot interpret).
LOOPBACK_KERNELS: dict = {}


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _gemm(x, w, residual, axis, codec, p, vma, scatter):
    return _launches(x, w, residual, axis, codec, p, vma, scatter)


def _gemm_fwd(x, w, residual, axis, codec, p, vma, scatter):
    return _gemm(x, w, residual, axis, codec, p, vma, scatter), (x, w)


def _gemm_bwd(axis, codec, p, vma, scatter, res, g):
    x, w = res
    axes = axes_lib.as_tuple(axis)
    if scatter:       # matmul_reduce_scatter's: all_gather_matmul(g, wᵀ) and its gather
        like = (jnp.zeros((0,), x.dtype), None)
        dx, dw, _ = matmul._mm_rs_bwd(axis, codec, (p,), 0, (like, x, w), g)
        return dx, dw, g
    with axes_lib.bound(axes, p):   # psum's transpose: the cotangent of x @ w
        if vma and not axes_lib.emulated(axes):
            dz = lax.pcast(g, axis, to="varying")
        else:         # each device's (member's) own result: their cotangents summed
            dz = allreduce._psum(g, axis, codec, p, False, "fused")
    dx = jnp.matmul(dz, w.T).astype(x.dtype)
    dw = jnp.matmul(x.T, dz).astype(w.dtype)
    return dx, dw, g


_gemm.defvjp(_gemm_fwd, _gemm_bwd)


# -- the public op ------------------------------------------------------------------------
def check_residual(name: str, residual, shape):
    """The residual as an array of the result's shape (None stays None)."""
    if residual is None:
        return None
    residual = jnp.asarray(residual)
    if tuple(residual.shape) != tuple(shape):
        raise ValueError(f"taco_jax.{name}: residual.shape={residual.shape} must be the "
                         f"result's shape {tuple(shape)}")
    if not jnp.issubdtype(residual.dtype, jnp.floating):
        raise ValueError(f"taco_jax.{name}: residual must be a float array; got "
                         f"{residual.dtype}")
    return residual


def matmul_psum(x, w, axis_name, *, residual=None, codec=None, min_bytes: int | None = None,
                transport: str | None = None):
    """`residual + psum(x @ w, axis_name)`: tensor parallelism's row-parallel GEMM (x this
    device's block of columns of the activations, w its block of rows) with its
    all-reduce compressed and the residual stream's add.

    With the fused transport (passed, the recipe's, or "auto") where its kernels cover and
    their GPU checks admit the call, it is one GEMM launch whose epilogue encodes each
    output tile and stores it into every device's receive buffer, and one launch that
    decodes the P wires, sums them in f32 in device order and adds the residual: x @ w is
    never written in bf16, and every device gets the same bits. Otherwise it is exactly
    `residual + taco_jax.psum(x @ w, axis_name, ...)` with the same codec, min_bytes and
    transport (the fused transport's all-reduce then runs beside XLA's GEMM, telemetry
    naming it "fused (separate kernels): <why not the GEMM>").

    Args:
      x: an array (…, k), at least 2-D; the fused GEMM takes its leading dimensions as
        rows (their product a multiple of 128, k of 64; bf16 or f16).
      w: a 2-D array (k, n) (the fused GEMM: n a multiple of 256, x's dtype).
      axis_name: a mesh axis name, or a tuple/list of names (summed over their product).
      residual: None (default: nothing added), or a float array of the result's shape (x's
        shape with n last), the same on every device of the axis for the fused GEMM under
        check_vma (the residual stream); added after the sum, in the result's dtype.
      codec, min_bytes, transport: as `taco_jax.psum`'s (each None by default: the
        recipe's). "auto" takes the fused GEMM where it runs (above), else psum's choice.

    Returns:
      residual + the sum over `axis_name` of x @ w: x's shape with n last, in the dtype of
      `x @ w` (promoted with the residual's); invariant over `axis_name` under check_vma
      unless the residual varies. Gradient: as `taco_jax.psum`'s (its transpose) through
      x @ w; the residual's cotangent is the result's.

    Raises:
      UnboundAxisError: (a NameError) a name in `axis_name` is not bound here.
      ValueError: w not 2-D; x below 2-D or empty (or w empty); x.shape[-1] != w.shape[0];
        a residual of another shape or not float; transport="fused" where the fused
        transport cannot run (the message says why); an unknown codec name, a bad
        `axis_name`, `min_bytes` or `transport` (as `taco_jax.psum`).
      TypeError: a codec that is neither a name nor a Codec.
    """
    op = Call.make("matmul_psum", axis_name, codec, min_bytes, transport)
    x, w = jnp.asarray(x), jnp.asarray(w)
    matmul._check(op.op, x, w, 0, "axis")
    z = jax.eval_shape(jnp.matmul, x, w)                             # x @ w, not computed
    residual = check_residual(op.op, residual, z.shape)
    invariant = (op.vma and not axes_lib.emulated(op.axes)
                 and not (axes_lib.varying(x, op.axes) or axes_lib.varying(w, op.axes)))
    route, why = op._route(z, invariant)
    # "fused": the GEMM or the separate kernels; "xla" under "auto": the GEMM where it runs
    fused_plan = None if route == "lax" else plan(op, x, w, residual, 0, scatter=False)
    if fused_plan is not None:
        telemetry.note_site(op.op, z.shape, z.dtype, op.axes, op.codec.name, None, op.p,
                            fused_plan.label, op.vma)
        return fused_plan.run()
    telemetry.note_site(op.op, z.shape, z.dtype, op.axes, op.codec.name, why, op.p,
                        op._label(route, z), op.vma)
    if route == "lax":
        return _add(lax.psum(jnp.matmul(x, w), op.axis), residual)
    v = axes_lib.per_member(jnp.matmul(x, w), op.axes, force=True)
    return _add(allreduce._psum(v, op.axis, op.codec, op.p, op.vma, route), residual)
