"""taco_jax._jax_private: each function works on the installed jax, and a changed jax
internal raises JaxInternalsError naming the installed and the checked versions.

The Mosaic GPU functions are exercised by lowering small kernels for CUDA on the CPU."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as fa
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith

from taco_jax import _jax_private as jp

LANE = plgpu.LoweringSemantics.Lane


@pytest.fixture(autouse=True)
def fresh_checks():
    """The signature checks are cached per process: a simulated break must be seen, and
    must not stay cached for the next test."""
    caches = (jp._check_fragmented_array, jp._check_tiled_layout, jp._untiling_transform)
    for c in caches:
        c.cache_clear()
    yield
    for c in caches:
        c.cache_clear()


def assert_names_versions(err: pytest.ExceptionInfo, what: str):
    msg = str(err.value)
    assert what in msg and jax.__version__ in msg, msg
    for v in jp.CHECKED:
        assert v in msg, msg


def test_installed_jax_is_a_checked_version():
    """Fails on a jax that this module was not checked on: check every function below on
    it, then add the version to CHECKED."""
    assert jax.__version__ in jp.CHECKED


# -- extend_axis_env ----------------------------------------------------------------------------
def test_extend_axis_env_binds_the_name():
    f = lambda x: lax.psum(x, "i")     # noqa: E731
    with pytest.raises(NameError, match="unbound axis name"):
        jax.make_jaxpr(f)(1.0)
    with jp.extend_axis_env("i", 4):
        jaxpr = jax.make_jaxpr(f)(1.0)
    assert "psum" in str(jaxpr)
    with jp.extend_axis_env("i", 4):
        assert lax.axis_size("i") == 4


def test_extend_axis_env_broken(monkeypatch):
    from jax._src import core
    monkeypatch.delattr(core, "extend_axis_env_nd")
    with pytest.raises(jp.JaxInternalsError) as err:
        jp.extend_axis_env("i", 4)
    assert_names_versions(err, "extend_axis_env_nd")


# -- Mosaic GPU: registers and layouts ------------------------------------------------------------
def in_mlir(fn):
    """Run fn() with an MLIR context, location and insertion point, as inside a kernel."""
    from jax._src.interpreters import mlir
    with mlir.make_ir_context(), ir.Location.unknown():
        module = ir.Module.create()
        with ir.InsertionPoint(module.body):
            return fn()


def test_fragmented_array_from_registers():
    def build():
        v = arith.constant(ir.F32Type.get(), 1.5)
        ref = fa.FragmentedArray.splat(v, (64, 16), fa.WGMMA_LAYOUT)
        got = jp.fragmented_array(ref.registers, ref.layout, is_signed=None)
        assert got.layout == fa.WGMMA_LAYOUT and got.shape == (64, 16)
        assert got.is_signed is None
        np.testing.assert_array_equal(got.registers, ref.registers)
        with pytest.raises(TypeError, match="is_signed"):     # Mosaic's own check
            jp.fragmented_array(ref.registers, ref.layout, is_signed=True)
    in_mlir(build)


def test_fragmented_array_broken(monkeypatch):
    class Changed:
        def __init__(self, *, registers, layout, is_signed):
            pass
    monkeypatch.setattr(fa, "FragmentedArray", Changed)
    with pytest.raises(jp.JaxInternalsError) as err:
        jp.fragmented_array(np.empty((1,), object), None, is_signed=None)
    assert_names_versions(err, "_registers")


REPLICATED_SPEC = dict(tiling=fa.Tiling(((64, 8), (16, 8), (8, 8), (8,))), warp_dims=(-7,),
                       lane_dims=(-3, fa.Replicated(4)), vector_dim=-1)


def test_tiled_layout_canonicalizes():
    """The spec is refused by the public constructor (not canonical); the function gives
    the canonical layout: one 8-element vector per row half, 4 lanes per row."""
    with pytest.raises(ValueError, match="canonical"):
        fa.TiledLayout(**REPLICATED_SPEC)
    lay = jp.tiled_layout(**REPLICATED_SPEC)
    assert isinstance(lay, fa.TiledLayout) and lay == lay.canonicalize()
    assert lay.vector_length == 8
    assert int(np.prod(lay.registers_shape((64, 8)))) == 2
    # the public constructor accepts the canonical fields unchanged
    assert fa.TiledLayout(lay.tiling, warp_dims=lay.warp_dims, lane_dims=lay.lane_dims,
                          vector_dim=lay.vector_dim) == lay


def test_tiled_layout_broken(monkeypatch):
    class Changed:
        def __init__(self, tiling, warp_dims, lane_dims, vector_dim):
            pass

        def canonicalize(self):
            return self
    monkeypatch.setattr(fa, "TiledLayout", Changed)
    with pytest.raises(jp.JaxInternalsError) as err:
        jp.tiled_layout(**REPLICATED_SPEC)
    assert_names_versions(err, "_check_canonical")


# -- Mosaic GPU: stores ---------------------------------------------------------------------------
SWIZZLED = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def lower_for_cuda(kernel, *avals) -> str:
    return jax.jit(kernel).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()


def test_mgpu_store_lowers_rows_264_bytes_apart():
    """A (64, 256) uint8 register array in the WGMMA layout stored into rows 264 bytes
    apart (wire rows with 8 scale bytes), in SMEM and in GMEM; and a 16-bit tile into a
    swizzled SMEM tile. The kinds of ref are told apart as the lowering needs."""
    seen = {}

    def body(x_gmem, w_gmem, o_gmem, w_smem, o_smem):
        codes = plgpu.load(x_gmem, layout=plgpu.Layout.WGMMA, optimized=False)
        for name, ref in [("smem", w_smem.reshape(64, 264)), ("gmem", w_gmem)]:
            seen[name] = jp._is_tiled(ref)
            jp.mgpu_store(ref.at[:, pl.ds(0, 256)], codes)
        vals = plgpu.load(o_gmem, layout=plgpu.Layout.WGMMA, optimized=False)
        seen["swizzled"] = jp._is_tiled(o_smem)
        jp.mgpu_store(o_smem, vals)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem)
        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(
        body, out_type=(jax.ShapeDtypeStruct((64, 264), jnp.uint8),
                        jax.ShapeDtypeStruct((64, 64), jnp.float16)),
        scratch_types=[plgpu.SMEM((66, 256), jnp.uint8),
                       plgpu.SMEM((64, 64), jnp.float16, transforms=SWIZZLED)],
        compiler_params=plgpu.CompilerParams(lowering_semantics=LANE))
    text = lower_for_cuda(kernel, jax.ShapeDtypeStruct((64, 256), jnp.uint8))
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
    assert seen == {"smem": False, "gmem": False, "swizzled": True}


def test_mgpu_store_broken(monkeypatch):
    """Where jax has `plgpu.store`, telling tiled refs apart needs Mosaic's private
    UntilingTransform; simulate its loss (and `store`, on a jax without it)."""
    from jax._src.pallas.mosaic_gpu import core as gpu_core
    monkeypatch.setattr(plgpu, "store", lambda *a, **k: None, raising=False)
    monkeypatch.delattr(gpu_core, "UntilingTransform")
    with pytest.raises(jp.JaxInternalsError) as err:
        jp.mgpu_store(object(), None)
    assert_names_versions(err, "UntilingTransform")


def test_error_message_form():
    err = jp._broken("thing", AttributeError("gone"))
    assert re.search(rf"jax {re.escape(jax.__version__)} does not provide", str(err))
    assert "AttributeError: gone" in str(err) and isinstance(err, RuntimeError)
