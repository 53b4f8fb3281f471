"""echo4's Mosaic GPU tile math (taco_jax/kernels/mosaic/echo4.py).

Mosaic GPU kernels do not run in Pallas' interpreter: on CPU the tile kernels are traced
and lowered for a CUDA target, and the register layouts and the wrappers' checks are
tested. On a Hopper GPU (`pytest tests/kernels/test_mosaic_echo4.py -k gpu`) the kernels' bytes
are compared with the codec's reference, bit for bit.
"""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jax.experimental.mosaic.gpu import fragmented_array as fa

from taco_jax import codecs
from taco_jax.kernels.mosaic import echo4 as me, registers

ECHO4 = codecs.get("echo4")
DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]


def lowered(fn, *structs):
    return jax.jit(fn).trace(*structs).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_groups", [128, 128 * 133])       # one tile; more tiles than SMs
def test_compress_lowers_for_cuda(dtype, n_groups):
    text = lowered(lambda v: me.compress(v, ECHO4), jax.ShapeDtypeStruct((n_groups, 128),
                                                                           dtype))
    assert text.count("taco_echo4_compress_mosaic") >= 1 and text.count("custom_call") == 1


@pytest.mark.parametrize("out_dtype", DTYPES)
def test_decompress_lowers_for_cuda(out_dtype):
    text = lowered(lambda w: me.decompress(w, ECHO4, out_dtype),
                   jax.ShapeDtypeStruct((256, ECHO4.row_bytes), jnp.uint8))
    assert text.count("taco_echo4_decompress_mosaic") >= 1


def test_a_tile_row_is_two_codec_rows():
    assert me.row_bytes(ECHO4) == 2 * ECHO4.row_bytes == 144
    assert me.ROWS * me.row_bytes(ECHO4) % 256 == 0          # whole 256-byte lines per tile


def _contiguous(shape):
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def _dims_index(layout, idx, dims):
    """A warp or lane index → its index along each tiled dim (Mosaic's delinearization)."""
    tiled = layout.tiled_tiling_shape
    shape = tuple(d.times if isinstance(d, fa.Replicated) else tiled[d] for d in dims)
    full = [0] * len(tiled)
    for d, stride, size in zip(dims, _contiguous(shape), shape):
        if not isinstance(d, fa.Replicated):
            full[d] = (idx // stride) % size
    return full


def elements(layout, shape):
    """{thread: [(row, column) of each register's first element, in register order]}, as
    Mosaic's TiledLayout.thread_idxs computes them, in plain Python."""
    strides = _contiguous(shape)
    tile_strides = layout.tiling.tile_strides(strides)
    inner = tile_strides[-layout.tiled_tiling_rank:]
    out = {}
    for t in range(128):
        offset = sum(a * s for a, s in zip(_dims_index(layout, t // 32, layout.warp_dims)
                                           + _dims_index(layout, t % 32, layout.lane_dims),
                                           inner + inner))
        out[t] = [divmod(offset + sum(i * s for i, s in zip(reg, tile_strides)), strides[0])
                  for reg in np.ndindex(layout.registers_shape(shape))]
    return out


def _rows(t):
    """A thread's two rows in the WGMMA layout."""
    w, lane = divmod(t, 32)
    return [16 * w + lane // 4, 16 * w + lane // 4 + 8]


@pytest.mark.parametrize("vec", [8, 4])
def test_values_registers_are_runs_of_16_of_each_group(vec):
    """Value layout register (i, j, e, h): row half i, group j, run e (columns
    16(2(l%4) + e) of the group), vector h of the run: what encode and decode index."""
    for t, regs in elements(registers.wire_tiled(vec, 256), (64, 256)).items():
        lane = t % 32
        assert regs == [(_rows(t)[i], 128 * j + 16 * (2 * (lane % 4) + e) + vec * h)
                        for i in range(2) for j in range(2) for e in range(2)
                        for h in range(16 // vec)], t


def test_code_registers_are_the_bytes_of_those_runs():
    """Code layout register (i, e): the 8 bytes of run e of row half i (2 codes a byte),
    so a run's codes leave as one 8-byte vector; scale bytes: one vector per row half."""
    for t, regs in elements(me._code_tiled(), (64, 64)).items():
        lane = t % 32
        assert regs == [(_rows(t)[i], 16 * (lane % 4) + 8 * e)
                        for i in range(2) for e in range(2)], t
    assert me._code_tiled().vector_length == 8
    for t, regs in elements(registers.scale_tiled(8), (64, 8)).items():
        assert regs == [(_rows(t)[i], 0) for i in range(2)], t


@pytest.mark.parametrize("name,match", [("int4-sym", "not echo4"), ("tah4", "not echo4"),
                                        ("taco", "not echo4")])
def test_other_codecs_are_refused_by_name(name, match):
    with pytest.raises(ValueError, match=match):
        me.compress(jnp.ones((128, 128), jnp.bfloat16), codecs.get(name))
    assert me.unsupported(codecs.get("echo4", block_size=64)) is not None


def test_bad_shapes_name_the_value():
    with pytest.raises(ValueError, match="100 groups"):
        me.compress(jnp.ones((100, 128), jnp.bfloat16), ECHO4)
    with pytest.raises(ValueError, match="int32"):
        me.compress(jnp.ones((128, 128), jnp.int32), ECHO4)
    with pytest.raises(ValueError, match="w.shape"):
        me.decompress(jnp.zeros((128, 64), jnp.uint8), ECHO4)
    with pytest.raises(ValueError, match="out_dtype"):
        me.decompress(jnp.zeros((128, 72), jnp.uint8), ECHO4, jnp.int8)


# -- on a Hopper GPU: the bytes ----------------------------------------------------------------
def _hopper() -> bool:
    try:
        dev = jax.devices("gpu")[0]
    except RuntimeError:
        return False
    return "H100" in dev.device_kind or "H200" in dev.device_kind or "H800" in dev.device_kind


gpu = pytest.mark.skipif(not _hopper(), reason="Mosaic GPU kernels run on a Hopper GPU")


def _input(dtype, n_groups=128 * 40):
    """Normal values of per-group scales, with the groups the math must get right: all
    zero, one sign only, a NaN, ±Inf, ties at half a step, tiny and huge values."""
    k1, k2 = jax.random.split(jax.random.key(0))
    x = jax.random.normal(k1, (n_groups, 128)) * jnp.exp(3 * jax.random.normal(k2, (n_groups,
                                                                                      1)))
    x = x.at[0].set(0.0).at[1].set(jnp.abs(x[1])).at[2].set(-jnp.abs(x[2]))
    x = x.at[3, 5].set(jnp.nan).at[4, 7].set(jnp.inf).at[5, 0].set(-jnp.inf)
    x = x.at[6].set(jnp.arange(128, dtype=jnp.float32) / 2 - 30)     # ties
    x = x.at[7].set(1e-38).at[8].set(3e38).at[8, 0].set(-3e38)
    return x.astype(dtype)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_compress_writes_the_reference_bytes(dtype):
    x = _input(dtype)
    got = np.asarray(me.compress(x, ECHO4))
    want = np.asarray(jax.jit(ECHO4.compress_reference)(x))    # XLA's 1/s on the GPU
    bad = np.nonzero((got != want).any(axis=1))[0]
    assert bad.size == 0, f"{bad.size} groups differ, first {bad[:8]}"


@gpu
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_gpu_decompress_is_the_reference(out_dtype):
    w = ECHO4.compress_reference(_input(jnp.float32))
    got = np.asarray(me.decompress(w, ECHO4, out_dtype), np.float32)
    want = np.asarray(jax.jit(ECHO4.decompress_reference, static_argnums=1)(w, out_dtype),
                      np.float32)
    np.testing.assert_array_equal(got, want)
