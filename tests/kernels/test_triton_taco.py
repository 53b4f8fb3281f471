"""The fused Pallas kernels (compress, decompress, reduce) against their jnp references.

On CPU the kernels run through Pallas' interpreter (slow: sizes here are a few hundred
blocks, 2–3 tiles plus a partial one, so the masked tail is exercised); on a GPU the same
tests run the compiled kernels. A second group lowers every kernel × codec × block size to
Triton for an H200 on CPU, which catches primitives Triton cannot lower without a GPU.

Tolerances. The kernels do the Hadamard as ±1 bf16 tensor-core dots with fp32 accumulation;
`precise` adds a second dot for the bf16 residual (≈16 mantissa bits), and resolves to True
for data wider than bf16. So:
  * f32/f16 data: codes equal except rounding ties (measured ≤ 0.08% on H200, ~0.02% in the
    interpreter), each one grid step; decoded values within 1e-6 of the block's max.
  * bf16 data on the Kronecker path (B ≥ 256): the transform's intermediate is rounded to
    bf16 once (precise resolves to False): measured 5–6% of codes off, scales within 2e-3,
    decoded within ~1e-2 relative L2 — about +0.1 percentage point of FP8 error. The
    rounding error is absolute (~2^-9 of the block's scale), so codes much smaller than the
    block max can move by several of their own steps (measured ≤ Qmax/300).
  * bf16 data on the dense path (B < 256): one exact dot, as fine as f32.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import math

import numpy as np
import pytest

import numpy_taco as nt
import taco_jax
from kernel_cases import DTYPES, INTERPRET, case, case_id, rows_over_tiles
from taco_jax import codecs
from taco_jax.kernels import dispatch, references
from taco_jax.kernels.triton import compress, decode_sum, decompress, reduce, tiling as common

pytestmark = pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
KERNEL_CODECS = ("taco", "taco-e5m2", "taco-int8", "taco-1scale", "block-fp8")
OUT_ROUNDOFF = {"f32": 2.0 ** -24, "bf16": 2.0 ** -8, "f16": 2.0 ** -11}


def f64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def n_rows_for(b: int) -> int:
    """Two and a half default tiles plus one row: full tiles, a partial tile, masking."""
    return rows_over_tiles(common.KernelConfig.default(b).blocks_per_program)


def kernel_rows(n: int, b: int, dt: str, seed: int = 0) -> np.ndarray:
    """(n, B) rows: Student-t (4 dof) × e^{2·N} row scales, plus a zero row, a constant row,
    a NaN row, an Inf row, a -Inf row, rows at the edges of the dtype's range (10^±30 for
    f32/bf16, 10^±3 for f16) and, for f32/bf16, a row of ±(0.5–1)e37."""
    rng = np.random.default_rng(seed)
    x = rng.standard_t(4, (n, b)) * np.exp(2 * rng.standard_normal((n, 1)))
    big = 1e30 if dt != "f16" else 1e3
    if dt == "f16":
        x = np.clip(x, -6e4, 6e4)
    x[1] = 0.0
    x[2] = 5.0
    x[3, 7] = np.nan
    x[4, 0] = np.inf
    x[5] = rng.standard_normal(b) / big
    x[6] = rng.standard_normal(b) * big
    if dt != "f16" and n > 8:   # near the fp32 limit (a transform without α grows it ≤ 22.6×)
        x[7] = np.sign(rng.standard_normal(b)) * 1e37 * rng.uniform(0.5, 1.0, b)  # ·sqrt(B) < max
    if n > 8:
        x[8, b // 2] = -np.inf
    return x.astype(np.float32)


def coarse(dt: str, b: int) -> bool:
    """Does the default config round the transform's intermediate to bf16? (see module doc)"""
    return dt == "bf16" and common.kron_ok(b)


def compare_wires(name, b, w_kernel, w_ref, x, coarse_mode, max_mismatch=None):
    """Assert kernel and reference wire buffers agree to the documented tolerances."""
    spec = nt.SPECS[name]
    ck, sk, ak = nt.parse_wire(w_kernel, name, b)
    cr, sr, ar = nt.parse_wire(w_ref, name, b)
    bad = np.isnan(sr)
    np.testing.assert_array_equal(np.isnan(sk), bad, err_msg="NaN-scale rows differ")
    np.testing.assert_array_equal(bad, ~np.isfinite(x).all(axis=1))
    np.testing.assert_allclose(sk[~bad], sr[~bad], rtol=1e-2 if coarse_mode else 2e-5,
                               err_msg="scale s")
    if ak is not None:   # kernels take mean(x²) from the transform (Parseval): its rounding
        np.testing.assert_allclose(ak, ar, rtol=2e-3 if coarse_mode else 2e-5,
                                   err_msg="alpha")
    # coarse: the bf16 intermediate carries an absolute error ~2^-9 of the block's scale,
    # so small codes may move by more than their own step (measured ≤ Qmax/300)
    diff = nt.code_mismatches(ck, cr, spec.fmt, rows=~bad,
                              atol=spec.fmt.qmax / 128 if coarse_mode else 0.0)
    limit = max_mismatch if max_mismatch is not None else (0.10 if coarse_mode else 1e-3)
    assert diff.mean() <= limit, f"{diff.mean():.2e} of codes differ"
    # what matters in the end: the error against the input
    dk = nt.decode_wire(w_kernel, name, b, x.shape)[~bad]
    dr = nt.decode_wire(w_ref, name, b, x.shape)[~bad]
    assert nt.rel_l2(dk, dr) <= (3e-2 if coarse_mode else 1e-3)
    err_k, err_r = nt.rel_l2(dk, x[~bad]), nt.rel_l2(dr, x[~bad])
    assert err_k <= err_r + (5e-3 if coarse_mode else 1e-4), (err_k, err_r)
    return diff.mean()


# -- compress ----------------------------------------------------------------------------------
# Each interpreted kernel costs an XLA compile (~1.5 s CPU), so the cases are chosen, not
# crossed: every codec, every dtype, both transform paths (dense B < 256, Kronecker B ≥ 256).
COMPRESS_CASES = [("taco", 256, "f32"), ("taco", 512, "bf16"), ("taco-e5m2", 32, "f16"),
                  ("taco-int8", 256, "bf16"), ("taco-1scale", 64, "bf16"),
                  ("block-fp8", 128, "f32")]


@pytest.mark.parametrize("name,b,dt", COMPRESS_CASES, ids=case_id)
def test_compress_kernel_vs_reference(name, b, dt):
    c, x = case(name, b, dt, kernel_rows, n_rows_for(b))
    w_kernel = np.asarray(compress.compress(x, c, interpret=INTERPRET))
    w_ref = np.asarray(references.compress_reference(x, c))
    assert w_kernel.shape == w_ref.shape == (x.shape[0], c.row_bytes)
    compare_wires(name, b, w_kernel, w_ref, f64(x), coarse(dt, b))


def test_imprecise_config():
    """KernelConfig(precise=False) on f32 data: input and intermediate rounded to bf16.
    Measured 4–7% of codes off and the error against the input up by < 0.005 (compress);
    decoded values within 1e-2 of the block max (decompress)."""
    c, cfg = codecs.get("taco", block_size=256), common.KernelConfig(precise=False)
    x = jnp.asarray(kernel_rows(n_rows_for(256), 256, "f32"))
    w_kernel = np.asarray(compress.compress(x, c, cfg=cfg, interpret=INTERPRET))
    w_ref = references.compress_reference(x, c)
    frac = compare_wires("taco", 256, w_kernel, np.asarray(w_ref), f64(x), True,
                         max_mismatch=0.12)
    assert frac > 1e-3     # the coarse path is really taken
    got = f64(decompress.decompress(w_ref, c, jnp.float32, cfg=cfg, interpret=INTERPRET))
    want = f64(references.decompress_reference(w_ref, c))
    ok = ~np.isnan(want).any(axis=1)
    assert nt.block_rel_max(got[ok], want[ok]) <= 1e-2


@pytest.mark.parametrize("name,b,dt", [("taco", 256, "f32"), ("taco", 256, "bf16"),
                                      ("taco-int8", 64, "f16")], ids=case_id)
def test_ieee_rowmath_matches_reference(name, b, dt):
    """KernelConfig(fast_rowmath=False), the non-default IEEE path: α from sqrt, the code
    multiplier and decode's s/α from divisions. Same tolerances against the reference as
    the default kernels (fast_rowmath, tested everywhere else: on CPU the interpreter runs
    lax.rsqrt and a division; on GPU the ≤ 2-ulp MUFU ops), NaN and Inf rows included;
    decode and the reduce agree with their references too."""
    c, x = case(name, b, dt, kernel_rows, n_rows_for(b))
    cfg = common.KernelConfig.default(b)
    ieee = common.KernelConfig(blocks_per_program=cfg.blocks_per_program, fast_rowmath=False)
    w_ref = references.compress_reference(x, c)
    w = np.asarray(compress.compress(x, c, cfg=ieee, interpret=INTERPRET))
    compare_wires(name, b, w, np.asarray(w_ref), f64(x), coarse(dt, b))
    got = f64(decompress.decompress(w_ref, c, jnp.float32, cfg=ieee, interpret=INTERPRET))
    want = f64(references.decompress_reference(w_ref, c))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want).any(axis=1)
    assert nt.block_rel_max(got[ok], want[ok]) <= 2e-6   # f32 sums in another order: ~1e-6
    recv = jnp.stack([w_ref, w_ref])
    r = reduce.reduce(recv, x, jnp.int32(1), c, cfg=ieee, interpret=INTERPRET)
    rr = references.reduce_reference(recv, x, 1, c)
    dr = f64(references.decompress_reference(r, c))
    drr = f64(references.decompress_reference(rr, c))
    np.testing.assert_array_equal(np.isnan(dr), np.isnan(drr))
    fin = np.isfinite(drr).all(axis=1)
    assert nt.rel_l2(dr[fin], drr[fin]) <= (3e-2 if coarse(dt, b) else 1e-3)


def test_default_config_per_kernel():
    """Compress loops over 8 tiles per program on one warp (measured, docs/results.md);
    decompress and reduce take one tile on 2 warps; an unknown kernel name is an error."""
    assert common.KernelConfig.default(256, "compress").tiles_per_program == 8
    for k in (None, "decompress", "reduce"):
        assert common.KernelConfig.default(256, k).tiles_per_program == 1
    assert common.KernelConfig.default(512, "compress").blocks_per_program == 2
    assert common.KernelConfig.default(512, "decompress").blocks_per_program == 4
    with pytest.raises(ValueError, match="'compres'"):
        common.KernelConfig.default(256, "compres")
    # compress: one warp, 8 tiles; smaller programs up to MID_ELEMENTS, 4 of them up to
    # SMALL_ELEMENTS
    mid, small = common.MID_ELEMENTS // 256, common.SMALL_ELEMENTS // 256
    for n_rows, blocks, tiles in ((small, 2, 4), (small + 1, 2, 8), (mid, 2, 8),
                                  (mid + 1, 4, 8), (None, 4, 8)):
        cfg = common.KernelConfig.default(256, "compress", n_rows=n_rows)
        assert (cfg.blocks_per_program, cfg.num_warps, cfg.tiles_per_program) == (blocks, 1,
                                                                                   tiles)
    assert common.KernelConfig.default(256, "decompress", n_rows=16).num_warps == 2


def test_tiles_per_program_is_bit_identical():
    """A loop over tiles inside a program computes exactly what one tile per program does."""
    c = codecs.get("taco-int8", block_size=128)
    x = jnp.asarray(kernel_rows(45, 128, "f32"))
    one = common.KernelConfig(blocks_per_program=8)
    loop = common.KernelConfig(blocks_per_program=8, tiles_per_program=3)
    w1 = compress.compress(x, c, cfg=one, interpret=INTERPRET)
    w3 = compress.compress(x, c, cfg=loop, interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(w1), np.asarray(w3))


def test_row_masks_only_where_tiles_overrun():
    """Loads and stores drop their row masks where every program's tiles are whole rows, and
    the result is bit-identical to the masked kernel's."""
    cfg = common.KernelConfig(blocks_per_program=4, tiles_per_program=2)
    assert common.mask_rows(cfg, 64) is None and common.mask_rows(cfg, 60) == 60
    assert common.mask_rows(dataclasses.replace(cfg, row_masks=True), 64) == 64
    c = codecs.get("taco", block_size=128)
    x = jnp.asarray(kernel_rows(64, 128, "bf16"))
    w = compress.compress(x, c, cfg=cfg, interpret=INTERPRET)
    masked = compress.compress(x, c, cfg=dataclasses.replace(cfg, row_masks=True),
                               interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(w), np.asarray(masked))
    np.testing.assert_array_equal(
        np.asarray(decompress.decompress(w, c, cfg=cfg, interpret=INTERPRET)),
        np.asarray(decompress.decompress(w, c, cfg=dataclasses.replace(cfg, row_masks=True),
                                         interpret=INTERPRET)))


@pytest.mark.parametrize("b", [256, 512], ids=lambda b: f"B{b}")
def test_hadamard_factors_from_iota_are_bit_identical(b):
    """Kronecker factors built in registers give every kernel the bits of the loaded ones."""
    c = codecs.get("taco", block_size=b)
    on = common.KernelConfig.default(b, "compress", 16)
    off = dataclasses.replace(on, hadamard_iota=False)
    x = jnp.asarray(kernel_rows(16, b, "bf16"))
    w = compress.compress(x, c, cfg=on, interpret=INTERPRET)
    np.testing.assert_array_equal(
        np.asarray(w), np.asarray(compress.compress(x, c, cfg=off, interpret=INTERPRET)))
    dec_on = common.KernelConfig.default(b, "decompress")
    dec_off = dataclasses.replace(dec_on, hadamard_iota=False)
    np.testing.assert_array_equal(
        np.asarray(decompress.decompress(w, c, cfg=dec_on, interpret=INTERPRET)),
        np.asarray(decompress.decompress(w, c, cfg=dec_off, interpret=INTERPRET)))
    recv = jnp.stack([w, w[::-1]])
    np.testing.assert_array_equal(
        np.asarray(reduce.reduce(recv, x, 0, c, cfg=dec_on, interpret=INTERPRET)),
        np.asarray(reduce.reduce(recv, x, 0, c, cfg=dec_off, interpret=INTERPRET)))
    np.testing.assert_array_equal(
        np.asarray(decode_sum.decode_sum(recv, c, cfg=dec_on, interpret=INTERPRET)),
        np.asarray(decode_sum.decode_sum(recv, c, cfg=dec_off, interpret=INTERPRET)))


def test_compress_kernel_large_finite_inputs():
    c = codecs.get("taco", block_size=256)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 256)) * 1e37, jnp.float32)
    ref = f64(references.decompress_reference(references.compress_reference(x, c), c))
    assert np.isfinite(ref).all()
    got = f64(references.decompress_reference(compress.compress(x, c, interpret=INTERPRET), c))
    assert np.isfinite(got).all(), f"{np.mean(~np.isfinite(got)):.0%} non-finite"


# -- decompress ---------------------------------------------------------------------------------
DECOMPRESS_CASES = [("taco", 256, "f32"), ("taco-e5m2", 512, "bf16"), ("taco-int8", 32, "f16"),
                    ("taco-1scale", 128, "f32"), ("block-fp8", 256, "bf16")]


@pytest.mark.parametrize("name,b,out", DECOMPRESS_CASES, ids=case_id)
def test_decompress_kernel_vs_reference(name, b, out):
    """Same wire (from the reference compress) → decoded blocks: NaN rows identical, zero
    rows exact zeros, values within 2e-6 of each block's max (plus the output dtype's
    rounding; bf16 output on B ≥ 256 also rounds the intermediate)."""
    c = codecs.get(name, block_size=b)
    x = kernel_rows(n_rows_for(b), b, out)              # f16 output: values f16 can hold
    w = references.compress_reference(jnp.asarray(x), c)
    got = f64(decompress.decompress(w, c, DTYPES[out], interpret=INTERPRET))
    want = f64(references.decompress_reference(w, c, DTYPES[out]))
    assert got.shape == want.shape == x.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    nan_rows = np.isnan(want).any(axis=1)
    assert np.isnan(want[nan_rows]).all() and nan_rows[3] and nan_rows[4]
    assert np.all(got[1] == 0)
    tol = 2e-6 + 2 * OUT_ROUNDOFF[out] + (4e-3 if coarse(out, b) else 0)
    err = nt.block_rel_max(got[~nan_rows], want[~nan_rows])
    assert err <= tol, f"max block-relative error {err:.2e} > {tol:.2e}"


# -- reduce (decompress P copies, sum with the own segment, recompress) -------------------------
REDUCE_CASES = [("taco", 256), ("taco-int8", 64)]
QUANT_BOUND = {"e4m3": 0.06, "e5m2": 0.12, "int8": 0.03}


@pytest.mark.parametrize("name,b", REDUCE_CASES, ids=case_id)
def test_reduce_kernel_vs_reference(name, b):
    """P = 3 peers, me = 1. The slot of `me` holds garbage (0xFF bytes: NaN scales) that must
    be ignored in favour of the exact own rows; kernel ≡ reference to tie level, and the
    result decodes (numpy) to own + Σ_{p≠me} decode(recv[p]) within one quantization."""
    c = codecs.get(name, block_size=b)
    n, me, own_row0 = n_rows_for(b), 1, 3
    rng = np.random.default_rng(1)
    peers = [references.compress_reference(
        jnp.asarray(rng.standard_normal((n, b)) * np.exp(rng.standard_normal((n, 1)))
                    .astype(np.float32)), c) for _ in range(3)]
    peers[me] = jnp.full_like(peers[me], 0xFF)
    recv = jnp.stack(peers)
    own = jnp.asarray(rng.standard_normal((n + 5, b)).astype(np.float32))
    w_kernel = np.asarray(reduce.reduce(recv, own, me, c, interpret=INTERPRET,
                                        own_row0=own_row0))
    w_ref = np.asarray(references.reduce_reference(recv, own, jnp.int32(me), c, own_row0=own_row0))
    total = f64(own)[own_row0:own_row0 + n] + sum(
        nt.decode_wire(np.asarray(recv[p]), name, b, (n, b)) for p in (0, 2))
    assert np.isfinite(nt.decode_wire(w_kernel, name, b, (n, b))).all()
    compare_wires(name, b, w_kernel, w_ref, total, False)
    assert nt.rel_l2(nt.decode_wire(w_kernel, name, b, (n, b)), total) <= \
        QUANT_BOUND[nt.SPECS[name].fmt.name]


# -- through the codec API -------------------------------------------------------------------------
@pytest.mark.parametrize("name,dt", [("taco", "bf16")], ids=case_id)
def test_codec_api_on_interpret_backend(name, dt):
    """codec.encode/decode routed through the kernels: odd shape (padding), a NaN in one
    block; same result as the reference backend up to ties; shape, dtype, NaN block kept."""
    c = codecs.get(name)
    x = np.nan_to_num(kernel_rows(8, 256, "f32")[:6], nan=0.0, posinf=0.0)
    x = x.reshape(-1)[:1500].reshape(3, 500)
    x[1, 300] = np.nan                                       # flat 800 → block 3
    xj = jnp.asarray(x).astype(DTYPES[dt])
    with taco_jax.config(backend="interpret" if INTERPRET else "pallas"):
        enc = c.encode(xj)
        y = c.decode(enc)
    ref = c.roundtrip(xj)
    assert y.shape == xj.shape and y.dtype == xj.dtype and enc.data.shape == (6, c.row_bytes)
    yk, yr = f64(y).reshape(-1), f64(ref).reshape(-1)
    np.testing.assert_array_equal(np.isnan(yk), np.isnan(yr))
    assert np.isnan(yk[768:1024]).all() and not np.isnan(yk[:768]).any()
    ok = ~np.isnan(yr)
    assert nt.rel_l2(yk[ok], yr[ok]) <= (3e-2 if coarse(dt, 256) else 1e-3)


# -- validation ------------------------------------------------------------------------------------
def test_kernel_wrappers_validate_shapes():
    c = codecs.get("taco", block_size=128)
    x = jnp.ones((10, 128), jnp.float32)
    w = references.compress_reference(x, c)
    bad = [
        lambda: compress.compress(jnp.ones((10, 256)), c, interpret=True),
        lambda: compress.compress(x, codecs.get("fp8", block_size=128), interpret=True),
        lambda: decompress.decompress(w[:, :-4], c, interpret=True),
        lambda: decompress.decompress(w, codecs.get("taco-1scale", block_size=128),
                                      interpret=True),
        lambda: decompress.decompress(w, codecs.get("hadamard-fp8", block_size=128),
                                      interpret=True),
        lambda: reduce.reduce(jnp.stack([w, w])[:, :, :-1], x, 0, c, interpret=True),
        lambda: reduce.reduce(jnp.stack([w, w]), jnp.ones((10, 64)), 0, c, interpret=True),
        lambda: reduce.reduce(jnp.stack([w, w]), x[:9], 0, c, interpret=True),
    ]
    for i, f in enumerate(bad):
        with pytest.raises(ValueError, match="shape|got"):
            f()
            pytest.fail(f"case {i} did not raise")


# -- Triton lowering for an H200, on CPU (conftest's h200 fixture) ----------------------------------
def lower_for_cuda(f, *args) -> str:
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def lower_kernel(kernel, c, dt, cfg=None) -> str:
    n, b = 100, c.block_size
    if kernel == "compress":
        return lower_for_cuda(lambda x: compress.compress(x, c, cfg=cfg), sds((n, b), dt))
    if kernel == "decompress":
        return lower_for_cuda(lambda w: decompress.decompress(w, c, dt, cfg=cfg),
                              sds((n, c.row_bytes), jnp.uint8))
    return lower_for_cuda(lambda r, x, me: reduce.reduce(r, x, me, c, cfg=cfg, own_row0=me),
                          sds((2, n, c.row_bytes), jnp.uint8), sds((2 * n, b), dt),
                          sds((), jnp.int32))


def assert_one_triton_call(text: str, kernel: str):
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert f'name = "taco_{kernel}"' in text


KERNELS = ("compress", "decompress", "reduce")


@pytest.mark.parametrize("b", [32, 128, 256, 512], ids=lambda b: f"B{b}")
@pytest.mark.parametrize("name", KERNEL_CODECS)
@pytest.mark.parametrize("kernel", KERNELS)
def test_lowers_to_triton(h200, kernel, name, b):
    """Each kernel × codec × block size lowers to one Triton custom call (bf16 data for
    B = 128, 512, f32 data — the precise hi+lo path — for B = 32, 256)."""
    dt = jnp.bfloat16 if b in (128, 512) else jnp.float32
    assert_one_triton_call(lower_kernel(kernel, codecs.get(name, block_size=b), dt), kernel)


@pytest.mark.parametrize("b", [64, 256], ids=lambda b: f"B{b}")
@pytest.mark.parametrize("kernel", KERNELS)
def test_lowers_to_triton_configs(h200, kernel, b):
    """Non-default configs: forced precise / imprecise, the pipelined tile loop."""
    c = codecs.get("taco", block_size=b)
    for dt, cfg in [(jnp.bfloat16, common.KernelConfig(precise=True)),
                    (jnp.float32, common.KernelConfig(precise=False)),
                    (jnp.bfloat16, common.KernelConfig(blocks_per_program=16,
                                                       tiles_per_program=4))]:
        assert_one_triton_call(lower_kernel(kernel, c, dt, cfg), kernel)


@pytest.mark.parametrize("kernel", KERNELS)
def test_fast_rowmath_lowers_to_ptx_approximations(h200, kernel):
    """fast_rowmath's inline PTX reaches the Triton module by default (and the IEEE
    path, fast_rowmath=False, has none)."""
    c = codecs.get("taco", block_size=256)
    text = lower_kernel(kernel, c, jnp.bfloat16)
    assert_one_triton_call(text, kernel)
    ieee = lower_kernel(kernel, c, jnp.bfloat16, common.KernelConfig(fast_rowmath=False))
    assert "rcp.approx.ftz.f32" not in ieee and "rsqrt.approx" not in ieee
    for instr in ("rcp.approx.ftz.f32",) + (("rsqrt.approx.ftz.f32",)
                                            if kernel != "decompress" else ()):
        assert instr in text, instr


# -- wires of 2–4 GiB: Pallas-Triton's int32 offsets would wrap there --------------------------
def test_triton_offsets_wrap_between_2_and_4_gib():
    wraps = dispatch.triton_offsets_wrap
    assert not wraps(2 ** 31) and wraps(2 ** 31 + 1) and wraps(2 ** 32)
    assert not wraps(2 ** 32 + 1) and not wraps(0)


@pytest.mark.parametrize("name", ["taco", "echo4"])
def test_wires_of_2_to_4_gib_run_the_references(h200, name):
    """A call whose wire is 2–4 GiB (`dispatch.triton_offsets_wrap`) lowers without a
    Triton call, for every kernel; below and above it lowers to the kernels."""
    c = codecs.get(name)
    b, rb = c.block_size, c.row_bytes
    in_range = (2 ** 31 // rb + 1024) // 64 * 64           # rows: a wire of just over 2 GiB
    around = [(1024, True), (in_range, False), ((2 ** 32 // rb + 64) // 64 * 64, True)]
    with taco_jax.config(backend="pallas"):
        for rows, kernel in around:
            calls = {
                "compress": lower_for_cuda(lambda x: dispatch.compress(x, c),
                                           sds((rows, b), jnp.bfloat16)),
                "decompress": lower_for_cuda(lambda w: dispatch.decompress(w, c),
                                             sds((rows, rb), jnp.uint8)),
                "reduce": lower_for_cuda(
                    lambda r, x: dispatch.reduce(r, x, 0, c),
                    sds((2, rows // 2, rb), jnp.uint8), sds((rows // 2, b), jnp.bfloat16)),
                "decode_sum": lower_for_cuda(lambda r: dispatch.decode_sum(r, c),
                                             sds((2, rows // 2, rb), jnp.uint8)),
                "compress_feedback": lower_for_cuda(
                    lambda x, e: dispatch.compress_feedback(x, e, c),
                    sds((rows, b), jnp.bfloat16), sds((rows, b), jnp.float32))}
            for k, text in calls.items():
                assert ("__gpu$xla.gpu.triton" in text) == kernel, (rows, k)


@pytest.mark.parametrize("batch", [(8,), (2, 4)], ids=["vmap", "nested_vmap"])
def test_wires_of_2_to_4_gib_over_a_vmapped_batch_run_the_references(h200, batch):
    """Under jax.vmap each call sees one batch element, but Pallas batches it into one kernel
    over the whole batch: the 2–4 GiB window is the batch's wire, through every enclosing
    vmap (8 emulated devices of 277 MB of codes each wrapped at 1 GiB of f32 apiece)."""
    c = codecs.get("taco")
    b, rb, n = c.block_size, c.row_bytes, math.prod(batch)
    in_range = (2 ** 31 // rb // n + 1024) // 64 * 64       # the batch's wire just over 2 GiB

    def over(f, in_axes=0):
        for _ in batch:
            f = jax.vmap(f, in_axes=in_axes)
        return f

    with taco_jax.config(backend="pallas"):
        for rows, kernel in [(1024, True), (in_range, False)]:
            calls = {
                "compress": lower_for_cuda(over(lambda x: dispatch.compress(x, c)),
                                           sds((*batch, rows, b), jnp.bfloat16)),
                "decompress": lower_for_cuda(over(lambda w: dispatch.decompress(w, c)),
                                             sds((*batch, rows, rb), jnp.uint8)),
                "reduce": lower_for_cuda(
                    over(lambda r, x, me: dispatch.reduce(r, x, me, c, own_row0=me * 8)),
                    sds((*batch, 2, rows // 2, rb), jnp.uint8),
                    sds((*batch, rows // 2, b), jnp.bfloat16), sds(batch, jnp.int32)),
                "decode_sum": lower_for_cuda(over(lambda r: dispatch.decode_sum(r, c)),
                                             sds((*batch, 2, rows // 2, rb), jnp.uint8)),
                "compress_feedback": lower_for_cuda(
                    over(lambda x, e: dispatch.compress_feedback(x, e, c, skip_start=64,
                                                                 skip_rows=64)),
                    sds((*batch, rows, b), jnp.bfloat16), sds((*batch, rows, b), jnp.float32))}
            for k, text in calls.items():
                assert ("__gpu$xla.gpu.triton" in text) == kernel, (rows, k)


def test_vmapped_kernel_calls_match_the_unbatched_ones():
    """The batch guard's custom_vmap leaves results as they were: under vmap, nested vmap
    and jit, with a batched device index (reduce's `me`), in Pallas' interpreter."""
    c = codecs.get("taco")
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((4, 64, c.block_size)), jnp.float32)
    with taco_jax.config(backend="interpret"):
        w = jax.jit(jax.vmap(lambda x: dispatch.compress(x, c)))(x)
        for i in range(4):
            np.testing.assert_array_equal(w[i], dispatch.compress(x[i], c))
        y = jax.vmap(jax.vmap(lambda w: dispatch.decompress(w, c)))(w.reshape(2, 2, 64, -1))
        np.testing.assert_array_equal(y.reshape(4, 64, -1)[3], dispatch.decompress(w[3], c))
        recv = w.reshape(4, 4, 16, -1)
        red = jax.vmap(lambda r, o, me: dispatch.reduce(r, o, me, c, own_row0=me * 16))(
            recv, x, jnp.arange(4))
        np.testing.assert_array_equal(red[2], dispatch.reduce(recv[2], x[2], 2, c,
                                                              own_row0=32))
