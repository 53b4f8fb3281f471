"""Collective matmuls (Megatron-SP's column- and row-parallel GEMMs), compressed, each the
other's transpose.

    all_gather_matmul(x, w)      = all_gather(x, tiled=True) @ w        (column-parallel)
    matmul_reduce_scatter(x, w)  = psum_scatter(x @ w, tiled=True)      (row-parallel)

Each is P steps of one GEMM chunk and one `lax.ppermute` of codes, so XLA can run a step's
collective-permute beside the next step's GEMM (inside `shard_map` XLA's own windowed
einsum does not apply: the overlap is written by hand):

- all_gather_matmul: each device encodes its shard once; the codes go round the ring, one
  hop a step, never re-encoded; at step s a device decodes the shard of device me − s (its
  own at s = 0, decoded as well, as `taco_jax.all_gather` does, so every device multiplies
  the same gathered x) and multiplies it with w. One quantization per element.
- matmul_reduce_scatter: at step s = 1 … P − 1 a device computes the chunk of x @ w that
  device me + s owns, encodes it once and sends it there with one ppermute of shift s; the
  owner decodes it and sums in f32 with its own chunk, which is never quantized. One
  quantization per element, as `taco_jax.psum_scatter`.

Codec "none" runs the same steps with the values themselves on the wire (the overlapped
bf16 baseline). The pair's `custom_vjp`s close over each other: the gradient of
all_gather_matmul is a matmul_reduce_scatter (dx) and a GEMM with the gathered x the
forward multiplied (dw), which the backward gathers again beside the dx GEMM from this
device's x, as Megatron-SP does (`keep`: or from the forward's codes, or the gathered x
kept); the gradient of matmul_reduce_scatter an all_gather_matmul (dx) that also hands back
the gathered cotangent (dw = xᵀ @ it).

Under `jax.vmap(axis_name=...)` (tensor parallelism emulated on one device) the steps take
the members' form of `members`: the ring's hops, each device's chunk of x and its place in
the result are static slices of the members' arrays laid side by side, where the offsets
a device computes from its index would make gathers and scatters over every member.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from taco_jax import codecs, routes, telemetry
from taco_jax.collectives import axes as axes_lib, members
from taco_jax.collectives.call import DEFAULT_MIN_BYTES, Call
from taco_jax.kernels import dispatch

# why the ops take no fused transport (their error message)
NO_FUSED = ("the fused transport's one-launch kernels carry a whole all-reduce, not the P "
            "collective-permutes a collective matmul interleaves with its GEMMs")


def _encode(v, codec):
    """The bytes a step sends: the codes (uint8, opaque to XLA's CollectiveQuantizer), or
    with codec "none" the values themselves, in their dtype."""
    return v if codec.is_identity else dispatch.compress(codecs.to_blocks(v, codec.block_size),
                                                        codec)


def _decode(wire, codec, shape, dtype):
    if codec.is_identity:
        return wire.astype(dtype)
    return codecs.from_blocks(dispatch.decompress(wire, codec, dtype), shape)


def _gather_matmul(x, w, axis, codec, p: int, dim: int, want_x: bool, wire=None):
    """(all_gather(x) @ w, the gathered x it multiplied), gathered along `dim`; the first
    None where w is None (a gather alone), the second unless `want_x`. `wire`: x's codes
    (the forward's, kept for the backward; x then gives only its shape and dtype, and
    telemetry records nothing: the forward recorded these codes' error), else x is encoded
    here."""
    report = telemetry.enabled() and wire is None
    axes = axes_lib.as_tuple(axis)
    wire = _encode(x, codec) if wire is None else wire
    sent = (p - 1) * _nbytes(wire)
    keep_x = want_x or report
    ys, xs = [], []
    for s in range(p):
        # the hop for the next step is issued before this step's GEMM: independent of it,
        # so the two can run side by side
        nxt = members.shift(wire, axes, p, 1) if s < p - 1 else None
        part = _decode(wire, codec, x.shape, x.dtype)                # device me − s's x
        if w is not None:
            ys.append(jnp.matmul(part, w))
        if keep_x:
            xs.append(part)
        wire = nxt
    at = lambda me, s: (me - s) % p                                  # noqa: E731
    y = members.place(ys, axes, p, at, dim) if w is not None else None
    xg = members.place(xs, axes, p, at, dim) if keep_x else None
    if report:                 # against the exact gather of the same tensor, in f32
        exact = lax.all_gather(x.astype(jnp.float32), axis, axis=dim, tiled=True)
        telemetry.report_send("all_gather_matmul", exact, xg, axis, codec,
                              wire_bytes=sent,
                              bf16_bytes=2 * (p - 1) * x.size)
    return y, (xg if want_x else None)


def _matmul_scatter(x, w, extra, axis, codec, p: int, dim: int):
    """psum_scatter(x @ w + extra) along `dim` (x itself where w is None); `extra` (x @ w's
    shape, or None) is the cotangent of the gathered output when all_gather_matmul's
    backward calls this."""
    axes = axes_lib.as_tuple(axis)
    m = x.shape[dim] // p

    def chunk(j):              # the rows of x @ w (+ extra) that device j(me) owns
        rows = lambda v: members.take(v, axes, lambda me: j(me) * m, m, dim)  # noqa: E731
        c = rows(x) if w is None else jnp.matmul(rows(x), w)
        return c if extra is None else c + rows(extra)

    total, sent = None, 0
    for s in range(1, p):
        # the peers' chunks first, so their codes travel while the later GEMMs run
        c = chunk(lambda me, s=s: (me + s) % p)
        wire = _encode(c, codec)
        sent += _nbytes(wire)
        got = _decode(members.shift(wire, axes, p, s), codec, c.shape, jnp.float32)
        total = got if total is None else total + got                # from device me − s
    own = chunk(lambda me: me)
    out = (own.astype(jnp.float32) + total).astype(own.dtype)
    if telemetry.enabled():    # against the exact reduce-scatter, in f32
        z = x if w is None else jnp.matmul(x, w)
        z = z if extra is None else z + extra
        exact = lax.psum_scatter(z.astype(jnp.float32), axis, scatter_dimension=dim, tiled=True)
        telemetry.report_send("matmul_reduce_scatter", exact, out, axis, codec,
                              wire_bytes=sent, bf16_bytes=2 * (p - 1) * own.size)
    return out


def _nbytes(v) -> int:
    return v.size * v.dtype.itemsize


def _contract_leading(a, b):
    """aᵀ @ b over every dimension but the last: (…, k), (…, n) → (k, n). Computed as
    (bᵀ @ a)ᵀ, as jax's transpose of `a @ w` computes w's cotangent: the same products
    summed in the same order, so a dw here equals the unfused matmul's bit for bit."""
    lead = tuple(range(a.ndim - 1))
    return jnp.tensordot(b, a, axes=(lead, lead)).T


# What all_gather_matmul's backward keeps of x for dw = (gathered x)ᵀ @ dy.
KEEP = ("shard", "codes", "gathered")
# the site's transport where the backward keeps the gathered x (and sends no second gather)
KEPT_LABEL = telemetry.GATHERED_KEPT


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6, 7))
def _ag_mm(x, w, axis, codec, sizes, dim, want_x, keep):
    """all_gather(x) @ w, with the gathered x too where `want_x`; w None: the gathered x
    alone (the backward's second gather)."""
    y, xg = _gather_matmul(x, w, axis, codec, math.prod(sizes), dim, want_x)
    if w is None:
        return xg
    return (y, xg) if want_x else y


def _ag_mm_fwd(x, w, axis, codec, sizes, dim, want_x, keep):
    # the custom_vjp itself (not _gather_matmul): under higher-order AD JAX differentiates
    # this rule, and the integer codes would give a zero derivative
    like = jnp.zeros((0, *x.shape), x.dtype)             # x's shape and dtype, no bytes
    if w is None:
        return _ag_mm(x, w, axis, codec, sizes, dim, want_x, keep), (like, None)
    if keep == "gathered":
        y, xg = _ag_mm(x, w, axis, codec, sizes, dim, True, keep)
        return ((y, xg) if want_x else y), (like, xg, w)
    out = _ag_mm(x, w, axis, codec, sizes, dim, want_x, keep)
    # "shard": x itself, gathered again by the backward (its codes are re-made from it:
    # the same bytes); "codes": the forward's codes of x
    return out, (like, x if keep == "shard" else _encode(x, codec), w)


def _ag_mm_bwd(axis, codec, sizes, dim, want_x, keep, res, cts):
    like, *res = res
    with axes_lib.bound(axes_lib.as_tuple(axis), sizes):
        if res[0] is None:                                  # the gather alone
            dx = _mm_rs(cts, None, None, axis, codec, sizes, dim)
            return dx.astype(like.dtype), None
        kept, w = res
        dy, dxg = cts if want_x else (cts, None)
        dx = _mm_rs(dy, w.T, dxg, axis, codec, sizes, dim)
        if keep == "shard":   # x gathered again beside the dx GEMM, by a custom_vjp op
            # (twice differentiable). Tied to dy: the gather needs only x, and where it is
            # copies without collectives (under jax.vmap) XLA would hoist it into the
            # forward pass and hold every layer's P-times-x until its backward
            kept, dy = lax.optimization_barrier((kept, dy))
            xg = _ag_mm(kept, None, axis, codec, sizes, dim, True, keep)
        elif keep == "codes":
            xg = _gather_matmul(jnp.zeros(like.shape[1:], like.dtype), None, axis, codec,
                                math.prod(sizes), dim, True, wire=kept)[1]
        else:
            xg = kept
    return dx.astype(like.dtype), _contract_leading(xg, dy).astype(w.dtype)


_ag_mm.defvjp(_ag_mm_fwd, _ag_mm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _mm_rs(x, w, extra, axis, codec, sizes, dim):
    return _matmul_scatter(x, w, extra, axis, codec, math.prod(sizes), dim)


def _mm_rs_fwd(x, w, extra, axis, codec, sizes, dim):
    # the dtypes of x and of extra (when there is one to give a cotangent to), no bytes
    like = (jnp.zeros((0,), x.dtype), None if extra is None else jnp.zeros((0,), extra.dtype))
    res = (like, x if w is not None else None, w)
    return _mm_rs(x, w, extra, axis, codec, sizes, dim), res


def _mm_rs_bwd(axis, codec, sizes, dim, res, dz):
    (x_like, extra_like), x, w = res
    with axes_lib.bound(axes_lib.as_tuple(axis), sizes):
        if w is None:                                        # the reduce-scatter alone
            dx = dzg = _ag_mm(dz, None, axis, codec, sizes, dim, True, "shard")
            dw = None
        else:
            dx, dzg = _ag_mm(dz, w.T, axis, codec, sizes, dim, True, "shard")
            dw = _contract_leading(x, dzg).astype(w.dtype)
    return (dx.astype(x_like.dtype), dw,
            None if extra_like is None else dzg.astype(extra_like.dtype))


_mm_rs.defvjp(_mm_rs_fwd, _mm_rs_bwd)


# -- the public ops --------------------------------------------------------------------------
def _check(name: str, x, w, dim: int, what: str):
    """Validate the operands; `dim` (may be negative) splits x, never its last dimension."""
    if w.ndim != 2:
        raise ValueError(f"taco_jax.{name}: w must be 2-D (k, n); got w.shape={w.shape}")
    if x.ndim < 2:
        raise ValueError(f"taco_jax.{name}: x must have at least 2 dimensions (…, k); got "
                         f"x.shape={x.shape}")
    if x.shape[-1] != w.shape[0]:
        raise ValueError(f"taco_jax.{name}: x's last dimension must match w's first; got "
                         f"x.shape={x.shape}, w.shape={w.shape}")
    if not -x.ndim <= dim < x.ndim or dim % x.ndim == x.ndim - 1:
        raise ValueError(f"taco_jax.{name}: {what}={dim} must name a dimension of "
                         f"x.shape={x.shape} other than the last (contracted) one")
    if x.size == 0 or w.size == 0:
        raise ValueError(f"taco_jax.{name}: empty operand: x.shape={x.shape}, "
                         f"w.shape={w.shape}")
    return dim % x.ndim


def _route(op: Call, v, x, w, label: str = "xla") -> str:
    """"lax" or "xla" for the communicated tensor v (a shape and dtype), noted as the site
    (its transport `label` where not "lax"). As the other ops decide, except that codec
    "none" keeps the decomposition: it is the overlapped baseline, not lax's collective."""
    nbytes = v.size * v.dtype.itemsize
    if op.p == 1:
        why = "axis of size 1"
    elif v.dtype not in codecs.FLOAT_DTYPES:
        why = f"dtype {v.dtype}"
    elif axes_lib.reduced_or_unreduced(x) or axes_lib.reduced_or_unreduced(w):
        why = "reduced/unreduced sharding type"
    else:
        cal = routes.lookup(op.p, op.codec.name) if op.min_bytes is None else None
        if cal is not None:                   # this machine's measured routes
            why = (None if cal.route(nbytes, ("xla",)) != "lax" else
                   f"{nbytes} B: lax.psum measured faster here ({cal.key})")
        else:
            threshold = DEFAULT_MIN_BYTES if op.min_bytes is None else op.min_bytes
            why = f"{nbytes} B < min_bytes={threshold}" if nbytes < threshold else None
    telemetry.note_site(op.op, v.shape, v.dtype, op.axes, op.codec.name, why, op.p,
                        "lax" if why is not None else label, op.vma)
    return "lax" if why is not None else "xla"


def _sizes(op: Call) -> tuple:
    """The size of each of the op's axes: its backward binds them again under jax.vmap,
    where they are unbound by then (`axes.bound`), a tuple of axes included."""
    return tuple(lax.axis_size(a) for a in op.axes)


def _operands(op: Call, x, w):
    """x and w as the custom_vjp takes them. Under check_vma both vary over the op's axes
    and over each other's (a pcast whose transpose, lax's psum, sums a replicated w's
    gradient), so the backward's dx and dw have their primals' types. Under jax.vmap each
    member gets its own copy of a shared operand, so its cotangent reaches the backward
    rule unsummed (see psum)."""
    if axes_lib.emulated(op.axes):
        return (axes_lib.per_member(x, op.axes, force=True),
                axes_lib.per_member(w, op.axes, force=True))
    if not op.vma:
        return x, w

    def vary(v, want):
        mat = getattr(jax.typeof(v), "manual_axis_type", None)
        missing = tuple(a for a in want if mat is None or a not in mat.varying)
        return lax.pcast(v, missing, to="varying") if missing else v

    def varying(v):
        mat = getattr(jax.typeof(v), "manual_axis_type", None)
        return tuple(mat.varying) if mat is not None else ()
    want = tuple(dict.fromkeys((*op.axes, *varying(x), *varying(w))))
    return vary(x, want), vary(w, want)


def all_gather_matmul(x, w, axis_name, *, axis: int = 0, codec=None,
                      min_bytes: int | None = None, transport: str | None = None,
                      keep: str = "shard"):
    """`all_gather(x, axis_name, axis=axis, tiled=True) @ w`, its all-gather compressed and
    overlapped with the GEMM: Megatron-SP's column-parallel GEMM (x this device's part of
    the sequence, w its block of columns).

    P steps: each device encodes its x once; the codes travel round the ring by
    `lax.ppermute`, one hop a step, while each step decodes the shard that arrived and
    multiplies it with w. Every device decodes the same bytes, its own shard included (as
    `taco_jax.all_gather`), so the result equals `taco_jax.all_gather(x, ...) @ w`; each
    element is quantized once. Codec "none" runs the same steps with the values on the wire.
    Below `min_bytes` (of x, per device), for an integer dtype or over an axis of size 1 it
    is `lax.all_gather(x, axis_name, axis=axis, tiled=True) @ w`, with lax's gradients.

    Args:
      x: an array (…, k), at least 2-D: this device's shard along `axis`.
      w: a 2-D array (k, n): this device's block of columns.
      axis_name: a mesh axis name, or a tuple/list of names (gathered over their product,
        in the order of `lax.axis_index` over them).
      axis: int, default 0: the dimension of x gathered (negative counts from the end); not
        the last, which the GEMM contracts.
      codec, min_bytes: as `taco_jax.psum`'s (each None by default: the recipe's); the
        backward uses the same codec.
      transport: "xla" or "auto" (the same here: the codes move by `lax.ppermute`); None
        (default): the recipe's, whose "fused" means "xla" for this op. "fused" given here
        is an error: the fused transport's one-launch kernels cannot interleave with GEMMs.
      keep: what the backward pass keeps of x for dw = (gathered x)ᵀ @ dy.
        "shard" (default, as Megatron-SP): this device's x; the backward gathers it again
        beside its dx GEMM, re-encoding it to the forward's codes (the same bytes), so dw
        multiplies exactly what the forward multiplied. "codes": the forward's codes of x
        (for taco 0.515 of x's bf16 bytes), which the backward sends round again; its dw
        has no derivative through x (codes are integers): not for higher-order AD.
        "gathered": the decoded gathered x itself, P times x: no second gather, for where
        memory is plentiful.

    Returns:
      The gathered x times w: x's shape with dimension `axis` P times longer and the last
      n, in the dtype of `x @ w`; varying over `axis_name`. Gradient: dx is
      `matmul_reduce_scatter(dy, wᵀ)` (compressed), dw the gathered x (as decoded and
      multiplied in the forward pass) transposed times dy. Reverse over reverse works (with
      `keep` "shard" or "gathered"); forward mode (jax.jvp, jax.jacfwd, a jvp of a grad)
      raises jax's TypeError for a custom_vjp function.

    Raises:
      UnboundAxisError: (a NameError) a name in `axis_name` is not bound here.
      ValueError: w not 2-D; x below 2-D or empty (or w empty); x.shape[-1] != w.shape[0];
        `axis` out of range or the last dimension; `keep` not one of "shard", "codes",
        "gathered"; transport="fused"; an unknown codec name, a bad `axis_name`,
        `min_bytes` or `transport` (as `taco_jax.psum`).
      TypeError: a codec that is neither a name nor a Codec (the message names the op and
        the value).
    """
    op = Call.make("all_gather_matmul", axis_name, codec, min_bytes, transport,
                   xla_only=NO_FUSED)
    if keep not in KEEP:
        raise ValueError(f"taco_jax.all_gather_matmul: keep={keep!r} must be one of {KEEP}")
    x, w = jnp.asarray(x), jnp.asarray(w)
    dim = _check(op.op, x, w, axis, "axis")
    if _route(op, x, x, w, "xla" if keep != "gathered" else KEPT_LABEL) == "lax":
        return jnp.matmul(lax.all_gather(x, op.axis, axis=dim, tiled=True), w)
    x, w = _operands(op, x, w)
    return _ag_mm(x, w, op.axis, op.codec, _sizes(op), dim, False, keep)


def matmul_reduce_scatter(x, w, axis_name, *, scatter_dimension: int = 0, residual=None,
                          codec=None, min_bytes: int | None = None,
                          transport: str | None = None):
    """`psum_scatter(x @ w, axis_name, scatter_dimension=scatter_dimension, tiled=True)`,
    its reduce-scatter compressed and overlapped with the GEMM: Megatron-SP's row-parallel
    GEMM (x this device's block of columns of the activations, w its block of rows).

    P steps: at step s = 1 … P − 1 a device computes the chunk of x @ w that device
    (me + s) mod P owns, encodes it once and sends it straight there (`lax.ppermute` by s);
    the owner decodes the P − 1 chunks it receives and sums them in f32 with its own,
    which is never quantized: one quantization per element, as `taco_jax.psum_scatter`.
    Codec "none" runs the same steps with the values on the wire. Below `min_bytes` (of
    x @ w, per device), for an integer dtype or over an axis of size 1 it is
    `lax.psum_scatter(x @ w, axis_name, scatter_dimension=..., tiled=True)`, with lax's
    gradients. With the fused transport, where its kernels cover the call and their GPU
    checks admit it, it is one GEMM launch whose epilogue encodes each output tile and
    stores it into its owner's receive buffer, then the owner's decode, f32 sum and
    residual add in one launch (`collectives.gemm_fused`); elsewhere transport="fused"
    runs XLA's GEMM and the fused transport's separate kernels (`psum_scatter`'s).

    Args:
      x: an array (…, k), at least 2-D.
      w: a 2-D array (k, n).
      axis_name: a mesh axis name, or a tuple/list of names (scattered over their
        product, in the order of `lax.axis_index` over them).
      scatter_dimension: int, default 0: the dimension of x @ w split among the devices
        (negative counts from the end); its length must be divisible by the axis size, and
        it may not be the last (n).
      residual: None (default: nothing added), or a float array of the result's shape,
        added after the reduce-scatter (Megatron-SP's residual stream: this device's part
        of the sequence); the fused GEMM adds it in its decode (x's dtype there).
      codec, min_bytes: as `taco_jax.psum`'s (each None by default: the recipe's); the
        backward uses the same codec.
      transport: "xla" (the collective-permutes above), "fused" (the fused GEMM, else the
        separate kernels; GPUs of one process, one mesh axis, or jax.vmap on a GPU) or
        "auto" (the fused GEMM where it runs, else "xla"); None (default): the recipe's.
        Codec "none" takes "xla" whatever the transport (the overlapped bf16 baseline).

    Returns:
      This device's chunk of the sum over `axis_name` of x @ w along `scatter_dimension`
      (plus the residual), in the dtype of `x @ w` (promoted with the residual's); varying
      over `axis_name`. Gradient: dx is `all_gather_matmul(dz, wᵀ)` (compressed), dw xᵀ
      times the gathered dz that the same all-gather decoded, whatever the route; the
      residual's cotangent is dz. Reverse over reverse works; forward mode raises jax's
      TypeError for a custom_vjp function.

    Raises:
      UnboundAxisError: (a NameError) a name in `axis_name` is not bound here.
      ValueError: w not 2-D; x below 2-D or empty (or w empty); x.shape[-1] != w.shape[0];
        `scatter_dimension` out of range, the last, or not divisible by the axis size;
        a residual of another shape or not float; transport="fused" where the fused
        transport cannot run (the message says why); an unknown codec name, a bad
        `axis_name`, `min_bytes` or `transport` (as `taco_jax.psum`).
      TypeError: a codec that is neither a name nor a Codec (the message names the op and
        the value).
    """
    from taco_jax.collectives import gemm_fused      # the fused route (it imports this module)
    op = Call.make("matmul_reduce_scatter", axis_name, codec, min_bytes, transport)
    x, w = jnp.asarray(x), jnp.asarray(w)
    dim = _check(op.op, x, w, scatter_dimension, "scatter_dimension")
    if x.shape[dim] % op.p:
        raise ValueError(f"taco_jax.matmul_reduce_scatter: dimension {dim} of x.shape="
                         f"{x.shape} ({x.shape[dim]}) must be divisible by the axis size "
                         f"{op.p}")
    z = jax.eval_shape(jnp.matmul, x, w)                             # x @ w, not computed
    out = z.shape[:dim] + (z.shape[dim] // op.p,) + z.shape[dim + 1:]
    residual = gemm_fused.check_residual(op.op, residual, out)
    fused_plan = gemm_fused.plan(op, x, w, residual, dim, scatter=True)
    if _route(op, z, x, w, "xla" if fused_plan is None else fused_plan.label) == "lax":
        y = lax.psum_scatter(jnp.matmul(x, w), op.axis, scatter_dimension=dim, tiled=True)
    elif fused_plan is not None:
        return fused_plan.run()
    else:
        x, w = _operands(op, x, w)
        y = _mm_rs(x, w, None, op.axis, op.codec, _sizes(op), dim)
    return y if residual is None else y + residual
