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
    caches = (jp._check_fragmented_array, jp._check_tiled_layout, jp._untiling_transform,
              jp._tiling_traced)
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


def mosaic_module(capsys, body, out_type, scratch_types, *avals) -> str:
    """The Mosaic GPU module of a Lane-semantics kernel lowered for CUDA, as Pallas prints
    it with `debug=True` (the IR without source locations), its kernel's name unnumbered."""
    kernel = plgpu.kernel(body, out_type=out_type, scratch_types=scratch_types, debug=True,
                          compiler_params=plgpu.CompilerParams(lowering_semantics=LANE))
    capsys.readouterr()
    text = lower_for_cuda(kernel, *avals)
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
    module = capsys.readouterr().out.split("The Mosaic GPU module for")[-1].split("\n", 1)[1]
    return re.sub(rf"\b{body.__name__}_\d+\b", body.__name__, module)


def test_mgpu_store_plans_stores_into_tiled_smem(capsys):
    """Decoded values (16-byte vectors, `registers.value_layout`) into the kernels'
    swizzled bf16 value tile (`registers.swizzled`): mgpu_store(tiled=True) emits jax's own
    store into a tiled ref, Mosaic's bank-conflict-free plan; where jax offers a store
    without the plan, that one differs (the plan is there to be lost)."""
    from taco_jax.kernels.mosaic import registers
    layout = registers.value_layout(jnp.bfloat16)

    def module(store):
        def body(x_gmem, o_gmem, o_smem):
            store(o_smem, plgpu.load(x_gmem, layout=layout, optimized=False))
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_gmem)
            plgpu.wait_smem_to_gmem(0)
        tile = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16)
        return mosaic_module(capsys, body, tile, [plgpu.SMEM(
            (64, 256), jnp.bfloat16, transforms=registers.swizzled(jnp.bfloat16))], tile)

    def planned(ref, value):
        ref[...] = value
    got = module(lambda ref, value: jp.mgpu_store(ref, value, tiled=True))
    assert got == module(planned)
    if hasattr(plgpu, "store"):
        assert got != module(lambda ref, value: plgpu.store(ref, value, optimized=False))


def test_mgpu_store_lowers_rows_264_bytes_apart():
    """A (64, 256) uint8 register array in the WGMMA layout stored into rows 264 bytes
    apart (wire rows with 8 scale bytes), in untiled SMEM and in GMEM: plain stores, which
    lower (jax 0.12 cannot plan them); and a 16-bit tile into a swizzled SMEM tile (the
    GEMM's encode epilogue)."""
    def body(x_gmem, w_gmem, o_gmem, w_smem, o_smem):
        codes = plgpu.load(x_gmem, layout=plgpu.Layout.WGMMA, optimized=False)
        for ref in (w_smem.reshape(64, 264), w_gmem):
            jp.mgpu_store(ref.at[:, pl.ds(0, 256)], codes)
        vals = plgpu.load(o_gmem, layout=plgpu.Layout.WGMMA, optimized=False)
        jp.mgpu_store(o_smem, vals, tiled=True)
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


@pytest.mark.parametrize("tiled", [True, False])
def test_mgpu_store_refuses_the_wrong_kind_of_ref(tiled):
    """Where a traced ref shows its tiling, a store told the wrong kind raises (a kernel
    that states it wrongly fails on such a jax, not silently unplanned on a later one)."""
    if not jp._tiling_traced():
        pytest.skip(f"jax {jax.__version__} applies a ref's tiling where the kernel is "
                    "lowered: the store cannot check what it is told")

    def body(x_gmem, o_gmem, o_smem, u_smem):
        vals = plgpu.load(x_gmem, layout=plgpu.Layout.WGMMA, optimized=False)
        jp.mgpu_store(u_smem if tiled else o_smem, vals, tiled=tiled)

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((64, 64), jnp.float16),
        scratch_types=[plgpu.SMEM((64, 64), jnp.float16, transforms=SWIZZLED),
                       plgpu.SMEM((64, 64), jnp.float16)],
        compiler_params=plgpu.CompilerParams(lowering_semantics=LANE))
    with pytest.raises(ValueError, match=f"mgpu_store\\(tiled={tiled}\\)"):
        lower_for_cuda(kernel, jax.ShapeDtypeStruct((64, 64), jnp.float16))


def test_mgpu_store_broken(monkeypatch):
    """Where a traced ref shows its tiling, telling tiled refs apart needs Mosaic's private
    UntilingTransform; simulate its loss (on a jax that applies the tiling where the kernel
    is lowered, simulate that change undone too)."""
    from jax._src.pallas.mosaic_gpu import core as gpu_core
    monkeypatch.delattr(gpu_core.GPUMemoryRef, "get_ref_transforms", raising=False)
    monkeypatch.delattr(gpu_core, "UntilingTransform")
    with pytest.raises(jp.JaxInternalsError) as err:
        jp.mgpu_store(object(), None)
    assert_names_versions(err, "UntilingTransform")


def test_error_message_form():
    err = jp._broken("thing", AttributeError("gone"))
    assert re.search(rf"jax {re.escape(jax.__version__)} does not provide", str(err))
    assert "AttributeError: gone" in str(err) and isinstance(err, RuntimeError)
