"""The row-parallel GEMMs' fused route (taco_jax/collectives/gemm_fused.py):
`matmul_reduce_scatter(..., transport="fused")` and `matmul_psum`. On CPU: which route each
call takes and what telemetry says; with the GEMM kernels assumed checked
(`fused_lowering.assumed_checked(GEMM_COVERED)`), the lowering for CUDA on a 2- and 4-device
mesh and under jax.vmap holds the two launches (GEMM with its encode epilogue, then the
decode); without it, or where the kernels do not cover a call, the other route and why;
the residual forms' values and gradients against lax's; under vmap the fused route run
with the kernels' jnp references in place of the loopback (values and the custom_vjp's
backward). The kernels' numerics run on a GPU (`python -m bench.gemm_codec`)."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import taco_jax
from taco_jax import codecs, telemetry
from taco_jax.collectives import fused, gemm_fused
from taco_jax.kernels import gemm

from fused_lowering import GEMM_COVERED, assumed_checked

# (M, K, N) per device: two row tiles of 64 for each of P = 2 owners, one K step, one
# column tile: the smallest the kernels take
M, K, N = 256, 64, 256
BF16 = jnp.bfloat16


def mesh(p):
    return jax.make_mesh((p,), ("tp",), devices=jax.devices()[:p])


def specs(mesh_, scatter, residual_spec):
    return (P(None, "tp"), P("tp"), residual_spec), P("tp") if scatter else P()


def sharded(mesh_, p, dtype=BF16, m=M, k=K, n=N, scatter=True, lead=()):
    """x (…, M, P·K) split by columns, w (P·K, N) by rows, the residual: the reduce-scatter's
    (M, N) split by rows, the all-reduce's replicated."""
    xs = jax.ShapeDtypeStruct((*lead, m, p * k), dtype,
                              sharding=NamedSharding(mesh_, P(*([None] * (len(lead) + 1)),
                                                              "tp")))
    ws = jax.ShapeDtypeStruct((p * k, n), dtype, sharding=NamedSharding(mesh_, P("tp")))
    rs = jax.ShapeDtypeStruct((*lead, m, n), dtype,
                              sharding=NamedSharding(mesh_, P("tp") if scatter else P()))
    return xs, ws, rs


def op_fn(scatter, **kw):
    if scatter:
        return lambda x, w, r: taco_jax.matmul_reduce_scatter(x, w, "tp", residual=r,
                                                              min_bytes=0, **kw)
    return lambda x, w, r: taco_jax.matmul_psum(x, w, "tp", residual=r, min_bytes=0, **kw)


def on_mesh(fn, p, scatter, vma=True, lead=(), **shape):
    m_ = mesh(p)
    nd = len(lead) + 1
    in_specs = (P(*([None] * nd), "tp"), P("tp"), P("tp") if scatter else P())
    sm = jax.shard_map(fn, mesh=m_, in_specs=in_specs,
                       out_specs=P("tp") if scatter else P(), check_vma=vma)
    return sm, sharded(m_, p, scatter=scatter, lead=lead, **shape)


def lowered(fn, args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def kernels_of(text):
    """The Mosaic GPU launches of a lowered module, in order: (name, addresses peers)."""
    out = []
    for line in text.splitlines():
        if "@mosaic_gpu_v2" in line:
            name = next(k for k in ("taco_gemm_encode", "taco_decode_residual", "taco")
                        if k in line)
            out.append((name, "uses_xla_collective_metadata = true" in line))
    return out


def sites_of(fn, args):
    """The sites a fresh trace of fn notes (make_jaxpr caches nothing)."""
    telemetry.clear_sites()
    telemetry.traced_sites(jax.make_jaxpr(fn), *args)
    return [(s.op, s.transport or "lax", s.reason) for s, _ in telemetry.sites()]


# -- selection and lowering -------------------------------------------------------------------
@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("scatter", [True, False], ids=["reduce_scatter", "psum"])
def test_assumed_checked_selects_the_gemm_and_lowers_its_two_launches(gpu_here, p, scatter):
    fn, args = on_mesh(op_fn(scatter, transport="fused"), p, scatter)
    with assumed_checked(GEMM_COVERED):
        sites = sites_of(fn, args)
        text = lowered(fn, args)
    op = "matmul_reduce_scatter" if scatter else "matmul_psum"
    assert sites == [(op, "fused", "")]
    # the GEMM stores into the peers' buffers; the decode reads this device's own
    assert kernels_of(text) == [("taco_gemm_encode", True), ("taco_decode_residual", False)]
    assert "collective-permute" not in text and "all-to-all" not in text


def test_auto_takes_the_gemm_where_checked_and_xla_where_not(gpu_here):
    """(A function traced once is not traced again: each check builds its own.)"""
    with assumed_checked(GEMM_COVERED):
        assert sites_of(*on_mesh(op_fn(True, transport="auto"), 2, True)) == [
            ("matmul_reduce_scatter", "fused", "")]
    assert sites_of(*on_mesh(op_fn(True, transport="auto"), 2, True)) == [
        ("matmul_reduce_scatter", "xla", "")]
    psum_fn, psum_args = on_mesh(op_fn(False, transport="auto"), 2, False)
    assert sites_of(psum_fn, psum_args) == [("matmul_psum", "xla", "")]


@pytest.mark.parametrize("scatter", [True, False], ids=["reduce_scatter", "psum"])
def test_unchecked_gemm_runs_the_separate_kernels_and_says_why(gpu_here, scatter):
    """The committed table holds no GEMM kernel: the fused transport runs XLA's GEMM and its
    separate kernels, and telemetry names the GPU step that would admit the GEMM."""
    fn, args = on_mesh(op_fn(scatter, transport="fused"), 2, scatter)
    ((op, label, _),) = sites_of(fn, args)
    kernel = "'owner'" if scatter else "'all'"
    assert label.startswith(f"fused (separate kernels): the row-parallel GEMM kernel "
                            f"(exchange {kernel}) has no passing loopback checks"), label
    assert "bench/gpu_run.sh gemm_codec" in label
    assert "taco_gemm_encode" not in str(jax.make_jaxpr(fn)(*args))


def jaxpr_has_gemm(fn, args):
    return "taco_gemm_encode" in str(jax.make_jaxpr(fn)(*args))


@pytest.mark.parametrize("case,why", [
    (dict(n=1000), "N=1000"),
    (dict(dtype=jnp.float32), "float32"),
    (dict(m=192), "M=192 in P=2 owners' rows"),      # 3 row tiles of 64 for 2 owners
])
def test_what_the_gemm_does_not_cover_falls_back_with_the_reason(gpu_here, case, why):
    m_ = mesh(2)
    dtype = case.pop("dtype", BF16)
    args = sharded(m_, 2, dtype=dtype, **case)
    fn = jax.shard_map(op_fn(True, transport="fused"), mesh=m_,
                       in_specs=(P(None, "tp"), P("tp"), P("tp")), out_specs=P("tp"))
    with assumed_checked(GEMM_COVERED):
        ((_, label, _),) = sites_of(fn, args)
        assert not jaxpr_has_gemm(fn, args)
    assert label.startswith("fused (separate kernels): ") and why in label, label


def test_scattering_another_dimension_falls_back(gpu_here):
    """Megatron-SP's (batch, sequence, k) scattered along the sequence: the owners' rows are
    not contiguous in the GEMM's; scattered along dimension 0 they are (the GEMM runs)."""
    m_ = mesh(2)
    x = jax.ShapeDtypeStruct((2, M, 2 * K), BF16, sharding=NamedSharding(m_, P(None, None,
                                                                                 "tp")))
    w = jax.ShapeDtypeStruct((2 * K, N), BF16, sharding=NamedSharding(m_, P("tp")))
    for dim, spec, want in [(1, P(None, "tp"), "scatter_dimension=1"), (0, P("tp"), None)]:
        r = jax.ShapeDtypeStruct((2, M, N), BF16, sharding=NamedSharding(m_, spec))

        def f(x, w, r, dim=dim):
            return taco_jax.matmul_reduce_scatter(x, w, "tp", scatter_dimension=dim,
                                                  residual=r, min_bytes=0, transport="fused")
        fn = jax.shard_map(f, mesh=m_, in_specs=(P(None, None, "tp"), P("tp"), spec),
                           out_specs=spec)
        with assumed_checked(GEMM_COVERED):
            ((_, label, _),) = sites_of(fn, (x, w, r))
            assert jaxpr_has_gemm(fn, (x, w, r)) == (want is None)
        assert (label == "fused") if want is None else want in label, label


@pytest.mark.parametrize("scatter", [True, False], ids=["reduce_scatter", "psum"])
def test_under_vmap_the_gemm_runs_as_its_loopback(monkeypatch, scatter):
    """Emulated tensor parallelism: one launch of each kernel for all P members (the
    loopback: nothing addressed outside this device)."""
    monkeypatch.setattr(fused, "unavailable_reason", lambda axes: None)
    p = 4
    rows = M // p if scatter else M
    xs = jax.ShapeDtypeStruct((p, M, K), BF16)
    ws = jax.ShapeDtypeStruct((p, K, N), BF16)
    rs = jax.ShapeDtypeStruct((p, rows, N), BF16)
    fn = jax.vmap(op_fn(scatter, transport="fused"), axis_name="tp")
    with assumed_checked(GEMM_COVERED):
        ((_, label, _),) = sites_of(fn, (xs, ws, rs))
        text = lowered(fn, (xs, ws, rs))
    assert label == "fused (loopback)"
    assert kernels_of(text) == [("taco_gemm_encode", False), ("taco_decode_residual", False)]


# -- bad input ----------------------------------------------------------------------------------
def test_bad_input_is_refused_naming_it(gpu_here):
    m_ = mesh(2)
    x, w, r = sharded(m_, 2)
    odd = jax.ShapeDtypeStruct((M + 1, 2 * K), BF16, sharding=NamedSharding(m_, P(None, "tp")))
    no_residual = jax.shard_map(
        lambda x, w: taco_jax.matmul_reduce_scatter(x, w, "tp", transport="fused"), mesh=m_,
        in_specs=(P(None, "tp"), P("tp")), out_specs=P("tp"))
    with pytest.raises(ValueError, match=r"dimension 0 of x.shape=\(257, 64\) \(257\) must "
                                         r"be divisible by the axis size 2"):
        sites_of(no_residual, (odd, w))
    bad_r = jax.ShapeDtypeStruct((M, N + 1), BF16, sharding=NamedSharding(m_, P("tp")))
    fn, _ = on_mesh(op_fn(True, transport="fused"), 2, True)
    with pytest.raises(ValueError, match=r"residual.shape=\(128, 257\) must be the result's "
                                         r"shape \(128, 256\)"):
        sites_of(fn, (x, w, bad_r))
    int_r = jax.ShapeDtypeStruct((M, N), jnp.int32, sharding=NamedSharding(m_, P()))
    fn, _ = on_mesh(op_fn(False, transport="fused"), 2, False)
    with pytest.raises(ValueError, match="residual must be a float array"):
        sites_of(fn, (x, w, int_r))


def test_fused_where_it_cannot_run_is_an_error_and_xla_is_unchanged():
    """On CPU (no gpu_here) transport="fused" names why; "xla" stays the collective-permutes
    (now with the residual added after them)."""
    fn, args = on_mesh(op_fn(True, transport="fused"), 2, True)
    with pytest.raises(ValueError, match="transport='fused' cannot run here: platform 'cpu'"):
        sites_of(fn, args)
    fn, args = on_mesh(op_fn(True, transport="xla"), 2, True)
    assert sites_of(fn, args) == [("matmul_reduce_scatter", "xla", "")]
    assert "ppermute" in str(jax.make_jaxpr(fn)(*args))


# -- values and gradients: the non-fused routes against lax ------------------------------------
def values(p, scatter, seed=0, m=8 * 4, k=16, n=24, dtype=np.float32):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, p * k)).astype(dtype)
    w = (rng.standard_normal((p * k, n)) / np.sqrt(p * k)).astype(dtype)
    r = rng.standard_normal((m, n)).astype(dtype)
    return x, w, r


def lax_ref(scatter):
    if scatter:
        return lambda x, w, r: r + lax.psum_scatter(x @ w, "tp", tiled=True)
    return lambda x, w, r: r + lax.psum(x @ w, "tp")


def run_both(fn, ref, p, scatter, vma, xwr, cot):
    """Values and gradients (of <fn(x, w, r), cot>) of fn and ref on the mesh."""
    m_ = mesh(p)
    in_specs = (P(None, "tp"), P("tp"), P("tp") if scatter else P())
    out = P("tp") if scatter else P()

    def loss(f):
        sm = jax.shard_map(f, mesh=m_, in_specs=in_specs, out_specs=out, check_vma=vma)
        if not scatter and not vma:     # each device's copy is the whole result
            sm = jax.shard_map(f, mesh=m_, in_specs=in_specs, out_specs=P(), check_vma=False)
        return jax.jit(jax.value_and_grad(
            lambda x, w, r: (jnp.sum(sm(x, w, r).astype(jnp.float32) * cot), sm(x, w, r)),
            argnums=(0, 1, 2), has_aux=True))
    xwr = [jax.device_put(v, NamedSharding(m_, s)) for v, s in zip(xwr, in_specs)]
    return loss(fn)(*xwr), loss(ref)(*xwr)


@pytest.mark.parametrize("vma", [True, False])
@pytest.mark.parametrize("scatter", [True, False], ids=["reduce_scatter", "psum"])
@pytest.mark.parametrize("codec,tol", [("none", 1e-5), ("taco", 0.08)])
def test_residual_forms_values_and_gradients_match_lax(scatter, vma, codec, tol):
    p = 4
    xwr = values(p, scatter)
    cot = np.random.default_rng(1).standard_normal(
        (xwr[0].shape[0], xwr[1].shape[1])).astype(np.float32)
    fn = op_fn(scatter, transport="xla", codec=codec)
    ((_, y), grads), ((_, want), want_grads) = run_both(fn, lax_ref(scatter), p, scatter,
                                                        vma, xwr, cot)
    rel = lambda a, b: np.linalg.norm(np.asarray(a) - b) / np.linalg.norm(b)  # noqa: E731
    assert rel(y, want) < tol
    for g, gw, name in zip(grads, want_grads, "xwr"):
        assert rel(g, gw) < tol, name


# -- the fused route under vmap, its loopback stood in for by the kernels' jnp references ------
def loopback_model(xs, ws, rs, codec, scatter):
    """What `gemm_fused.loopback` gives, from the kernels' references: member d's (rows of
    the) decoded sum plus its residual."""
    p = xs.shape[0]
    wires = jnp.stack([gemm.gemm_encode_reference(xs[j], ws[j], codec) for j in range(p)])
    if not scatter:
        return jnp.stack([gemm.decode_sum_residual_reference(wires, rs[d], codec)
                          for d in range(p)])
    per = wires.shape[1] // p      # tile-major: owner o's tiles are rows o·per … of a wire
    return jnp.stack([gemm.decode_sum_residual_reference(wires[:, o * per:(o + 1) * per],
                                                         rs[o], codec) for o in range(p)])


@pytest.mark.parametrize("scatter", [True, False], ids=["reduce_scatter", "psum"])
def test_fused_route_under_vmap_values_and_gradients_match_lax(monkeypatch, scatter):
    monkeypatch.setattr(fused, "unavailable_reason", lambda axes: None)
    ran = []

    def model(*a):
        ran.append(a[-1])
        return loopback_model(*a)
    monkeypatch.setitem(gemm_fused.LOOPBACK_KERNELS, gemm_fused.loopback, model)
    p, m, k, n = 2, 128, 64, 256
    rng = np.random.default_rng(3)
    xs = jnp.asarray(rng.standard_normal((p, m, k)), BF16)
    ws = jnp.asarray(rng.standard_normal((p, k, n)) / 8, BF16)
    rs = jnp.asarray(rng.standard_normal((p, m // p if scatter else m, n)), BF16)
    cot = jnp.asarray(rng.standard_normal(rs.shape[1:]), jnp.float32)

    def loss(f):
        def one(x, w, r):
            y = f(x, w, r)
            return jnp.sum(y.astype(jnp.float32) * cot), y
        return jax.jit(jax.vmap(jax.value_and_grad(one, argnums=(0, 1, 2), has_aux=True),
                                axis_name="tp"))
    with assumed_checked(GEMM_COVERED):
        (_, y), grads = loss(op_fn(scatter, transport="fused"))(xs, ws, rs)
    assert ran == [scatter]
    (_, want), want_grads = loss(lax_ref(scatter))(xs, ws, rs)
    rel = lambda a, b: float(jnp.linalg.norm((a - b).astype(jnp.float32))    # noqa: E731
                             / jnp.linalg.norm(b.astype(jnp.float32)))
    assert rel(y, want) < 0.05
    for g, gw, name in zip(grads, want_grads, "xwr"):
        assert rel(g, gw) < 0.05, name
    # the loopback's own result, member by member
    got = jax.jit(lambda *a: loopback_model(*a, codecs.get("taco"), scatter))(xs, ws, rs)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(got, np.float32))
