"""The codec layer (`taco_jax.codecs`) against an independent numpy implementation of the
paper's equations (tests/numpy_taco.py), plus properties (hypothesis), the error ordering
between codecs, bad inputs and the identity codec.

Everything here runs on the dispatcher's CPU default, the jnp references; the Pallas
kernels are compared with those references in tests/kernels/test_triton_taco.py. XLA compiles are the
cost on CPU (~0.5 s per codec and shape), so comparisons share one jitted call per block
size and dtype, and the value-range properties run on one fixed shape.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

import numpy_taco as nt
import taco_jax
from taco_jax import codecs
from taco_jax.kernels import dispatch
from taco_jax.numerics import hadamard

LOSSY = tuple(nt.SPECS)                        # the seven lossy codecs of the issue
ALL = LOSSY + ("none",)
BLOCK_SIZES = (32, 64, 128, 256, 512)
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
UNIT_ROUNDOFF = {"f32": 2.0 ** -24, "bf16": 2.0 ** -8, "f16": 2.0 ** -11}
SCALE_RTOL = 1e-6      # s and α of the library (f32) vs numpy (f64): a few f32 ulp
# Relative L2 error a codec may have on any data (measured ≈ 0.026 e4m3, 0.052 e5m2,
# 0.007 int8 on Gaussian blocks; the bound leaves room for heavy tails and bf16 output).
REL_L2_BOUND = {"e4m3": 0.1, "e5m2": 0.15, "int8": 0.1}
HYP = dict(deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


def f64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def is_block_codec(name: str) -> bool:
    return name in nt.SPECS and not nt.SPECS[name].per_tensor


# -- the numpy reference itself -------------------------------------------------------------
def test_numpy_fp8_grids_match_ml_dtypes():
    """The reference's hand-written FP8 bit decoding and grid rounding agree with ml_dtypes
    (a third implementation) on every byte and on 10⁵ random values across 20 binades."""
    rng = np.random.default_rng(0)
    for fmt, dt in [(nt.E4M3, ml_dtypes.float8_e4m3fn), (nt.E5M2, ml_dtypes.float8_e5m2)]:
        every = np.arange(256, dtype=np.uint8)
        np.testing.assert_array_equal(nt.decode_code_bytes(every, fmt),
                                      every.view(dt).astype(np.float64))
        y = rng.uniform(-fmt.qmax, fmt.qmax, 100_000) * np.exp(rng.uniform(-20, 0, 100_000))
        y = y.astype(np.float32).astype(np.float64)
        np.testing.assert_array_equal(nt.round_to_grid(y, fmt),
                                      y.astype(np.float32).astype(dt).astype(np.float64))
    every = np.arange(256, dtype=np.uint8)
    np.testing.assert_array_equal(nt.decode_code_bytes(every, nt.INT8), every.view(np.int8))


@pytest.mark.parametrize("b", BLOCK_SIZES, ids=lambda b: f"B{b}")
def test_numpy_hadamard_wire_order(b):
    """The two statements of the wire order agree (stored[j·r+m] = (H_B x/√B)[m·c+j] and
    Zᵀ of Z = H_r X H_c/√B), the transform is orthonormal, and taco_jax.hadamard uses it."""
    x = np.random.default_rng(b).standard_normal((3, b))
    r, c = nt.factors(b)
    assert (r, c) == hadamard.factors(b)
    hr, hc = nt.sylvester(r), nt.sylvester(c)
    zt = np.stack([(hr @ blk.reshape(r, c) @ hc).T.reshape(-1) for blk in x]) / np.sqrt(b)
    z = nt.hadamard(x)
    np.testing.assert_allclose(z, zt, atol=1e-12)
    np.testing.assert_allclose(np.linalg.norm(z, axis=1), np.linalg.norm(x, axis=1))
    np.testing.assert_allclose(nt.inverse_hadamard(z), x, atol=1e-12)
    xj = jnp.asarray(x, jnp.float32)
    np.testing.assert_allclose(np.asarray(hadamard.forward(xj)), z, rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(hadamard.inverse(jnp.asarray(z, jnp.float32))), x,
                               rtol=0, atol=1e-5)


# -- every codec vs the numpy reference ------------------------------------------------------
SHAPE = (37, 129)          # 4773 elements: no block size divides it, so the last block pads


def mixed_data(shape=SHAPE, seed=0) -> np.ndarray:
    """Heavy-tailed (Student-t, 3 dof) values with per-100-element scales e^{1.5·N}, one
    all-zero and one constant region (block-aligned for every B ≤ 512), clipped into f16."""
    rng = np.random.default_rng(seed)
    n = math.prod(shape)
    x = rng.standard_t(3, n) * np.repeat(np.exp(1.5 * rng.standard_normal(n // 100 + 1)), 100)[:n]
    x[:512] = 0.0
    x[512:1024] = 3.0
    return np.clip(x, -3e4, 3e4).reshape(shape)


@functools.lru_cache(maxsize=None)
def library_outputs(b: int, dt: str):
    """(input as float64, {codec: (wire data, decoded)}) for all lossy codecs, one jit."""
    x = jnp.asarray(mixed_data()).astype(DTYPES[dt])
    cs = [codecs.get(n, block_size=b) for n in LOSSY]

    @jax.jit
    def run(x):
        out = {}
        for c in cs:
            enc = c.encode(x)
            out[c.name] = (enc.data, c.decode(enc))
        return out
    return f64(x), jax.device_get(run(x))


def decode_f32_roundoff(b: int) -> float:
    """Normwise relative error bound of the f32 decode of one block: one rounding for q·s,
    one for √B and one for 1/α; the inverse transform is two ±1 matmuls with inner sizes
    r and c (B = r·c), each with error ≤ γ_k·(|H||z|) per element, ≤ k^{3/2}·u normwise
    relative to ‖Hz‖ = √k‖z‖ (any summation order)."""
    r, c = nt.factors(b)
    return (r ** 1.5 + c ** 1.5 + 3) * UNIT_ROUNDOFF["f32"]


NUMPY_CASES = ([(n, b, "f32") for n in LOSSY for b in BLOCK_SIZES]
               + [(n, 256, d) for n in LOSSY for d in ("bf16", "f16")])


@pytest.mark.parametrize("name,b,dt", NUMPY_CASES, ids=lambda v: str(v) if not isinstance(
    v, int) else f"B{v}")
def test_codec_matches_numpy(name, b, dt):
    """Wire layout, scales (eqs. 7, 9), codes (eq. 10) and decode (eqs. 11–13) vs numpy.

    Scales agree to a few fp32 ulp; codes agree except at rounding ties (the library works
    in fp32, numpy in fp64), each tie one grid step; decode of the library's own wire agrees
    to fp32 rounding, and the whole roundtrip to the tie level."""
    x, out = library_outputs(b, dt)
    data, dec = out[name]
    spec = nt.SPECS[name]
    n_blocks = -(-x.size // b)
    assert data.dtype == np.uint8 and data.shape == (n_blocks, b + 4 * spec.n_scales)
    assert dec.shape == x.shape and dec.dtype == DTYPES[dt]

    codes, s, alpha = nt.parse_wire(data, name, b)
    ref = nt.encode(x, name, b)
    np.testing.assert_allclose(s, ref.s, rtol=SCALE_RTOL, err_msg="scale s (eq. 9)")
    if spec.per_tensor:
        assert np.all(s == s[0]), "per-tensor codec must repeat one scale in every row"
    if spec.transform == "ash":
        np.testing.assert_allclose(alpha, ref.alpha, rtol=SCALE_RTOL, err_msg="alpha (eq. 7)")

    diff = nt.code_mismatches(codes, ref.codes, spec.fmt)
    assert diff.mean() <= 1e-3, f"{diff.sum()} codes differ ({diff.mean():.2e})"
    if diff.any():   # each must be a tie: fp64 y within 1e-5·Qmax of the grid midpoint
        lo, hi = nt.grid_neighbours(ref.y[diff], spec.fmt)
        gap = np.abs(ref.y[diff] - (lo + hi) / 2)
        assert np.all(gap <= 1e-5 * spec.fmt.qmax), f"non-tie code differences: {gap.max()}"

    want = nt.decode_wire(data, name, b, x.shape)
    tol = UNIT_ROUNDOFF[dt] * np.abs(want) + 1e-6 * np.max(np.abs(want))
    bad = np.abs(f64(dec) - want) > tol
    assert not bad.any(), f"decode differs at {bad.sum()} positions, max {np.max(np.abs(f64(dec) - want))}"
    rt = nt.roundtrip(x, name, b)
    # The library's roundtrip differs from numpy's by: the codes flipped at ties (checked
    # above), each one grid step at numpy's s/α, whose error is exactly the decode of the
    # code difference (eqs. 11-13 are linear in the codes); s and α within SCALE_RTOL;
    # decode in f32; rounding to the output dtype. The arithmetic of the f32 version (ties
    # aside) is ~1e-7 on this data; one flipped tie can cost 1e-4 by itself.
    ties = np.linalg.norm(nt.decode(np.where(diff, codes - ref.codes, 0.0), ref.s, ref.alpha,
                                    name, x.shape))
    rel_bound = 2 * SCALE_RTOL + decode_f32_roundoff(b) + UNIT_ROUNDOFF[dt]
    err = np.linalg.norm(f64(dec) - rt)
    assert err <= ties + rel_bound * np.linalg.norm(rt), (err, ties, rel_bound)
    assert nt.rel_l2(f64(dec), x) <= REL_L2_BOUND[spec.fmt.name]


def test_registry_names_and_layout():
    """Every codec of the issue is registered, with the row layout of the wire format."""
    assert set(ALL) <= set(codecs.names())
    for name in LOSSY:
        for b in BLOCK_SIZES:
            c = codecs.get(name, block_size=b)
            assert c.block_size == b and c.name == name
            assert c.row_bytes == b + 4 * nt.SPECS[name].n_scales
            assert c.qmax == nt.SPECS[name].fmt.qmax
    assert codecs.get("taco").block_size == 256                   # paper's best B
    assert codecs.get("none").row_bytes == 4 * codecs.get("none").block_size


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("n", [1, 255, 256, 257, 3 * 256], ids=lambda n: f"n{n}")
def test_wire_shape_and_bytes(name, n):
    c = codecs.get(name)
    enc = jax.eval_shape(c.encode, jax.ShapeDtypeStruct((n,), jnp.bfloat16))
    assert enc.data.shape == (-(-n // 256), c.row_bytes) and enc.data.dtype == jnp.uint8
    assert c.wire_bytes(n) == math.prod(enc.data.shape)


@pytest.mark.parametrize("name", ["taco", "none"])
def test_wire_bytes_of_empty_tensor(name):
    c = codecs.get(name)
    enc = jax.eval_shape(c.encode, jax.ShapeDtypeStruct((0, 5), jnp.float32))
    assert c.wire_bytes(0) == math.prod(enc.data.shape)


# -- properties ----------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def jit_roundtrip(name: str):
    """Jitted roundtrip of one codec (compiled once per shape and dtype)."""
    return jax.jit(codecs.get(name).roundtrip)


def check_poison(name, clean_out, poisoned_out, flat_index, b):
    """A non-finite input poisons its block (per-tensor codecs: the tensor); it never comes
    out finite, and blocks it does not belong to are unchanged."""
    po, co = f64(poisoned_out).reshape(-1), f64(clean_out).reshape(-1)
    blk = slice(flat_index // b * b, flat_index // b * b + b)
    if name == "none":
        assert not np.isfinite(po[flat_index])
        return
    assert not np.isfinite(po[blk]).any(), "finite values decoded from a poisoned block"
    if is_block_codec(name):
        keep = np.ones(po.size, bool)
        keep[blk] = False
        np.testing.assert_array_equal(po[keep], co[keep])
    else:
        assert not np.isfinite(po).any()


@given(name=st.sampled_from(ALL), dt=st.sampled_from(tuple(DTYPES)),
       shape=st.lists(st.integers(0, 45), max_size=3).map(tuple),
       seed=st.integers(0, 2 ** 16), poison=st.sampled_from([np.nan, np.inf, -np.inf]),
       where=st.floats(0, 1, exclude_max=True))
@settings(max_examples=12, **HYP)
def test_random_shapes(name, dt, shape, seed, poison, where):
    """Any shape (0-size, scalars, odd sizes) and dtype: shape and dtype preserved, the
    padding never leaks (result agrees with numpy, which pads on its own), bounded error,
    zeros stay exact zeros, and a NaN/Inf poisons its block but never becomes finite."""
    b, n = 256, math.prod(shape)
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal(shape) * np.exp(rng.uniform(-3, 3))).astype(DTYPES[dt])
    k = int(where * n)
    poisoned = x.reshape(-1).at[k].set(poison).reshape(shape) if n else x
    rt = jit_roundtrip(name)
    out, zero_out, poisoned_out = rt(x), rt(jnp.zeros_like(x)), rt(poisoned)
    for y in (out, zero_out, poisoned_out):
        assert y.shape == shape and y.dtype == DTYPES[dt]
    assert np.all(f64(zero_out) == 0)
    xs = f64(x)
    if name == "none":
        np.testing.assert_array_equal(f64(out), xs)
    else:
        assert np.isfinite(f64(out)).all()
        assert nt.rel_l2(f64(out), nt.roundtrip(xs, name, b)) <= 1e-4 + UNIT_ROUNDOFF[dt]
        assert nt.rel_l2(f64(out), xs) <= REL_L2_BOUND[nt.SPECS[name].fmt.name]
    if n:
        check_poison(name, out, poisoned_out, k, b)


RANGE_SHAPE = (3, 200)     # 600 elements = blocks [0, 256), [256, 512), [512, 600) + padding


def range_data(kind: str, rng) -> np.ndarray:
    n = math.prod(RANGE_SHAPE)
    if kind == "gauss":
        x = rng.standard_normal(n)
    elif kind == "student_t2":
        x = rng.standard_t(2, n)
    elif kind == "row_scaled":                # 64-element rows with scales e^{3·N}
        x = rng.standard_normal(n) * np.repeat(np.exp(3 * rng.standard_normal(n // 64 + 1)), 64)[:n]
    elif kind == "sparse":
        x = np.where(rng.random(n) < 0.02, rng.standard_normal(n), 0.0)
    else:                                     # "const_noise"
        x = 1.0 + 0.01 * rng.standard_normal(n)
    return x.reshape(RANGE_SHAPE)


@functools.lru_cache(maxsize=None)
def all_codecs_roundtrip():
    cs = [codecs.get(n) for n in ALL]
    return jax.jit(lambda a: {c.name: c.roundtrip(a) for c in cs})


@pytest.mark.parametrize("dt,decades", [("f32", 30), ("bf16", 30), ("f16", 2)],
                         ids=["f32", "bf16", "f16"])
@settings(max_examples=25, **HYP)
@given(data=st.data())
def test_value_range(dt, decades, data):
    """Scales 10^±30 (f16: 10^±2, its range) on five distributions, all codecs: finite
    output with bounded relative error, an all-zero block decodes to exact zeros, and a
    NaN/±Inf poisons its block (per-tensor codecs: the tensor), never silently finite."""
    kind = data.draw(st.sampled_from(["gauss", "student_t2", "row_scaled", "sparse",
                                      "const_noise"]), "kind")
    log_scale = data.draw(st.floats(-decades, decades), "log10 scale")
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 16), "seed"))
    x = range_data(kind, rng) * 10.0 ** log_scale
    if data.draw(st.booleans(), "zero block"):
        x.reshape(-1)[256:512] = 0.0
    xj = jnp.asarray(x, jnp.float32).astype(DTYPES[dt])
    assume(np.isfinite(f64(xj)).all() and np.any(f64(xj) != 0))
    k = data.draw(st.integers(0, x.size - 1), "poison index")
    poison = data.draw(st.sampled_from([np.nan, np.inf, -np.inf]), "poison")
    pj = xj.reshape(-1).at[k].set(poison).reshape(RANGE_SHAPE)
    xs = f64(xj)
    clean, poisoned = all_codecs_roundtrip()(xj), all_codecs_roundtrip()(pj)
    for name, out in clean.items():
        poisoned_out = poisoned[name]
        assert out.shape == RANGE_SHAPE and out.dtype == DTYPES[dt], name
        y = f64(out)
        if name == "none":
            np.testing.assert_array_equal(y, xs)
            continue
        assert np.isfinite(y).all(), name
        err = nt.rel_l2(y, xs)
        assert err <= REL_L2_BOUND[nt.SPECS[name].fmt.name], (name, err)
        for blk in range(0, xs.size, 256):          # all-zero blocks: exact zeros
            if np.all(xs.reshape(-1)[blk:blk + 256] == 0):
                assert np.all(y.reshape(-1)[blk:blk + 256] == 0), f"{name}: zero block"
        check_poison(name, out, poisoned_out, k, 256)


# -- error ordering ------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def encode_decode_all():
    cs = [codecs.get(n) for n in LOSSY]

    def run(a):
        encs = {c.name: c.encode(a) for c in cs}
        return {n: (e.data, codecs.get(n).decode(e)) for n, e in encs.items()}
    return jax.jit(run)


@functools.lru_cache(maxsize=None)
def errors(kind: str):
    """(data, {codec: (wire, roundtrip)}) for a fixed-seed 256 × 1024 data set, float64."""
    rng = np.random.default_rng(0)
    if kind == "row_scaled":       # standard normal rows × e^{3·N} row scales
        x = rng.standard_normal((256, 1024)) * np.exp(3 * rng.standard_normal((256, 1)))
    elif kind == "const_noise":    # constant + 1% noise
        x = 3.0 + 0.03 * rng.standard_normal((256, 1024))
    elif kind == "gauss":
        x = rng.standard_normal((256, 1024))
    else:                          # "student_t3"
        x = rng.standard_t(3, (256, 1024))
    xj = jnp.asarray(x, jnp.float32)
    out = jax.device_get(encode_decode_all()(xj))
    return f64(xj), {k: (w, np.asarray(y, np.float64)) for k, (w, y) in out.items()}


def rel(kind, name) -> float:
    x, out = errors(kind)
    return nt.rel_l2(out[name][1], x)


def row_rel(kind, name) -> np.ndarray:
    x, out = errors(kind)
    return np.linalg.norm(out[name][1] - x, axis=1) / np.linalg.norm(x, axis=1)


def test_error_ordering_heavy_tailed_rows():
    """Rows of N(0,1) × e^{3·N} row scales (256 × 1024, seed 0).

    Per row, per-block scaling wins by far: taco's mean per-row relative error is 0.026
    while "fp8"'s one tensor-wide scale pushes small rows into the FP8 subnormals or to zero
    (mean 0.13, worst rows lost entirely). In the *global* relative L2 error the large rows
    dominate and both sit at the e4m3 level (measured taco 0.0264 vs fp8 0.0261 here; over
    seeds 0–2 the sign of the difference flips), so no global ordering is asserted."""
    assert row_rel("row_scaled", "taco").mean() < 0.35 * row_rel("row_scaled", "fp8").mean()
    assert row_rel("row_scaled", "taco").max() < 0.04
    assert row_rel("row_scaled", "fp8").max() > 0.5            # whole rows flushed to zero
    for name in ("taco", "fp8"):
        assert 0.02 < rel("row_scaled", name) < 0.032
    assert row_rel("row_scaled", "block-fp8").mean() < 0.35 * row_rel("row_scaled", "fp8").mean()


def test_error_ordering_structured():
    """Constant + 1% noise: the Hadamard turns a block into one large DC coefficient and
    small ones; e4m3's floating grid keeps the small ones, int8's uniform grid (step =
    max/127) rounds them to zero. Measured: taco 0.0003 < taco-int8 0.0100 < fp8 0.028, and
    per-block beats per-tensor scaling after the transform (hadamard-fp8 0.0024)."""
    taco, int8, fp8 = (rel("const_noise", n) for n in ("taco", "taco-int8", "fp8"))
    assert taco < 0.1 * int8 and int8 < 0.5 * fp8
    assert taco < 0.5 * rel("const_noise", "hadamard-fp8")
    assert rel("const_noise", "taco-e5m2") < 0.1 * int8


@pytest.mark.parametrize("kind", ["gauss", "student_t3"])
def test_int8_beats_fp8_codes_on_iid_data(kind):
    """The opposite ordering holds on i.i.d. data: after the Hadamard a block is Gaussian
    with a small dynamic range, where int8's 254 uniform levels beat e4m3's 3 mantissa bits
    (measured taco-int8 0.007 vs taco 0.026). So "taco below taco-int8" is a property of
    high-dynamic-range (structured) blocks only, not of heavy-tailed data in general."""
    assert rel(kind, "taco-int8") < 0.4 * rel(kind, "taco")
    assert 0.02 < rel(kind, "taco") < 0.03


def test_alpha_cancels_with_block_absmax():
    """With per-block absmax scaling α cancels in exact arithmetic, so
    "taco" and "taco-1scale" emit the same codes except for fp32 rounding ties."""
    out = errors("student_t3")[1]
    a, b = out["taco"][0][:, :256], out["taco-1scale"][0][:, :256]
    assert np.mean(a != b) < 1e-4
    assert abs(rel("student_t3", "taco") / rel("student_t3", "taco-1scale") - 1) < 1e-3


# -- the identity codec ----------------------------------------------------------------------
@pytest.mark.parametrize("dt", tuple(DTYPES))
def test_none_is_exact(dt):
    x = np.array([0.0, -0.0, 1.5, -3.25e4, np.nan, np.inf, -np.inf, 1e-7, 6e4], np.float32)
    xj = jnp.asarray(np.tile(x, 40)[:357]).astype(DTYPES[dt])
    c = codecs.get("none")
    for y in (c.roundtrip(xj), c.decode(c.encode(xj))):
        assert y.dtype == xj.dtype and y.shape == xj.shape
        np.testing.assert_array_equal(np.asarray(y).view(np.uint16 if dt != "f32" else np.uint32),
                                      np.asarray(xj).view(np.uint16 if dt != "f32" else np.uint32))


# -- bad inputs ------------------------------------------------------------------------------
def test_unknown_codec_name():
    with pytest.raises(ValueError, match="'tacoo'"):
        codecs.get("tacoo")


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("bad", [16, 48, 100, 1024, 0, -256, "256"], ids=repr)
def test_bad_block_size(name, bad):
    with pytest.raises(ValueError, match="block_size"):
        codecs.get(name, block_size=bad)


def test_float_block_size_is_rejected_or_works():
    try:
        c = codecs.get("taco", block_size=256.0)
    except (TypeError, ValueError):
        return
    assert c.roundtrip(jnp.ones(300)).shape == (300,)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("dt", [jnp.int32, jnp.int8, jnp.uint8, jnp.bool_, jnp.complex64],
                         ids=lambda d: np.dtype(d).name)
def test_non_float_input(name, dt):
    c = codecs.get(name)
    for fn in (c.encode, c.roundtrip):
        with pytest.raises(TypeError, match=np.dtype(dt).name):
            fn(jnp.zeros((4, 3), dt))


def test_bad_codec_fields():
    for field, value in [("transform", "fft"), ("scale_mode", "row"), ("fmt", "e3m4")]:
        with pytest.raises(ValueError, match=field):
            codecs.BlockCodec(name="x", **{field: value})


@pytest.mark.parametrize("name", ALL)
def test_get_passes_codec_objects_through(name):
    c = codecs.get(codecs.get(name), block_size=128)
    assert c.block_size == 128 and c.name == name


@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_decode_rejects_another_codecs_buffer(backend):
    """Decoding a 1-scale buffer (260-byte rows) as "taco" (264) must fail loudly, on every
    backend, instead of returning garbage."""
    x = jnp.ones((2, 256), jnp.float32)
    enc = codecs.get("taco-1scale").encode(x)
    with taco_jax.config(backend=backend), pytest.raises(ValueError, match="260|row"):
        jax.eval_shape(codecs.get("taco").decode, enc)      # validation needs no compile


# -- gradients ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name,backend", [
    ("taco", "reference"), ("fp8", "reference"), ("taco", "interpret")])
def test_grad_of_roundtrip_is_clear(name, backend):
    """jax.grad through codec.roundtrip must either raise a clear error or give a defined
    gradient; "none" gives the identity (straight-through), so a lossy codec should too.
    A silent zero is neither."""
    c = codecs.get(name)
    x = jnp.linspace(-1.0, 2.0, 512, dtype=jnp.float32)
    w = jnp.cos(jnp.arange(512, dtype=jnp.float32))
    try:
        with taco_jax.config(backend=backend):
            g = jax.jit(jax.grad(lambda v: jnp.sum(c.roundtrip(v) * w)))(x)
    except (TypeError, ValueError, NotImplementedError) as e:
        assert "grad" in str(e).lower() or "differentia" in str(e).lower(), e
        return
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)


def test_grad_of_none_is_identity():
    w = jnp.cos(jnp.arange(300, dtype=jnp.float32))
    g = jax.grad(lambda v: jnp.sum(codecs.get("none").roundtrip(v) * w))(jnp.ones(300))
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_numpy_integer_block_size_is_accepted():
    assert codecs.get("taco", block_size=np.int64(256)).block_size == 256


def test_large_finite_inputs_stay_finite():
    x = jnp.asarray(range_data("gauss", np.random.default_rng(0)) * 1e37, jnp.float32)
    assert np.isfinite(f64(x)).all()
    bad = [n for n, y in all_codecs_roundtrip()(x).items() if not np.isfinite(f64(y)).all()]
    assert not bad, f"finite input decoded to non-finite values by {bad}"


@pytest.mark.parametrize("name", [n for n in codecs.names() if n != "none"])
def test_reference_wire_is_sealed_against_convert_folding(name):
    """On GPU, XLA folds decode(encode(x)) of the plain-XLA path down to f32 → f8 → f32 and
    then drops that convert pair (simplify-fp-conversions): the H200 fidelity run measured
    `fp8` error 0. The reference compress must end in an optimization barrier so the codes
    stay opaque; the CPU compiler has no such pass, so the jaxpr is what can be checked here."""
    codec = codecs.get(name)
    x = jnp.linspace(-3.0, 3.0, 4 * codec.block_size).reshape(4, -1)
    with taco_jax.config(backend="reference"):
        jaxpr = jax.make_jaxpr(lambda v: codec.decode(codec.encode(v)))(x)
    prims = [e.primitive.name for e in jaxpr.jaxpr.eqns]
    assert "optimization_barrier" in prims, prims
    # and what crosses the barrier is the uint8 wire, not the float values
    barrier = next(e for e in jaxpr.jaxpr.eqns if e.primitive.name == "optimization_barrier")
    assert [v.aval.dtype for v in barrier.outvars] == [jnp.uint8]
