"""Echo's 4-bit kernels (taco_jax.kernels.triton.echo4: compress, compress with error feedback,
decompress, reduce, decode_sum) against their references, byte for byte; the collectives on
the kernel backend against the present reference path (error feedback's state and results,
gradients); the Triton lowering for an H200 on CPU.

On CPU the kernels run in Pallas' interpreter (~1–2 s of compile per case). References are
jitted, as the collectives run them: XLA fuses a multiply into a following add (an FMA) when
it compiles, so decode-and-add results differ by an ulp between eager and jitted references;
the kernels are compared with what the library actually computes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import taco_jax
from kernel_cases import DTYPES, INTERPRET, case, case_id, rows_over_tiles
from taco_jax import codecs, feedback
from taco_jax.collectives import two_shot as ts
from taco_jax.kernels import dispatch, references
from taco_jax.kernels.triton import echo4

BACKEND = "interpret" if INTERPRET else "pallas"
pytestmark = pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning")


def n_rows_for(b: int) -> int:
    """Two and a half default tiles plus one row: full tiles, a partial tile, masking."""
    return rows_over_tiles(echo4.default_config(b, "compress").blocks_per_program)


def echo_rows(n: int, b: int, dt: str, seed: int = 0) -> np.ndarray:
    """(n, B): Gaussian × e^{2·N} row scales, plus rows the grid treats specially: zeros,
    a constant, one-signed (ReLU-like: z = 0, and z = 15), NaN, +Inf, −Inf, tiny and huge
    values (±1e37 for f32/bf16: hi/2 − lo/2 near the top of the range); with more than 14
    rows also a −NaN, signed zeros, subnormals and a row with both infinities."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, b)) * np.exp(2 * rng.standard_normal((n, 1)))
    big, small = (1e37, 1e-30) if dt != "f16" else (3e4, 1e-3)
    x[1] = 0.0
    x[2] = 5.0
    x[3] = np.abs(x[3])
    x[4] = -np.abs(x[4])
    x[5, 7] = np.nan
    x[6, 0] = np.inf
    x[7, b // 2] = -np.inf
    x[8] = rng.standard_normal(b) * small
    x[9] = np.sign(rng.standard_normal(b)) * big * rng.uniform(0.5, 1.0, b)
    if n > 14:      # the orders int_stats reads a row's range in: −NaN, ±0, ±Inf, subnormals
        x[10, 3] = -np.nan
        x[11] = np.where(rng.uniform(size=b) < 0.5, -0.0, 0.0)
        x[12] = np.abs(x[12]) * np.where(np.arange(b) % 3 == 0, -0.0, 1.0)
        x[13] = rng.standard_normal(b) * (1e-40 if dt != "f16" else 1e-7)
        x[14, 1], x[14, 2] = np.inf, -np.inf
    return x.astype(np.float32)


def bits_equal(a, b) -> bool:
    """Arrays equal bit for bit (NaN where NaN)."""
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(
        a.view(f"u{a.dtype.itemsize}"), b.view(f"u{b.dtype.itemsize}"))


_compress_ref = jax.jit(references.compress_reference, static_argnums=1)
_decompress_ref = jax.jit(references.decompress_reference, static_argnums=(1, 2))
_feedback_ref = jax.jit(references.compress_feedback_reference, static_argnums=2)
_reduce_ref = jax.jit(references.reduce_reference, static_argnums=3)
_decode_sum_ref = jax.jit(references.decode_sum_reference, static_argnums=(1, 2))

CASES = [("echo4", 128, "bf16"), ("echo4", 32, "f32"), ("echo4", 512, "f16"),
         ("int4-sym", 64, "bf16")]


# -- compress / decompress ---------------------------------------------------------------------
@pytest.mark.parametrize("name,b,dt", CASES, ids=case_id)
def test_compress_and_decompress_match_reference_bytes(name, b, dt):
    c, x = case(name, b, dt, echo_rows, n_rows_for(b))
    wk = echo4.compress(x, c, interpret=INTERPRET)
    wr = _compress_ref(x, c)
    assert wk.shape == (x.shape[0], c.row_bytes) and wk.dtype == jnp.uint8
    diff = np.nonzero(np.asarray(wk) != np.asarray(wr))
    assert diff[0].size == 0, f"rows {sorted(set(diff[0].tolist()))[:8]} differ"
    for out in (jnp.float32, DTYPES[dt]):
        dk = echo4.decompress(wr, c, out, interpret=INTERPRET)
        assert bits_equal(dk, _decompress_ref(wr, c, out))
    # the NaN rule: exactly the non-finite groups decode to NaN, nothing else does
    dec = np.asarray(_decompress_ref(wk, c, jnp.float32))
    np.testing.assert_array_equal(np.isnan(dec).all(1), ~np.isfinite(np.asarray(
        x.astype(jnp.float32))).all(1))
    assert not np.isnan(dec[np.isfinite(np.asarray(x.astype(jnp.float32))).all(1)]).any()


def test_zero_groups_and_zero_points():
    """decode(encode(0)) == 0 exactly; one-signed groups put z at 0 (+0.0 on the wire, not
    −0.0) or 15; zero stays exactly zero inside a mixed group."""
    c = codecs.get("echo4")
    x = np.zeros((4, 128), np.float32)
    x[1] = np.linspace(0, 3, 128)            # lo = 0 → z = 0
    x[2] = -np.linspace(0, 3, 128)           # hi = 0 → z = 15
    x[3, ::2] = np.linspace(-1, 2, 64)
    w = np.asarray(echo4.compress(jnp.asarray(x), c, interpret=INTERPRET))
    z = w[:, 68:72].copy().view(np.float32)[:, 0]
    assert z.view(np.uint32)[1] == 0 and z[2] == 15.0
    d = np.asarray(echo4.decompress(jnp.asarray(w), c, interpret=INTERPRET))
    assert not d[0].any() and (d[3, 1::2] == 0).all() and (d[1, 0] == 0)


def test_skipped_rows_are_left_and_the_rest_equal():
    c = codecs.get("echo4")
    x = jnp.asarray(echo_rows(300, 128, "f32", seed=3))
    full = np.asarray(echo4.compress(x, c, interpret=INTERPRET))
    part = np.asarray(echo4.compress(x, c, interpret=INTERPRET, skip_start=jnp.int32(64),
                                     skip_rows=128))
    keep = np.r_[0:64, 192:300]
    np.testing.assert_array_equal(part[keep], full[keep])


def assert_kernels_write_reference_bytes(x, c, cfg, r=None, out=jnp.float32):
    """Every kernel under cfg, bit for bit as its reference, on x (and the residual r)."""
    wr = _compress_ref(x, c)
    recv = jnp.stack([wr, wr[::-1]])
    assert bits_equal(echo4.compress(x, c, cfg, INTERPRET), wr)
    if r is not None:
        assert bits_equal(echo4.compress_feedback(x, r, c, cfg, INTERPRET)[1],
                          _feedback_ref(x, r, c)[1])
    assert bits_equal(echo4.decompress(wr, c, jnp.bfloat16, cfg, INTERPRET),
                      _decompress_ref(wr, c, jnp.bfloat16))
    assert bits_equal(echo4.reduce(recv, x, 0, c, cfg, INTERPRET),
                      _reduce_ref(recv, x, jnp.int32(0), c))
    assert bits_equal(echo4.decode_sum(recv, c, out, cfg, INTERPRET),
                      _decode_sum_ref(recv, c, out))


def test_tilings_are_bit_identical():
    """Other tilings (a loop over tiles per program, one warp; large tiles) write the same
    bytes: the tile math is per row."""
    from taco_jax.kernels.triton import tiling
    c = codecs.get("echo4")
    n = 301
    x = jnp.asarray(echo_rows(n, 128, "bf16", seed=4)).astype(jnp.bfloat16)
    r = jnp.asarray(np.random.default_rng(5).standard_normal((n, 128)).astype(np.float32))
    for cfg in [tiling.KernelConfig(blocks_per_program=8, num_warps=1, num_stages=3,
                                    tiles_per_program=8),
                tiling.KernelConfig(blocks_per_program=64, num_warps=8)]:
        assert_kernels_write_reference_bytes(x, c, cfg, r)


# -- the tile-math variants (echo4.EchoConfig: pairs, lean, scale_words, scale_columns, …) ----
ALL_VARIANTS = dict(pairs=True, lean=True, scale_words=True, scale_columns=True,
                    merged_rows=True, word_stores=True, prefetch=True, pack_mad=True,
                    int_stats=True)
VARIANT_CASES = [("echo4", 128, "bf16", ALL_VARIANTS), ("echo4", 64, "f16", ALL_VARIANTS),
                 ("echo4", 32, "f32", ALL_VARIANTS), ("int4-sym", 128, "bf16", ALL_VARIANTS)]
# each variant also in a smaller company than all of them: three groups of three
_NAMES = list(ALL_VARIANTS)
VARIANT_CASES += [("echo4", 128, "bf16", {k: True for k in _NAMES[i::3]}) for i in range(3)]


def variant_id(v):
    return "+".join(v) if isinstance(v, dict) else case_id(v)


@pytest.mark.parametrize("name,b,dt,opts", VARIANT_CASES, ids=variant_id)
def test_variants_match_reference_bytes(name, b, dt, opts):
    """Each variant alone and all together, every kernel, bit for bit as the references:
    odd row counts (a partial tile, masks), NaN / ±Inf / zero / one-signed / huge groups;
    16-bit data as uint32 pairs (pairs), f32 data on the split path."""
    c, x = case(name, b, dt, echo_rows, n_rows_for(b), seed=6)
    n, t = x.shape[0], DTYPES[dt]
    cfg = echo4.with_options(echo4.default_tiling(b, "compress", n), **opts)
    assert cfg.pairs == opts.get("pairs", False) and not cfg.interpret
    wr = _compress_ref(x, c)
    assert bits_equal(echo4.compress(x, c, cfg, INTERPRET), wr)
    r = jnp.asarray(np.random.default_rng(7).standard_normal((n, b)).astype(np.float32) * .1)
    fk, ek = echo4.compress_feedback(x, r, c, cfg, INTERPRET)
    fr, er = _feedback_ref(x, r, c)
    assert bits_equal(fk, fr) and bits_equal(ek, er)
    for out in {jnp.float32, t}:
        assert bits_equal(echo4.decompress(wr, c, out, cfg, INTERPRET),
                          _decompress_ref(wr, c, out)), out
    peers = [_compress_ref(jnp.asarray(echo_rows(n, b, "f32", seed=20 + k)), c)
             for k in range(3)]
    peers[1] = jnp.full_like(peers[1], 0xFF)           # me's slot: never read
    recv = jnp.stack(peers)
    own = jnp.asarray(np.random.default_rng(8).standard_normal((n + 3, b))
                      .astype(np.float32)).astype(t)
    assert bits_equal(echo4.reduce(recv, own, 1, c, cfg, INTERPRET, own_row0=3),
                      _reduce_ref(recv, own, jnp.int32(1), c, 3))
    recv = jnp.stack([peers[0], peers[2], wr])
    for out in {jnp.float32, t}:
        assert bits_equal(echo4.decode_sum(recv, c, out, cfg, INTERPRET),
                          _decode_sum_ref(recv, c, out)), out


def _loop_carries(cfg, x, c):
    """Shapes and dtypes of what the loops inside the compress kernel carry."""
    jaxpr = jax.make_jaxpr(lambda v: echo4.compress(v, c, cfg, INTERPRET))(x)

    def eqns(j):
        for e in j.eqns:
            yield e
            for p in e.params.values():
                for sub in (p if isinstance(p, (list, tuple)) else [p]):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        yield from eqns(inner)
    return [(tuple(v.aval.shape), v.aval.dtype) for e in eqns(jaxpr.jaxpr)
            if e.primitive.name in ("scan", "while") for v in e.outvars]


@pytest.mark.parametrize("dt,n_rows", [("bf16", 301), ("f32", 256)])
def test_prefetch_carries_the_next_tile(dt, n_rows):
    """prefetch: the compress loop carries the next tile's loaded input (uint32 pairs of
    bf16, or the f32 tile), so its loads are issued a step before the math; without it the
    loop carries nothing of the tile's shape. Bytes as the reference (odd and even row
    counts: masked and unmasked last tiles, none loaded past the program's own)."""
    from taco_jax.kernels.triton import tiling
    c = codecs.get("echo4")
    x = jnp.asarray(echo_rows(n_rows, 128, "f32", seed=9)).astype(DTYPES[dt])
    base = tiling.KernelConfig(blocks_per_program=4, num_warps=1, num_stages=3,
                               tiles_per_program=4)
    width, dtype = (64, jnp.uint32) if dt == "bf16" else (128, jnp.float32)
    carries = {}
    for on in (False, True):
        cfg = echo4.with_options(base, pairs=True, lean=True, prefetch=on)
        assert bits_equal(echo4.compress(x, c, cfg, INTERPRET), _compress_ref(x, c))
        carries[on] = _loop_carries(cfg, x, c)
    assert ((4, width), dtype) in carries[True], carries[True]
    assert ((4, width), dtype) not in carries[False], carries[False]


def test_variants_under_a_looped_tiling():
    """All variants with a loop over tiles per program (one warp, masked last tiles)."""
    from taco_jax.kernels.triton import tiling
    c = codecs.get("echo4")
    x = jnp.asarray(echo_rows(301, 128, "bf16", seed=4)).astype(jnp.bfloat16)
    cfg = echo4.with_options(tiling.KernelConfig(blocks_per_program=8, num_warps=1,
                                                 num_stages=3, tiles_per_program=8),
                             **ALL_VARIANTS)
    assert_kernels_write_reference_bytes(x, c, cfg, out=jnp.bfloat16)


def test_pairs_are_a_bitcast():
    """to_pairs / from_pairs / to_words: element 2i in the low half, little-endian words;
    what the kernels' pair math assumes."""
    x = jnp.asarray(np.arange(8, dtype=np.float32).reshape(2, 4)).astype(jnp.bfloat16)
    u = np.asarray(echo4.to_pairs(x))
    bits = np.asarray(x).view(np.uint16).astype(np.uint32)
    np.testing.assert_array_equal(u, bits[:, 0::2] | (bits[:, 1::2] << 16))
    assert bits_equal(echo4.from_pairs(jnp.asarray(u), jnp.bfloat16), x)
    w = np.arange(16, dtype=np.uint8).reshape(2, 8)
    np.testing.assert_array_equal(np.asarray(echo4.to_words(jnp.asarray(w))),
                                  w.view("<u4"))
    cfg = echo4.with_options(echo4.default_tiling(128, "compress"), pairs=True)
    assert echo4.with_options(cfg, lean=True) == echo4.EchoConfig(
        **{**vars(cfg), "lean": True})
    assert echo4.default_tiling(128, "compress") != echo4.with_options(
        echo4.default_tiling(128, "compress"))       # another static config, another jit


# -- error feedback fused into compress ---------------------------------------------------------
@pytest.mark.parametrize("name,b,dt", [("echo4", 128, "bf16"), ("int4-sym", 32, "f32")],
                         ids=case_id)
def test_compress_feedback_matches_unfused(name, b, dt):
    """One pass over x and r: the wire of x − r and the new residual decode − (x − r), bit
    for bit as compress then decompress then subtract (NaN groups: NaN residual)."""
    c, x = case(name, b, dt, echo_rows, n_rows_for(b), seed=1)
    n = x.shape[0]
    r = jnp.asarray(np.random.default_rng(2).standard_normal((n, b)).astype(np.float32) * .1)
    wk, ek = echo4.compress_feedback(x, r, c, interpret=INTERPRET)
    wr, er = _feedback_ref(x, r, c)
    assert bits_equal(wk, wr) and bits_equal(ek, er)
    ok = np.isfinite(np.asarray(x.astype(jnp.float32))).all(1)
    assert np.isnan(np.asarray(ek)[~ok]).all() and np.isfinite(np.asarray(ek)[ok]).all()


# -- reduce and decode_sum -----------------------------------------------------------------------
@pytest.mark.parametrize("name,b", [("echo4", 128), ("int4-sym", 64)], ids=case_id)
def test_reduce_matches_reference_bytes(name, b):
    """P = 3, me = 1: the slot of `me` holds 0xFF bytes (NaN scales) that must be ignored in
    favour of the exact own rows, read from row 3 of a longer array."""
    c = codecs.get(name, block_size=b)
    n, me, own_row0 = n_rows_for(b), 1, 3
    rng = np.random.default_rng(1)
    peers = [_compress_ref(jnp.asarray(echo_rows(n, b, "f32", seed=10 + k)[::-1].copy()), c)
             for k in range(3)]
    peers[me] = jnp.full_like(peers[me], 0xFF)
    recv = jnp.stack(peers)
    own = jnp.asarray(rng.standard_normal((n + 5, b)).astype(np.float32))
    wk = echo4.reduce(recv, own, me, c, interpret=INTERPRET, own_row0=own_row0)
    wr = _reduce_ref(recv, own, jnp.int32(me), c, own_row0)
    assert bits_equal(wk, wr)


@pytest.mark.parametrize("out", ["f32", "bf16"])
def test_decode_sum_matches_reference(out):
    c = codecs.get("echo4")
    n = n_rows_for(128)
    recv = jnp.stack([_compress_ref(jnp.asarray(echo_rows(n, 128, "f32", seed=k)), c)
                      for k in range(3)])
    got = echo4.decode_sum(recv, c, DTYPES[out], interpret=INTERPRET)
    assert bits_equal(got, _decode_sum_ref(recv, c, DTYPES[out]))


# -- dispatch and the collectives ---------------------------------------------------------------
def test_has_kernel_and_dispatch():
    """echo4 and int4-sym have kernels, tah4 not (its reference runs on every backend); the
    codec API on the kernel backend gives the reference backend's bytes and values."""
    assert codecs.get("echo4").has_kernel and codecs.get("int4-sym").has_kernel
    tah4 = codecs.get("tah4")
    assert not tah4.has_kernel and not echo4.covers(tah4)
    c = codecs.get("echo4")
    x = jnp.asarray(echo_rows(12, 128, "f32").reshape(-1)[:1500].reshape(3, 500))
    with taco_jax.config(backend=BACKEND):
        assert dispatch.backend_for(c) == BACKEND
        assert dispatch.backend_for(tah4) == "reference"
        enc = jax.jit(c.encode)(x)
        y = jax.jit(lambda e: c.decode(e))(enc)
        assert dispatch.impl_for("compress", c, (12, 128), jnp.float32) in ("interpret",
                                                                            "triton")
        with pytest.raises(ValueError, match="(?i)mosaic"):
            dispatch.compress(jnp.zeros((4, 128)), c, impl="mosaic")
    with taco_jax.config(backend="reference"):
        enc_r = jax.jit(c.encode)(x)
        y_r = jax.jit(lambda e: c.decode(e))(enc_r)
    assert bits_equal(enc.data, enc_r.data) and bits_equal(y, y_r)


def shard(p, fn, *xs, vma=True, out=P()):
    mesh = jax.make_mesh((p,), ("tp",), devices=jax.devices()[:p])
    args = [jax.device_put(jnp.asarray(v), NamedSharding(mesh, P("tp"))) for v in xs]
    f = jax.shard_map(fn, mesh=mesh, in_specs=P("tp"), out_specs=out, check_vma=vma)
    with jax.set_mesh(mesh):
        return jax.jit(f)(*args)


def two_shot_with_error(z, axis, codec, p: int, out_dtype):
    """The unfused step of error feedback, from the two-shot's halves: y, the compressed
    psum of the f32 z cast to out_dtype, and this device's error share e, Σ_devices e =
    y − Σ z: the first quantization of the segments it sent and the second of the one it
    owns (after the cast)."""
    blocks, nb = ts.segments(z, p, codec.block_size)
    me = lax.axis_index(axis)
    s_tilde, wire = ts.scatter_sum(blocks, nb, axis, codec, p)
    out = ts.gather_decoded(dispatch.compress(s_tilde, codec), axis, codec, p, out_dtype,
                            False)                                   # (rows, B)
    sent = dispatch.decompress(wire, codec, jnp.float32)
    own_err = lax.dynamic_slice_in_dim(out, me * nb, nb).astype(jnp.float32) - s_tilde
    err = lax.dynamic_update_slice_in_dim(sent - blocks, own_err, me * nb, 0)
    return codecs.from_blocks(out, z.shape), codecs.from_blocks(err, z.shape)


@pytest.mark.parametrize("p,dt", [(2, "bf16"), (4, "f32")], ids=case_id)
def test_feedback_step_unchanged_on_the_kernel_backend(p, dt):
    """feedback.allreduce on the kernel backend (fused compress_feedback) == the unfused
    step (`two_shot_with_error` of x − r, the reference codec): y and the new
    residual, on every device."""
    rng = np.random.default_rng(p)
    x = (rng.standard_normal((p, 5, 333)) * np.exp(rng.standard_normal((p, 5, 1))))
    x = jnp.asarray(x.astype(np.float32)).astype(DTYPES[dt])
    r = jnp.asarray(rng.standard_normal((p, 5, 333)).astype(np.float32) * 0.05)
    c = codecs.get("echo4")

    def fused(xb, rb):
        y, e = feedback.allreduce(xb[0], "tp", rb[0], codec="echo4", min_bytes=0)
        return y[None], e[None]

    def present(xb, rb):
        z = xb[0].astype(jnp.float32) - rb[0]
        y, e = two_shot_with_error(z, "tp", c, p, xb.dtype)
        return y[None], e[None]
    outs = {}
    for name, fn, backend in [("kernel", fused, BACKEND), ("fused_ref", fused, "reference"),
                              ("present", present, "reference")]:
        with taco_jax.config(backend=backend):
            outs[name] = shard(p, fn, x, r, vma=False, out=(P("tp"), P("tp")))
    for name in ("kernel", "fused_ref"):
        for got, want in zip(outs[name], outs["present"]):
            assert bits_equal(got, want), name
    y = np.asarray(outs["kernel"][0].astype(jnp.float32))
    assert all(np.array_equal(y[0], y[i]) for i in range(p))     # replicated


@pytest.mark.parametrize("vma", [
    pytest.param(True, marks=pytest.mark.skipif(
        INTERPRET, reason="Pallas' interpreter fails inside shard_map(check_vma=True) "
        "(dynamic_slice of a varying ref at an invariant index), the TACO kernels' too")),
    False])
def test_psum_and_feedback_grads_on_the_kernel_backend(vma):
    """Gradients through the collectives' custom_vjps (taco_jax.psum / pvary, and the
    feedback sites) on the kernel backend equal the reference backend's."""
    p = 4
    rng = np.random.default_rng(7)
    xs = jnp.asarray(rng.standard_normal((p, 6, 200)).astype(np.float32))
    c = jnp.asarray(rng.standard_normal((6, 200)).astype(np.float32))
    kw = dict(codec="echo4", min_bytes=0)

    def loss(b):
        u = 0.1 * lax.psum(b[0], "tp")                                # (6, 200) invariant
        st = feedback.zeros(u.shape, "tp")
        u1 = u2 = u
        if vma:
            u1 = taco_jax.pvary(u, "tp", **kw)
            u2, st = feedback.pvary_with_feedback(u, "tp", st, **kw)
        y = taco_jax.psum(jnp.sin(b[0]) * u1, "tp", **kw)
        y2, _ = feedback.psum_with_feedback(jnp.cos(b[0]) * u2, "tp", st, **kw)
        return jnp.sum(jnp.cos(y + y2) * c)

    def grad(backend):
        mesh = jax.make_mesh((p,), ("tp",), devices=jax.devices()[:p])
        f = jax.shard_map(loss, mesh=mesh, in_specs=P("tp"), out_specs=P(), check_vma=vma)
        with taco_jax.config(backend=backend), jax.set_mesh(mesh):
            args = jax.device_put(xs, NamedSharding(mesh, P("tp")))
            return np.asarray(jax.jit(jax.grad(f))(args))
    g_k, g_r = grad(BACKEND), grad("reference")
    assert np.isfinite(g_k).all() and np.abs(g_k).max() > 0
    np.testing.assert_array_equal(g_k, g_r)


def test_grads_under_the_check_vma_convention_emulated():
    """The check_vma=True rules (pvary's backward psum, the feedback sites' backward
    residual) on the kernel backend, emulated with jax.vmap (taco_jax.config(
    vmap_check_vma=True); the interpreter cannot run inside shard_map(check_vma=True)):
    the kernels run, and the gradients equal the reference backend's bit for bit."""
    p = 4
    rng = np.random.default_rng(8)
    xs = jnp.asarray(rng.standard_normal((p, 6, 200)).astype(np.float32))
    u = jnp.asarray(rng.standard_normal((6, 200)).astype(np.float32) * 0.1)
    c = jnp.asarray(rng.standard_normal((6, 200)).astype(np.float32))
    kw = dict(codec="echo4", min_bytes=0)

    def member(b, u):
        st = feedback.zeros(u.shape, "tp")
        u1 = taco_jax.pvary(u, "tp", **kw)
        u2, st = feedback.pvary_with_feedback(u, "tp", st, **kw)
        y = taco_jax.psum(jnp.sin(b) * u1, "tp", **kw)
        y2, _ = feedback.psum_with_feedback(jnp.cos(b) * u2, "tp", st, **kw)
        return jnp.sum(jnp.cos(y + y2) * c)

    def loss(xs, u):
        return jax.vmap(member, in_axes=(0, None), axis_name="tp")(xs, u)[0]
    grads = {}
    for backend in (BACKEND, "reference"):
        with taco_jax.config(backend=backend, vmap_check_vma=True):
            g = jax.grad(loss, (0, 1))
            assert ("pallas_call" in str(jax.make_jaxpr(g)(xs, u))) == (backend == BACKEND)
            grads[backend] = [np.asarray(v) for v in jax.jit(g)(xs, u)]
    for got, want in zip(grads[BACKEND], grads["reference"]):
        assert np.isfinite(got).all() and np.abs(got).max() > 0
        np.testing.assert_array_equal(got, want)


def test_one_shot_decode_sum_through_dispatch():
    """one_shot (the fused transport's P = 2 schedule) decodes with the echo4 decode_sum
    kernel: the same bits as the reference backend, on both devices."""
    rng = np.random.default_rng(9)
    x = jnp.asarray(rng.standard_normal((2, 7, 300)).astype(np.float32))
    c = codecs.get("echo4")
    outs = []
    for backend in (BACKEND, "reference"):
        with taco_jax.config(backend=backend):
            outs.append(np.asarray(shard(2, lambda b: ts.one_shot(b[0], "tp", c, 2, False)[None],
                                         x, vma=False, out=P("tp"))))
    assert bits_equal(outs[0], outs[1]) and np.array_equal(outs[0][0], outs[0][1])


# -- validation ----------------------------------------------------------------------------------
def test_wrappers_validate():
    c, taco = codecs.get("echo4"), codecs.get("taco")
    x = jnp.zeros((8, 128), jnp.float32)
    w = jnp.zeros((8, c.row_bytes), jnp.uint8)
    cases = [
        (lambda: echo4.compress(x, taco, interpret=True), ValueError, "not echo4"),
        (lambda: echo4.compress(x, codecs.get("tah4"), interpret=True), ValueError, "tah4"),
        (lambda: echo4.compress(x[:, :64], c, interpret=True), ValueError, "x.shape"),
        (lambda: echo4.compress(x.astype(jnp.int32), c, interpret=True), TypeError, "int32"),
        (lambda: echo4.compress_feedback(x.astype(jnp.int8), x, c, interpret=True), TypeError,
         "compress_feedback kernel: x has dtype int8"),
        (lambda: echo4.reduce(jnp.stack([w, w]), x.astype(bool), 0, c, interpret=True),
         TypeError, "reduce kernel: own has dtype bool"),
        (lambda: echo4.compress_feedback(x, x[:4], c, interpret=True), ValueError, "r.shape"),
        (lambda: echo4.compress_feedback(x, x.astype(jnp.bfloat16), c, interpret=True),
         TypeError, "residual"),
        (lambda: echo4.decompress(w[:, :70], c, interpret=True), ValueError, "w.shape"),
        (lambda: echo4.reduce(jnp.stack([w, w]), x[:4], 0, c, interpret=True), ValueError,
         "own.shape"),
        (lambda: echo4.decode_sum(w, c, interpret=True), ValueError, "recv.shape"),
        (lambda: echo4.default_config(128, "transpose"), ValueError, "transpose"),
        (lambda: echo4.default_tiling(128, "transpose"), ValueError, "transpose"),
    ]
    for i, (f, err, match) in enumerate(cases):
        with pytest.raises(err, match=match):
            f()
            pytest.fail(f"case {i} did not raise")


# -- Triton lowering for an H200, on CPU (conftest's h200 fixture) ----------------------------------
def lower(kernel, c, dt, cfg=None):
    n, b, sds = 100, c.block_size, jax.ShapeDtypeStruct
    wire = sds((n, c.row_bytes), jnp.uint8)
    fns = {
        "compress": (lambda x, s: echo4.compress(x, c, cfg, skip_start=s, skip_rows=8),
                     sds((n, b), dt), sds((), jnp.int32)),
        "compress_feedback": (lambda x, r: echo4.compress_feedback(x, r, c, cfg),
                              sds((n, b), dt), sds((n, b), jnp.float32)),
        "decompress": (lambda w: echo4.decompress(w, c, dt, cfg), wire),
        "reduce": (lambda r, x, me: echo4.reduce(r, x, me, c, cfg, own_row0=me),
                   sds((2, n, c.row_bytes), jnp.uint8), sds((2 * n, b), dt),
                   sds((), jnp.int32)),
        "decode_sum": (lambda r: echo4.decode_sum(r, c, dt, cfg), sds((2, n, c.row_bytes),
                                                                      jnp.uint8)),
    }
    f, *args = fns[kernel]
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("name,b,dt", [("echo4", 128, jnp.bfloat16), ("int4-sym", 32,
                                                                       jnp.float32)],
                         ids=lambda v: getattr(v, "__name__", case_id(v)))
@pytest.mark.parametrize("kernel", ["compress", "compress_feedback", "decompress", "reduce",
                                    "decode_sum"])
def test_lowers_to_one_triton_call(h200, kernel, name, b, dt):
    text = lower(kernel, codecs.get(name, block_size=b), dt)
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert f'name = "echo4_{kernel}"' in text
    if kernel in ("compress", "compress_feedback", "reduce"):   # the encode's PTX
        assert "mul.rn.f32" in text and "rcp.approx.f32" in text


@pytest.mark.parametrize("name,b,dt", [("echo4", 128, jnp.bfloat16), ("echo4", 64, jnp.float16),
                                       ("int4-sym", 32, jnp.float32)],
                         ids=lambda v: getattr(v, "__name__", case_id(v)))
@pytest.mark.parametrize("kernel", ["compress", "compress_feedback", "decompress", "reduce",
                                    "decode_sum"])
def test_variants_lower_to_one_triton_call(h200, kernel, name, b, dt):
    """All variants lower for an H200: one Triton call, no split or join of
    16-bit data (16-bit outputs leave through cvt.rn.*x2.f32 pairs), the encode's PTX."""
    cfg = echo4.with_options(echo4.default_tiling(b, kernel if kernel in (
        "decompress", "reduce", "decode_sum") else "compress"), **ALL_VARIANTS)
    text = lower(kernel, codecs.get(name, block_size=b), dt, cfg)
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert f'name = "echo4_{kernel}"' in text
    if kernel in ("compress", "compress_feedback", "reduce"):
        assert "mul.rn.f32" in text and "rcp.approx.f32" in text
    if kernel in ("decompress", "decode_sum"):
        assert ("x2.f32" in text) == (dt != jnp.float32)


@pytest.mark.parametrize("kernel", ["compress", "compress_feedback"])
def test_prefetched_loop_lowers_to_one_triton_call(h200, kernel):
    """prefetch under a looping tiling (the loop it changes), all variants: one Triton call
    for an H200, the encode's PTX."""
    from taco_jax.kernels.triton import tiling
    cfg = echo4.with_options(tiling.KernelConfig(blocks_per_program=4, num_warps=1,
                                                 num_stages=3, tiles_per_program=4),
                             **ALL_VARIANTS)
    c, n, sds = codecs.get("echo4"), 100, jax.ShapeDtypeStruct
    f = {"compress": lambda x, r: echo4.compress(x, c, cfg),
         "compress_feedback": lambda x, r: echo4.compress_feedback(x, r, c, cfg)}[kernel]
    text = jax.jit(f).trace(sds((n, 128), jnp.bfloat16), sds((n, 128), jnp.float32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert f'name = "echo4_{kernel}"' in text
    assert "mul.rn.f32" in text and "rcp.approx.f32" in text


def test_default_tilings_by_size():
    """Up to 16 MiB of bf16 compress and reduce loop one warp over 512-element tiles; up to
    64 MiB 2048-element tiles, 4 warps; above the measured large-input tilings (reduce
    loops one-warp tiles; compress and decode_sum 2 tiles of 2048 elements; decompress
    8192-element tiles)."""
    tiny, mid = 1024, echo4.MID_ELEMENTS // 128
    small, big = echo4.SMALL_ELEMENTS // 128, mid + 1
    shape = lambda c: (c.blocks_per_program, c.num_warps, c.tiles_per_program)
    for k in ("compress", "decompress", "reduce", "decode_sum"):
        assert shape(echo4.default_config(128, k, mid)) == (16, 4, 1)
        assert shape(echo4.default_config(128, k)) == (16, 4, 1)
    for n in (tiny, small):
        assert shape(echo4.default_config(128, "compress", n)) == (4, 1, 4)
        assert shape(echo4.default_config(128, "reduce", n)) == (4, 1, 2)
        assert shape(echo4.default_config(128, "decompress", n)) == (16, 4, 1)
        assert shape(echo4.default_config(128, "decode_sum", n)) == (16, 4, 1)
    assert shape(echo4.default_config(128, "compress", small + 1)) == (16, 4, 1)
    assert echo4.default_config(128, "decompress", big).blocks_per_program == 64
    assert shape(echo4.default_config(128, "reduce", big)) == (8, 1, 8)
    for k in ("compress", "decode_sum"):
        assert shape(echo4.default_config(128, k, big)) == (16, 4, 2)
    assert echo4.default_config(512, "compress", big).blocks_per_program == 4
    assert echo4.default_config(512, "compress", tiny).blocks_per_program == 1


def test_default_configs_carry_the_measured_variants():
    """Each kernel runs with the tile-math variants measured fastest for it (the kernels
    called without a config in this file run them, against the references)."""
    for k, opts in echo4.MEASURED_VARIANTS.items():
        cfg = echo4.default_config(128, k, 1024)
        assert isinstance(cfg, echo4.EchoConfig)
        assert {o: getattr(cfg, o) for o in opts} == opts
        assert echo4.with_options(cfg, pairs=False, lean=False, scale_words=False,
                                  scale_columns=False, merged_rows=False,
                                  word_stores=False, int_stats=False,
                                  prefetch=False) == echo4.with_options(
            echo4.default_tiling(128, k, 1024))
    assert echo4.default_config(128, "compress").pairs
    assert not echo4.default_config(128, "compress").scale_columns     # costs compress
    assert not echo4.default_config(128, "compress").word_stores       # costs compress
    assert echo4.default_config(128, "reduce").word_stores
    # prefetch up to 16 MiB of bf16 only (it measured slower at 256 MiB)
    big = echo4.MID_ELEMENTS // 128 + 1
    assert echo4.default_config(128, "compress", 1024).prefetch
    assert not echo4.default_config(128, "compress", big).prefetch
    assert echo4.default_config(128, "compress", big).int_stats


@pytest.mark.parametrize("op", ["psum", "psum_with_feedback"])
def test_collectives_pick_the_echo4_kernels_on_gpu(h200_mesh, op):
    """On the GPU path (backend "pallas"), lowered for CUDA from this CPU machine: the
    two-shot psum runs echo4's compress, reduce and decompress kernels; the feedback step
    its fused compress_feedback (and compress, decompress for the owner's unfused step)."""
    p = 2
    mesh = h200_mesh((p,), ("tp",))

    def body(v):
        if op == "psum":
            return taco_jax.psum(v[0], "tp", codec="echo4", min_bytes=0)[None]
        y, st = feedback.psum_with_feedback(v[0], "tp", feedback.zeros(v.shape[1:], "tp"),
                                            codec="echo4", min_bytes=0)
        return (y + st.residual)[None]
    f = jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False)
    x = jax.ShapeDtypeStruct((p, 8, 512), jnp.bfloat16,
                             sharding=jax.NamedSharding(mesh, P("tp")))
    with taco_jax.config(backend="pallas"), jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(f).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    names = {"psum": ["echo4_compress", "echo4_reduce", "echo4_decompress"],
             "psum_with_feedback": ["echo4_compress_feedback", "echo4_compress",
                                    "echo4_decompress"]}[op]
    for name in names:
        assert f'name = "{name}"' in text, name
    assert 'name = "taco_' not in text                      # no TACO kernel
