"""The one-launch fused all-reduce kernels (taco_jax/kernels/fused/) on CPU.

Mosaic GPU kernels do not run in Pallas' interpreter, so here the real kernel is traced
and lowered for a CUDA target: inside `taco_jax.psum(transport="fused")` on 1-, 2- and
3-axis meshes (peers addressed by axis name), under both check_vma modes, and as the
one-GPU loopback for P = 2, 4, 8. Its numerics run on a Hopper GPU (`python -m
bench.fused`); the reference it is checked against is tested here.
"""
import dataclasses
from unittest import mock

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from taco_jax import codecs
from taco_jax.collectives import fused, two_shot
from taco_jax.kernels import fused as fa, mosaic, tile_codec
from taco_jax.kernels.fused import one_shot, two_shot as fts

from meshes import per_device

TACO = codecs.get("taco")
ECHO4 = codecs.get("echo4")

from fused_lowering import cached, lowered_psum, peer_addressed, rel_l2, scratch_bytes


@pytest.mark.parametrize("shape,names", [((2,), ("tp",)), ((1, 2), ("data", "tp")),
                                         ((1, 1, 2), ("data", "pipe", "tp")),
                                         ((2, 1, 2), ("data", "pipe", "tp"))])
@pytest.mark.parametrize("vma", [False, True])
def test_one_launch_lowers_on_meshes_of_one_two_three_axes(gpu_here, shape, names, vma):
    text = lowered_psum(shape, names, "tp", vma)
    assert text.count("taco_fused_allreduce") >= 1
    assert text.count("mosaic_gpu") >= 1 and text.count("custom_call") == 1   # one launch


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_one_launch_lowers_for_f32_and_f16(gpu_here, dtype):
    text = lowered_psum((2,), ("tp",), "tp", False, dtype=dtype)
    assert text.count("custom_call") == 1


def test_uncovered_calls_take_the_three_launch_schedules(gpu_here):
    """An int8 codec (no tile codec) at P = 2 and 4: compress/exchange/decode kernels, never
    a one-launch kernel; echo4 at P = 4 takes the two-shot (where its checks passed)."""
    for p in (2, 4):
        text = lowered_psum((p,), ("tp",), "tp", False, codec="taco-int8")
        assert "taco_fused_allreduce" not in text and "taco_fused_two_shot" not in text
        assert "taco_fused_exchange" in text
    text = lowered_psum((4,), ("tp",), "tp", False, codec="echo4")
    assert "taco_fused_two_shot" in text and "taco_fused_exchange" not in text


@pytest.mark.parametrize("p,dtype", [(2, jnp.bfloat16), (2, jnp.float32), (4, jnp.bfloat16),
                                     (8, jnp.bfloat16), (8, jnp.float32)])
def test_loopback_lowers_and_fits_shared_memory(p, dtype):
    assert fa.smem_bytes(p, TACO, dtype) + fa.SMEM_RESERVED <= fa.SMEM_PER_SM
    # the default given, not None: test_calls_without_a_config_launch_the_default traces
    # the None call afresh
    cfg = fa.default_config(TACO, p, dtype)
    assert lowered_loopback(p, dtype, cfg).count("taco_fused_allreduce") >= 1


@cached
def lowered_loopback(p, dtype, cfg, n=64 * 256 * 3 + 17):
    x = jax.ShapeDtypeStruct((p, n), dtype)
    return jax.jit(lambda v: fa.one_shot_loopback(v, TACO, cfg)).trace(x).lower(
        lowering_platforms=("cuda",)).as_text()


_KNOB_CASES = [(2, jnp.bfloat16), (4, jnp.float32)]


# each knob at one of the two configurations, alternating (every knob covered at half the
# lowerings)
@pytest.mark.parametrize("ablate,p,dtype",
                         [(k, *_KNOB_CASES[i % 2]) for i, k in enumerate(fa.ABLATIONS)])
def test_every_measurement_knob_lowers(ablate, p, dtype):
    cfg = fa.FusedConfig(ablate=ablate)
    assert lowered_loopback(p, dtype, cfg).count("taco_fused_allreduce") >= 1


def test_knobs_change_the_kernel():
    """Each knob lowers to a different kernel than the plain one (none is a silent no-op)."""
    texts = {a: lowered_loopback(2, jnp.bfloat16, fa.FusedConfig(ablate=a))
             for a in fa.ABLATIONS}
    texts["slim"] = lowered_loopback(2, jnp.bfloat16, fa.FusedConfig(
        x_slots=1, out_store="registers", per_sm=2))
    assert len(set(texts.values())) == len(texts)


@pytest.mark.parametrize("ablate", ["no_peer_stores", "no_signal", "decode_twice"])
def test_knobs_lower_on_two_gpus(ablate):
    """The Remote form (remote_ref stores, peer semaphores) with a knob, under shard_map: one
    launch, addressing its peer's buffers."""
    mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2])
    cfg = fa.FusedConfig(ablate=ablate)
    f = jax.shard_map(lambda v: fa.one_shot_allreduce(v[0], "tp", 2, TACO, cfg=cfg)[None],
                      mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False)
    x = jax.ShapeDtypeStruct((2, 3, 5000), jnp.bfloat16,
                             sharding=NamedSharding(mesh, P("tp")))
    text = jax.jit(f).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("taco_fused_allreduce") >= 1 and peer_addressed(text) == [True]


@pytest.mark.parametrize("p", [2, 8])
def test_two_programs_per_multiprocessor_fit_when_slim(p):
    """x_slots=1 and results stored from registers: half the shared memory, so per_sm=2
    doubles the grid (every program still resident); the default layout is refused."""
    slim = fa.FusedConfig(x_slots=1, out_store="registers", per_sm=2)
    assert 2 * (fa.smem_bytes(p, TACO, jnp.bfloat16, cfg=slim) + fa.SMEM_RESERVED) \
        <= fa.SMEM_PER_SM < 2 * (fa.smem_bytes(p, TACO, jnp.bfloat16) + fa.SMEM_RESERVED)
    assert slim.grid(10_000, p) == 2 * mosaic.sm_count() // p
    assert lowered_loopback(p, jnp.bfloat16, slim).count("taco_fused_allreduce") >= 1
    with pytest.raises(ValueError, match=r"per_sm=2.*KiB of shared memory"):
        lowered_loopback(p, jnp.bfloat16, fa.FusedConfig(per_sm=2))
    with pytest.raises(ValueError, match="float32"):      # f32 input never fits twice
        lowered_loopback(p, jnp.float32, slim)


def test_default_launch_shape_is_two_slim_programs_per_sm_where_they_fit():
    """The measured default: at P = 2 for the FP8 codecs' 16-bit input the warp-specialized
    kernel; above, 2 programs per multiprocessor with half the shared memory; one per
    multiprocessor for f32 input (its staging does not fit twice). echo4 runs 2 programs a
    multiprocessor for every input dtype (its staging is small enough twice, f32 too). The
    FP8 codecs' decode stores each part once summed and sums the P accumulators first, and
    at P = 2 decodes this device's tile from its staging; echo4 has no transform to sum
    before."""
    for p in (2, 4, 8):
        fp8 = dict(store_parts=True, decode="sum_first", own_from_smem=p == 2)
        slim = dataclasses.replace(fa.SLIM_2_PER_SM, **fp8)
        for dt in (jnp.bfloat16, jnp.float16):
            ws = fa.FusedConfig(**fp8, warp_specialized=True, per_sm=1) if p == 2 else None
            assert fa.default_config(TACO, p, dt) == (ws or slim)
        assert fa.default_config(TACO, p, jnp.float32) == fa.FusedConfig(**fp8)
        for dt in (jnp.bfloat16, jnp.float16, jnp.float32):
            assert fa.default_config(codecs.get("echo4"), p, dt) == fa.SLIM_2_PER_SM


def test_calls_without_a_config_launch_the_default(monkeypatch):
    seen = []
    launch = one_shot._launch
    monkeypatch.setattr(one_shot, "_launch", lambda *a, **k: seen.append(a[4]) or launch(*a, **k))
    for dt in (jnp.bfloat16, jnp.float32):
        lowered_loopback.__wrapped__(2, dt, None)
    assert seen == [fa.default_config(TACO, 2, jnp.bfloat16),
                    fa.default_config(TACO, 2, jnp.float32)]
    assert seen[0].warp_specialized and not seen[1].warp_specialized
    assert seen[0].decode == "sum_first" and seen[0].own_from_smem and seen[1].own_from_smem


@pytest.mark.parametrize("p,dtype,codec,match", [
    (1, jnp.bfloat16, "taco", "P=1"), (9, jnp.bfloat16, "taco", "P=9"),
    (2, jnp.int32, "taco", "int32"), (2, jnp.bfloat16, "taco-int8", "taco-int8")])
def test_bad_calls_name_the_value(p, dtype, codec, match):
    with pytest.raises(ValueError, match=match):
        fa.one_shot_loopback(jnp.ones((p, 512), dtype), codecs.get(codec))


def test_empty_input_launches_nothing():
    assert fa.one_shot_loopback(jnp.ones((2, 0), jnp.bfloat16), TACO).shape == (2, 0)


def test_config_refuses_more_programs_than_fit():
    with pytest.raises(ValueError, match="programs=200"):
        fa.FusedConfig(programs=200).grid(1000, 1)
    assert fa.FusedConfig().grid(3, 8) == 3          # never more programs than tiles
    with pytest.raises(ValueError, match="parts=3"):
        fa.FusedConfig(parts=3)
    for field, bad in [("ablate", "no_wire"), ("x_slots", 3), ("out_store", "dma"),
                       ("per_sm", 5), ("per_sm", 0)]:
        with pytest.raises(ValueError, match=f"{field}="):
            fa.FusedConfig(**{field: bad})


# -- decode="sum_first": the P accumulators scaled and summed before one butterfly -------------
SUM_FIRST = fa.FusedConfig(decode="sum_first")


@pytest.mark.parametrize("p,cfg,dtype", [
    (2, SUM_FIRST, jnp.bfloat16), (4, SUM_FIRST, jnp.float32),
    (2, fa.FusedConfig(decode="sum_first", parts=1), jnp.bfloat16),
    (4, dataclasses.replace(fa.SLIM_2_PER_SM, decode="sum_first"), jnp.float16)])
def test_sum_first_lowers_in_loopback_and_changes_the_kernel(p, cfg, dtype):
    """P = 2 (both tiles resident) and P ≥ 3 (tiles streamed through two slots; P = 8 runs
    the same code as 4, more sources): one kernel, not the per-source decode's."""
    text = lowered_loopback(p, dtype, cfg)
    assert text.count("taco_fused_allreduce") >= 1
    assert text != lowered_loopback(p, dtype, dataclasses.replace(cfg, decode="per_source"))


WS = dataclasses.replace(fa.default_config(TACO, 2, jnp.bfloat16), warp_specialized=True,
                         per_sm=1)


@pytest.mark.parametrize("cfg", [SUM_FIRST, fa.FusedConfig(encode_parts=2), WS],
                         ids=["sum_first", "encode_parts=2", "warp_specialized"])
def test_options_lower_on_a_three_axis_mesh(cfg):
    mesh = jax.make_mesh((2, 1, 2), ("data", "pipe", "tp"), devices=jax.devices()[:4])
    names = ("data", "pipe", "tp")
    f = jax.shard_map(lambda v: fa.one_shot_allreduce(v[0], "tp", 2, TACO, cfg=cfg)[None],
                      mesh=mesh, in_specs=P(names), out_specs=P(names), check_vma=False)
    x = jax.ShapeDtypeStruct((4, 3, 5000), jnp.bfloat16, sharding=NamedSharding(mesh, P(names)))
    text = jax.jit(f).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("taco_fused_allreduce") >= 1 and text.count("custom_call") == 1


def test_sum_first_is_refused_where_it_has_no_meaning():
    with pytest.raises(ValueError, match="decode='sideways'"):
        fa.FusedConfig(decode="sideways")
    with pytest.raises(ValueError, match="echo4 has no transform"):
        fa.one_shot_loopback(jnp.ones((2, 512), jnp.bfloat16), codecs.get("echo4"),
                              SUM_FIRST)
    with pytest.raises(ValueError, match="two-shot kernel takes no decode"):
        fts.two_shot_loopback(jnp.ones((3, 512), jnp.bfloat16), TACO, SUM_FIRST)


# -- encode_parts=2: the encode in two column halves ------------------------------------------
@pytest.mark.parametrize("p,cfg,dtype", [
    (2, fa.FusedConfig(encode_parts=2), jnp.bfloat16),
    (2, dataclasses.replace(fa.SLIM_2_PER_SM, encode_parts=2), jnp.bfloat16),
    (4, fa.FusedConfig(encode_parts=2, decode="sum_first"), jnp.float32)])
def test_encode_halves_lower_in_loopback_and_change_the_kernel(p, cfg, dtype):
    text = lowered_loopback(p, dtype, cfg)
    assert text.count("taco_fused_allreduce") >= 1
    assert text != lowered_loopback(p, dtype, dataclasses.replace(cfg, encode_parts=1))


def test_encode_halves_are_refused_where_they_have_no_meaning():
    with pytest.raises(ValueError, match="encode_parts=4"):
        fa.FusedConfig(encode_parts=4)
    with pytest.raises(ValueError, match="echo4's encode has no column passes"):
        fa.one_shot_loopback(jnp.ones((2, 512), jnp.bfloat16), codecs.get("echo4"),
                              fa.FusedConfig(encode_parts=2))
    with pytest.raises(ValueError, match="encode_parts=2"):
        fts.two_shot_loopback(jnp.ones((3, 512), jnp.bfloat16), TACO,
                              fa.FusedConfig(encode_parts=2))


# -- store_parts: each column part stored as soon as it is summed ----------------------------
@pytest.mark.parametrize("p,cfg,dtype", [
    (2, dataclasses.replace(fa.SLIM_2_PER_SM, store_parts=True), jnp.bfloat16),
    (2, fa.FusedConfig(store_parts=True), jnp.bfloat16),               # results by TMA
    (4, fa.FusedConfig(store_parts=True, decode="sum_first"), jnp.float32),
    (4, fa.FusedConfig(store_parts=True), jnp.float16)])
def test_store_parts_lowers_in_loopback_and_changes_the_kernel(p, cfg, dtype):
    text = lowered_loopback(p, dtype, cfg)
    assert text.count("taco_fused_allreduce") >= 1
    assert text != lowered_loopback(p, dtype, dataclasses.replace(cfg, store_parts=False))


@pytest.mark.parametrize("field", ["store_parts", "own_from_smem"])
def test_decode_options_lower_for_echo4_and_on_a_three_axis_mesh(field):
    cfg = fa.FusedConfig(**{field: True})
    xs = jax.ShapeDtypeStruct((2, 64 * 256 * 3), jnp.bfloat16)
    f = lambda v: fa.one_shot_loopback(v, codecs.get("echo4"), cfg)         # noqa: E731
    assert jax.jit(f).trace(xs).lower(lowering_platforms=("cuda",)).as_text().count(
        "custom_call") == 1
    mesh = jax.make_mesh((2, 1, 2), ("data", "pipe", "tp"), devices=jax.devices()[:4])
    names = ("data", "pipe", "tp")
    taco = dataclasses.replace(fa.default_config(TACO, 2, jnp.bfloat16), **{field: True})
    g = jax.shard_map(lambda v: fa.one_shot_allreduce(v[0], "tp", 2, TACO, cfg=taco)[None],
                      mesh=mesh, in_specs=P(names), out_specs=P(names), check_vma=False)
    x = jax.ShapeDtypeStruct((4, 3, 5000), jnp.bfloat16, sharding=NamedSharding(mesh, P(names)))
    assert jax.jit(g).trace(x).lower(lowering_platforms=("cuda",)).as_text().count(
        "custom_call") == 1


def test_store_parts_is_refused_where_it_has_no_meaning():
    with pytest.raises(ValueError, match="store_parts="):
        fa.FusedConfig(store_parts=1)
    with pytest.raises(ValueError, match="store_parts=True"):
        fts.two_shot_loopback(jnp.ones((3, 512), jnp.bfloat16), TACO,
                              fa.FusedConfig(store_parts=True))


def _most_per_sm(p, codec, dtype, cfg):
    fit = 0
    for n in (1, 2, 3, 4):
        try:
            one_shot._check_resident(p, codec, dtype, dtype, dataclasses.replace(cfg, per_sm=n))
        except ValueError:
            break
        fit = n
    return fit


SLIM = dict(x_slots=1, out_store="registers")
_LAYOUTS = {"default": {}, "slim": SLIM}


@pytest.mark.parametrize("codec,dtype,layout,kib,most", [
    # taco, 16-bit: x tile 32 KiB, staging/receive slots 16.5 → 17 KiB each, 2 operands
    ("taco", jnp.bfloat16, "default", 165, 1), ("taco", jnp.bfloat16, "slim", 101, 2),
    ("taco", jnp.float16, "slim", 101, 2),
    # f32 input: a 64 KiB input slot and its 32 KiB bf16 copy never fit twice
    ("taco", jnp.float32, "default", 165, 1), ("taco", jnp.float32, "slim", 165, 1),
    # echo4: 9 KiB wire tiles, no operands
    ("echo4", jnp.bfloat16, "default", 133, 1), ("echo4", jnp.bfloat16, "slim", 69, 3),
    ("echo4", jnp.float32, "slim", 101, 2)])
def test_programs_per_sm_that_fit(codec, dtype, layout, kib, most):
    codec = codecs.get(codec)
    cfg = fa.FusedConfig(**_LAYOUTS[layout])
    for p in (2, 8):                                  # the semaphores are not shared memory
        assert fa.smem_bytes(p, codec, dtype, cfg=cfg) == kib * 1024
        assert _most_per_sm(p, codec, dtype, cfg) == most


def test_refusals_name_the_layout_and_what_it_needs():
    echo4 = codecs.get("echo4")
    three = fa.FusedConfig(per_sm=3, **SLIM)

    def lowered_echo4(cfg):
        x = jax.ShapeDtypeStruct((2, 64 * 256 * 3 + 17), jnp.bfloat16)
        return jax.jit(lambda v: fa.one_shot_loopback(v, echo4, cfg)).trace(x).lower(
            lowering_platforms=("cuda",)).as_text()
    assert lowered_echo4(three).count("taco_fused_allreduce") >= 1     # 3 × 70 KiB fit
    with pytest.raises(ValueError, match=r"per_sm=4, x_slots=1, out_store='registers'\): 4 "
                                         r"programs need 280 KiB .*P=2, bfloat16"):
        lowered_echo4(dataclasses.replace(three, per_sm=4))
    with pytest.raises(ValueError, match=r"per_sm=3.*306 KiB.*P=2, bfloat16"):
        lowered_loopback(2, jnp.bfloat16, three)                        # taco: 101 KiB each
    assert three.grid(10_000, 2) == 3 * mosaic.sm_count() // 2


@pytest.mark.parametrize("codec,dtype,cfg", [
    ("taco", jnp.bfloat16, fa.FusedConfig()), ("taco", jnp.bfloat16, fa.SLIM_2_PER_SM),
    ("taco", jnp.float32, fa.FusedConfig()), ("echo4", jnp.bfloat16, fa.FusedConfig()),
    ("echo4", jnp.bfloat16, fa.FusedConfig(per_sm=3, **SLIM))])
def test_smem_bytes_is_what_the_lowering_allocates(monkeypatch, codec, dtype, cfg):
    """The shared memory Pallas allocates for the kernel's scratch (each buffer aligned to
    1 KiB) is smem_bytes less its 1 KiB for the barriers: the residency check counts what
    the kernel takes, no more, no less."""
    codec = codecs.get(codec)
    x = jax.ShapeDtypeStruct((2, 64 * 256 * 3 + 17), dtype)
    allocated = scratch_bytes(monkeypatch, lambda v: fa.one_shot_loopback(v, codec, cfg), x)
    assert allocated + 1024 == fa.smem_bytes(2, codec, dtype, cfg=cfg)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_reference_is_the_one_shot(dtype):
    """The reference is what the three-launch one-shot computes (Σ_j decode(encode(x_j)) in
    device order), for f32 from the bf16 rounding of the input, as the kernel encodes."""
    x = jax.random.normal(jax.random.key(0), (2, 3, 700), jnp.float32).astype(dtype)
    want = per_device(lambda v: two_shot.one_shot(v.astype(jnp.bfloat16), "tp", TACO, 2,
                                                  False), x)
    got = fa.one_shot_reference(x, TACO)
    assert got.dtype == dtype and got.shape == x.shape[1:]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want[0], np.float32),
                               rtol=1e-2, atol=1e-2)


# -- echo4 through the tile codec --------------------------------------------------------------


@pytest.mark.parametrize("shape,names", [((2,), ("tp",)), ((1, 2), ("data", "tp")),
                                         ((2, 1, 2), ("data", "pipe", "tp"))])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_echo4_lowers_on_meshes_of_one_two_three_axes(shape, names, dtype):
    """The Remote form with echo4's tile math, peers addressed by axis name: one launch,
    addressing the peers' buffers."""
    n = int(np.prod(shape))
    mesh = jax.make_mesh(shape, names, devices=jax.devices()[:n])
    f = jax.shard_map(lambda v: fa.one_shot_allreduce(v[0], "tp", 2, ECHO4)[None], mesh=mesh,
                      in_specs=P(names), out_specs=P(names), check_vma=False)
    x = jax.ShapeDtypeStruct((n, 3, 5000), dtype, sharding=NamedSharding(mesh, P(names)))
    text = jax.jit(f).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("taco_fused_allreduce") >= 1 and text.count("custom_call") == 1
    assert peer_addressed(text) == [True]


@cached
def lowered_echo4_loopback(p, dtype, cfg=None, n=64 * 256 * 3 + 17):
    x = jax.ShapeDtypeStruct((p, n), dtype)
    return jax.jit(lambda v: fa.one_shot_loopback(v, ECHO4, cfg)).trace(x).lower(
        lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float16])
def test_echo4_loopback_lowers_and_fits_shared_memory(p, dtype):
    assert fa.smem_bytes(p, ECHO4, dtype) + fa.SMEM_RESERVED <= fa.SMEM_PER_SM
    assert lowered_echo4_loopback(p, dtype).count("taco_fused_allreduce") >= 1


@pytest.mark.parametrize("cfg", [fa.FusedConfig(parts=1),
                                 fa.FusedConfig(ablate="decode_twice"),
                                 fa.FusedConfig()])
def test_echo4_lowers_with_the_kernels_knobs(cfg):
    assert lowered_echo4_loopback(2, jnp.bfloat16, cfg).count("taco_fused_allreduce") >= 1


def test_echo4_and_taco_lower_to_different_kernels():
    """The tile codec is really switched (not taco's math on echo4's buffers)."""
    assert lowered_echo4_loopback(2, jnp.bfloat16) != lowered_loopback(
        2, jnp.bfloat16, fa.FusedConfig())
    assert isinstance(tile_codec.for_codec(ECHO4), mosaic.echo4.Echo4Tiles)
    assert isinstance(tile_codec.for_codec(TACO), mosaic.taco_tiles.TacoTiles)
    assert tile_codec.for_codec(ECHO4).row_bytes == 144
    assert tile_codec.for_codec(TACO).row_bytes == 264


def test_echo4_is_selected_by_the_collectives(gpu_here, all_checked):
    """Where echo4's loopback checks have passed, at P = 2 it takes the one-launch kernel,
    like taco."""
    assert fused.one_launch_reason(ECHO4, 2, jnp.bfloat16) is None
    assert fused.one_launch_reason(TACO, 2, jnp.bfloat16) is None
    text = lowered_psum((2,), ("tp",), "tp", False, codec="echo4")
    assert "taco_fused_allreduce" in text and "taco_fused_exchange" not in text


def test_what_has_not_passed_its_checks_is_not_selected(gpu_here):
    """Selection is per (kernel, codec, dtype) of the checked table, as this jax lowers
    them: a dtype, a codec of the same tile math, a codec's other configuration or a
    table of another jax's modules without passing checks takes the three-launch schedule
    (compress, exchange, decode_sum), never the one-launch kernel."""
    from fused_lowering import assumed_checked
    from taco_jax.kernels.fused import checked
    with assumed_checked([("one_shot", "taco", "bfloat16")]):
        assert fused.one_launch_reason(TACO, 2, jnp.bfloat16) is None
        for codec, dtype in [(TACO, jnp.float16), (codecs.get("taco-e5m2"), jnp.bfloat16),
                             (ECHO4, jnp.bfloat16)]:
            why = fused.one_launch_reason(codec, 2, dtype)
            assert why is not None and "no passing loopback checks" in why, why
        assert "two-shot" in fused.one_launch_reason(TACO, 4, jnp.bfloat16)
        why = fused.one_launch_reason(codecs.get("taco", fmt="e5m2"), 2, jnp.bfloat16)
        assert "not its registered configuration" in why
        with mock.patch.object(checked, "JAX", "0.0.0"):     # fingerprints of another jax
            why = fused.one_launch_reason(TACO, 2, jnp.bfloat16)
            assert why is not None and "checked as jax 0.0.0 lowers it" in why, why
    text = lowered_psum((2,), ("tp",), "tp", False, codec="echo4",
                        checked=(("one_shot", "taco", "bfloat16"),))
    assert "taco_fused_allreduce" not in text and "taco_fused_exchange" in text


@pytest.mark.parametrize("codec,match", [("int4-sym", "int4-sym"), ("tah4", "tah4")])
def test_other_4bit_codecs_are_refused_by_name(codec, match):
    with pytest.raises(ValueError, match=match):
        fa.one_shot_loopback(jnp.ones((2, 512), jnp.bfloat16), codecs.get(codec))


@pytest.mark.parametrize("p,dtype", [(3, jnp.bfloat16), (4, jnp.float32), (8, jnp.float16)])
def test_two_shot_lowers_for_echo4(p, dtype):
    x = jax.ShapeDtypeStruct((p, 64 * 256 * 5 + 17), dtype)
    text = jax.jit(lambda v: fts.two_shot_loopback(v, ECHO4)).trace(x).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("taco_fused_two_shot") >= 1 and text.count("custom_call") == 1


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_echo4_reference_is_the_xla_one_shot(dtype):
    """The echo4 reference is the xla transport's one-shot (compress, all-gather,
    decode_sum: Σ_j decode(encode(x_j)) in device order), f32 encoded as it is (echo4 has no
    bf16 operand): equal up to the sum's last-bit rounding, and both err like the codec."""
    k1, k2 = jax.random.split(jax.random.key(0))
    x = (jax.random.normal(k1, (2, 3, 700)) * jnp.exp(jax.random.normal(k2, (2, 1, 1))))
    x = x.astype(dtype)
    want = per_device(lambda v: two_shot.one_shot(v, "tp", ECHO4, 2, False), x)
    got = fa.one_shot_reference(x, ECHO4)
    assert got.dtype == dtype and got.shape == x.shape[1:]
    exact = np.sum(np.asarray(x, np.float64), axis=0)
    err = rel_l2(got, exact)
    assert 0.01 < err < 0.2                                   # 4-bit codes: a few percent
    assert rel_l2(got, want[0]) < 1e-2 * err
    if dtype == jnp.float32:        # encoded from f32: the bf16 rounding would move codes
        via_bf16 = fa.one_shot_reference(x.astype(jnp.bfloat16).astype(dtype), ECHO4)
        assert not np.array_equal(np.asarray(got), np.asarray(via_bf16))


def test_echo4_reference_keeps_non_finite_groups_nan():
    x = jax.random.normal(jax.random.key(1), (2, 64 * 256)).astype(jnp.bfloat16)
    x = x.at[0, 5].set(jnp.nan).at[1, 1000].set(-jnp.inf)
    y = np.asarray(fa.one_shot_reference(x, ECHO4), np.float32)
    grp = np.arange(y.size) // 128
    bad = np.isin(grp, [0, 1000 // 128])
    assert np.isnan(y[bad]).all() and np.isfinite(y[~bad]).all()


# -- own_from_smem: this device's tile decoded from its staging -------------------------------
@pytest.mark.parametrize("cfg,dtype", [
    (dataclasses.replace(fa.default_config(TACO, 2, jnp.bfloat16), warp_specialized=False,
                         x_slots=1, out_store="registers", per_sm=2), jnp.bfloat16),
    (fa.default_config(TACO, 2, jnp.float32), jnp.float32),
    (fa.FusedConfig(), jnp.bfloat16),                                   # results by TMA
    (fa.FusedConfig(parts=1), jnp.float16)])
def test_own_from_smem_lowers_in_loopback_and_changes_the_kernel(cfg, dtype):
    own = dataclasses.replace(cfg, own_from_smem=True)
    text = lowered_loopback(2, dtype, own)
    assert text.count("taco_fused_allreduce") >= 1
    assert text != lowered_loopback(2, dtype, dataclasses.replace(cfg, own_from_smem=False))


def test_own_from_smem_takes_one_receive_slot_less():
    for dt in (jnp.bfloat16, jnp.float32):
        own = dataclasses.replace(fa.default_config(TACO, 2, dt), warp_specialized=False)
        cfg = dataclasses.replace(own, own_from_smem=False)
        saved = fa.smem_bytes(2, TACO, dt, cfg=cfg) - fa.smem_bytes(2, TACO, dt, cfg=own)
        assert abs(saved - 64 * TACO.row_bytes) < 1024        # one wire tile (1 KiB rounding)


def test_own_from_smem_is_refused_where_it_has_no_meaning():
    with pytest.raises(ValueError, match="own_from_smem=1"):
        fa.FusedConfig(own_from_smem=1)
    with pytest.raises(ValueError, match="own_from_smem=True.*P=4"):
        fa.one_shot_loopback(jnp.ones((4, 512), jnp.bfloat16), TACO,
                              fa.FusedConfig(own_from_smem=True))
    with pytest.raises(ValueError, match="own_from_smem=True"):
        fts.two_shot_loopback(jnp.ones((3, 512), jnp.bfloat16), TACO,
                              fa.FusedConfig(own_from_smem=True))



# -- signals: release semantics ------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["psum", "loopback"])
def test_signals_are_released_increments(gpu_here, kind):
    """Each per-tile signal is red.release (the landed stores ordered before it), never a
    relaxed increment (plgpu.semaphore_signal_parallel's, fenced only after it)."""
    text = (lowered_psum((2,), ("tp",), "tp", False) if kind == "psum" else
            lowered_loopback(2, jnp.bfloat16, fa.default_config(TACO, 2, jnp.bfloat16)))
    assert "red.release.sys.global.add" in text and "red.relaxed" not in text


# -- warp_specialized: math and transport in warpgroups of their own ----------------------------
@pytest.mark.parametrize("n", [17, 64 * 256 * 3 + 17, 64 * 256 * 301])
def test_warp_specialized_lowers_in_loopback(n):
    """One launch of four warpgroups whose register budgets move (setmaxnreg), a different
    kernel from the one-warpgroup default; 1 tile, 3, and more than two streams per SM."""
    text = lowered_loopback(2, jnp.bfloat16, WS, n=n)
    assert text.count("taco_fused_allreduce") >= 1 and "setmaxnreg" in text
    assert "red.release.sys" in text and "red.relaxed" not in text
    if n == 17:
        one_wg = dataclasses.replace(WS, warp_specialized=False, x_slots=1,
                                     out_store="registers", per_sm=2)
        assert text != lowered_loopback(2, jnp.bfloat16, one_wg, n=n)


def test_warp_specialized_is_refused_where_it_has_no_meaning():
    with pytest.raises(ValueError, match="warp_specialized=True"):
        fa.FusedConfig(warp_specialized=True, per_sm=1)               # not own_from_smem
    with pytest.raises(ValueError, match="per_sm=1"):
        dataclasses.replace(WS, per_sm=2)
    with pytest.raises(ValueError, match="float32 input"):
        fa.one_shot_loopback(jnp.ones((2, 512), jnp.float32), TACO, WS)
    with pytest.raises(ValueError, match="echo4"):
        fa.one_shot_loopback(jnp.ones((2, 512), jnp.bfloat16), codecs.get("echo4"),
                              dataclasses.replace(WS, decode="per_source", store_parts=False))


# -- the reference's contract with the kernel (reference_mismatch) -------------------------
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_results_may_differ_from_the_reference_by_one_code_step_not_two(dtype):
    x = jax.random.normal(jax.random.key(5), (2, 64 * 256 + 300), jnp.float32).astype(dtype)
    want = fa.one_shot_reference(x, TACO)
    steps = fa.reference_steps(x, TACO)
    assert steps.shape == want.shape and bool(jnp.all(steps > 0))
    assert fa.reference_mismatch(want, x, TACO) is None
    k = 4321
    up = (want.astype(jnp.float32).at[k].add(steps[k] * 0.98)).astype(dtype)
    down = (want.astype(jnp.float32).at[k].add(-steps[k] * 0.98)).astype(dtype)
    assert fa.reference_mismatch(up, x, TACO) is None
    assert fa.reference_mismatch(down, x, TACO) is None
    far = (want.astype(jnp.float32).at[k].add(2 * steps[k])).astype(dtype)
    why = fa.reference_mismatch(far, x, TACO)
    assert why is not None and "#4321" in why and "code step" in why
    nan = fa.reference_mismatch(want.at[7].set(jnp.nan), x, TACO)
    assert nan is not None and "NaN" in nan


def test_an_echo4_code_step_is_its_scale():
    x = jax.random.normal(jax.random.key(7), (2, 1024), jnp.float32)
    want = fa.one_shot_reference(x, ECHO4)
    steps = np.asarray(fa.reference_steps(x, ECHO4))
    v = np.asarray(x[0]).reshape(-1, 128)
    s0 = (np.maximum(v.max(1), 0) - np.minimum(v.min(1), 0)) / 15        # asym_params' s
    assert np.all(steps.reshape(-1, 128)[:, 0] >= s0 * (1 - 1e-6))
    assert fa.reference_mismatch(want.at[3].add(steps[3] * 0.5), x, ECHO4) is None
    assert fa.reference_mismatch(want.at[3].add(steps[3] * 3), x, ECHO4) is not None
