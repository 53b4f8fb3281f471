"""Transports of the compressed all-reduce: selection and fallbacks, the one-shot schedule's
numerics (what every device computes, with lax's all-gather carrying the bytes), the fused
exchange's byte packing (its kernel replaced by lax), and the calibration cache. CPU."""
import json
import math

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import taco_jax
from taco_jax import calibrate, codecs, telemetry
from taco_jax.collectives import fused, two_shot

from codec_bounds import FACTOR, assert_blockwise_close, roundtrip_error
from meshes import lax_exchange_kernel, per_device


def gauss(shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# -- selection ----------------------------------------------------------------------------
def test_fused_transport_on_cpu_is_a_clear_error():
    with pytest.raises(ValueError, match="transport='fused' cannot run here: platform 'cpu'"):
        per_device(lambda v: taco_jax.psum(v, "tp", min_bytes=0, transport="fused"),
                   gauss((2, 512)))
    with pytest.raises(ValueError, match="transport='nccl'"):
        per_device(lambda v: taco_jax.psum(v, "tp", transport="nccl"), gauss((2, 512)))
    with pytest.raises(ValueError, match="'nccl'"):
        with taco_jax.config(transport="nccl"):
            pass


def test_fused_unavailable_reasons():
    assert "cpu" in fused.mesh_unavailable_reason(jax.make_mesh((2,), ("tp",)))
    # other axes are fine (peers are addressed by axis name); the device order is not
    assert "cpu" in fused.mesh_unavailable_reason(
        jax.make_mesh((2, 2), ("data", "tp"), devices=jax.devices()[:4]))
    devs = jax.devices()
    for order in ([devs[1], devs[0]], [devs[0], devs[2]]):
        mesh = jax.sharding.Mesh(np.array(order), ("tp",))
        assert "not 0..1 in order" in fused.mesh_unavailable_reason(mesh)
    f = jax.vmap(lambda v: jnp.asarray(fused.unavailable_reason(("tp",)) is not None),
                 axis_name="tp")
    assert bool(f(jnp.ones(2)).all())


def test_auto_on_cpu_takes_the_xla_transport():
    telemetry.clear_sites()
    x = gauss((2, 4, 256))
    y = per_device(lambda v: taco_jax.psum(v, "tp", min_bytes=0), x)
    with taco_jax.config(transport="xla"):
        y_xla = per_device(lambda v: taco_jax.psum(v, "tp", min_bytes=0), x)
    np.testing.assert_array_equal(y, y_xla)
    assert {s.transport for s, _ in telemetry.sites() if s.compressed} == {"xla"}


# -- the one-shot schedule ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_one_shot_is_the_ordered_sum_of_each_devices_decoded_codes(dtype):
    """Each device: Σ_j decode(encode(x_j)), j = 0, 1: one quantization per element, the same
    bits on both devices, and less error than the two-shot (which quantizes twice)."""
    c = codecs.get("taco")
    x = jnp.asarray(gauss((2, 5, 333), seed=1)).astype(dtype)
    y = per_device(lambda v: two_shot.one_shot(v, "tp", c, 2, False), x)
    assert (y[0] == y[1]).all() and y.dtype == np.dtype(dtype)
    dec = [np.asarray(c.roundtrip(x[j]), np.float32) for j in range(2)]
    want = np.asarray((jnp.asarray(dec[0]) + jnp.asarray(dec[1])).astype(dtype), np.float32)
    # the test's round trips are another program, where a value on a rounding boundary (or
    # a near-tie choice of scale) may go the other way: equal within the codec's error per
    # block, relative to the addends' magnitudes (bf16 results are rounded once more)
    tol = FACTOR * roundtrip_error("taco", x) + (0 if dtype == np.float32 else 2 ** -8)
    magnitudes = np.abs(np.asarray(x, np.float32)).sum(0)
    assert_blockwise_close(y[0].astype(np.float32), want, magnitudes, tol, 256, lead=0,
                           what="one-shot vs its definition")
    exact = np.asarray(x, np.float64).sum(0)
    y2 = per_device(lambda v: two_shot.two_shot(v, "tp", c, 2, False), x)
    assert rel(y[0].astype(np.float32), exact) < rel(y2[0].astype(np.float32), exact) < 0.05


def test_one_shot_identity_is_the_exact_sum_and_keeps_nan():
    x = gauss((2, 3, 256), seed=2)
    x[1, 0, 5] = np.nan
    c = codecs.get("none")
    y = per_device(lambda v: two_shot.one_shot(v, "tp", c, 2, False), x)
    ref = per_device(lambda v: lax.psum(v, "tp"), x)
    np.testing.assert_array_equal(y, ref)      # two f32 addends: the order cannot matter
    assert np.isnan(y[:, 0, 5]).all()


def test_one_shot_nonfinite_block_decodes_to_nan():
    x = gauss((2, 2, 256), seed=3)
    x[0, 1, 7] = np.inf
    y = per_device(lambda v: two_shot.one_shot(v, "tp", codecs.get("taco"), 2, False), x)
    assert np.isnan(y[:, 1]).all() and np.isfinite(y[:, 0]).all()


def test_one_shot_under_check_vma_is_invariant():
    x = gauss((2, 4, 256), seed=4)
    mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2])
    c = codecs.get("taco")
    with jax.set_mesh(mesh):
        xs = jax.device_put(jnp.asarray(x), NamedSharding(mesh, P("tp")))
        f = jax.shard_map(lambda b: two_shot.one_shot(b[0], "tp", c, 2, True), mesh=mesh,
                          in_specs=P("tp"), out_specs=P(), check_vma=True)
        y = np.asarray(jax.jit(f)(xs))
    assert rel(y, x.astype(np.float64).sum(0)) < 0.05


# -- the fused exchange's packing, with lax in place of the kernel -------------------------
@pytest.mark.parametrize("dtype", [jnp.uint8, jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("gather", [True, False])
def test_fused_exchange_packs_any_bytes(monkeypatch, dtype, gather):
    monkeypatch.setattr(fused, "exchange_kernel", lax_exchange_kernel)
    p = 4
    x = jnp.asarray(gauss((p, p, 3, 100), seed=5) * 50).astype(dtype)
    send = (lambda v: v[0]) if gather else (lambda v: v)
    got = per_device(lambda v: fused.exchange(send(v), "tp", p, gather=gather, vma=False), x)
    want = per_device(lambda v: two_shot.lax_exchange(send(v), "tp", p, gather=gather,
                                                      vma=False), x)
    np.testing.assert_array_equal(got, want)


def test_fused_schedules_with_lax_in_place_of_the_kernel(monkeypatch):
    """taco_jax.psum(transport="fused") end to end on CPU through the three-launch
    schedules, the exchange kernel emulated: P = 2 is the one-shot, P = 4 the two-shot (the
    xla transport's numbers, within the codec's error)."""
    monkeypatch.setattr(fused, "exchange_kernel", lax_exchange_kernel)
    monkeypatch.setattr(fused, "one_launch_reason", lambda codec, p, dtype: "emulated")
    monkeypatch.setattr(fused, "unavailable_reason", lambda axes: None)
    c = codecs.get("taco")
    x2 = gauss((2, 3, 300), seed=6)
    y = per_device(lambda v: taco_jax.psum(v, "tp", min_bytes=0, transport="fused"), x2)
    # each against another program: equal within the codec's error per block, relative to
    # the addends' magnitudes (a value on a rounding boundary may go either way in one)
    want = per_device(lambda v: two_shot.one_shot(v, "tp", c, 2, False), x2)
    assert_blockwise_close(y, want, np.broadcast_to(np.abs(x2).sum(0), y.shape),
                           FACTOR * roundtrip_error("taco", x2), 256, what="fused, P = 2")
    x4 = gauss((4, 3, 300), seed=7)
    y4 = per_device(lambda v: taco_jax.psum(v, "tp", min_bytes=0, transport="fused"), x4)
    want = per_device(lambda v: taco_jax.psum(v, "tp", min_bytes=0, transport="xla"), x4)
    assert_blockwise_close(y4, want, np.broadcast_to(np.abs(x4).sum(0), y4.shape),
                           FACTOR * roundtrip_error("taco", x4), 256, what="fused, P = 4")
    exact = per_device(lambda v: taco_jax.psum(v, "tp", codec="none", transport="fused"), x2)
    np.testing.assert_array_equal(exact, per_device(lambda v: lax.psum(v, "tp"), x2))



def test_a_fused_all_reduce_on_the_separate_kernels_says_so_and_why(monkeypatch):
    """Under transport "fused" an all-reduce the one-launch kernel does not run (its codec
    has no tile math; or it has, but no passing checks for the module it emits now) takes the
    separate kernels, and its site says so with the reason; one it runs reads "fused".
    Traced, not run."""
    from fused_lowering import assumed_checked
    monkeypatch.setattr(fused, "unavailable_reason", lambda axes: None)
    mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2])
    x = jax.ShapeDtypeStruct((2, 3, 300), jnp.bfloat16, sharding=NamedSharding(mesh, P("tp")))

    def transport(codec):
        f = jax.shard_map(lambda v: taco_jax.psum(v, "tp", codec=codec, min_bytes=0,
                                                  transport="fused"),
                          mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False)
        _, found = telemetry.traced_sites(lambda: jax.jit(f).trace(x))
        (site, _), = found
        return site.transport

    with assumed_checked([("one_shot", "taco", "bfloat16")]):
        assert transport("taco") == "fused"
        assert transport("taco-int8").startswith(
            "fused (separate kernels): taco-int8: transform ash, codes int8")
    with assumed_checked(()):
        got = transport("taco")
    assert got.startswith("fused (separate kernels): the one-launch one-shot kernel has no "
                          "passing loopback checks on a GPU for taco, bfloat16")


@pytest.mark.parametrize("p,gather", [(2, True), (2, False), (4, True), (4, False)])
def test_exchange_kernel_lowers_for_cuda(p, gather):
    """The Mosaic GPU exchange kernel itself (not run: it needs 2+ GPUs) traces and lowers
    to one Mosaic GPU custom call for a CUDA target from this CPU-only machine."""
    mesh = jax.make_mesh((p,), ("tp",), devices=jax.devices()[:p])
    shape = (p, 3 * fused.TILE_BYTES) if gather else (p, p, fused.TILE_BYTES + 5)

    def body(v):
        return fused.exchange(v[0], "tp", p, gather=gather, vma=False)[None]
    f = jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False)
    x = jax.ShapeDtypeStruct(shape, jnp.uint8, sharding=jax.NamedSharding(mesh, P("tp")))
    text = jax.jit(f).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 1 and text.count("custom_call") == 1


# -- the calibration cache ------------------------------------------------------------------
def _cal(rows, codec="taco", n=2, key=None):
    return calibrate.Calibration("tp", codec, 0.97, tuple(rows), calibrate.decide_min_bytes(
        rows, 0.97, "xla_ratio"), n, key or calibrate.machine_key(n))


ROWS = [{"mib": 1 / 1024, "lax_us": 10.0, "xla_us": 30.0, "xla_ratio": 3.0},
        {"mib": 1 / 64, "lax_us": 100.0, "xla_us": 50.0, "xla_ratio": 0.5}]


def test_cache_round_trip_and_routes(tmp_path, monkeypatch):
    path = tmp_path / "cal.json"
    monkeypatch.setenv(calibrate.CACHE_ENV, str(path))
    calibrate.save(_cal(ROWS))
    cal = calibrate.lookup(2, "taco")
    assert cal is not None and cal.rows == tuple(ROWS) and cal.min_bytes == 2**20 // 64
    assert cal.route(100) == "lax"                       # below the smallest size
    assert cal.route(2**20 // 1024) == "lax"             # measured: lax faster
    assert cal.route(2**20 // 64) == "xla" and cal.route(1 << 30) == "xla"
    assert calibrate.lookup(4, "taco") is None           # another device count
    assert calibrate.lookup(2, "taco-int8") is None      # another codec
    # psum with min_bytes=None follows the cache: plain at 1 KiB, compressed at 16 KiB
    telemetry.clear_sites()
    small, big = gauss((2, 256)), gauss((2, 16, 256))
    np.testing.assert_array_equal(per_device(lambda v: taco_jax.psum(v, "tp"), small),
                                  per_device(lambda v: lax.psum(v, "tp"), small))
    assert rel(per_device(lambda v: taco_jax.psum(v, "tp"), big)[0], big.sum(0)) > 1e-4
    reasons = [s.reason for s, _ in telemetry.sites()]
    assert any("lax.psum measured faster here" in r for r in reasons)


@pytest.mark.parametrize("content", ["{not json", json.dumps({"version": 99, "entries": {}}),
                                     json.dumps({"version": 1, "entries": []})])
def test_corrupt_cache_is_reported_and_ignored(tmp_path, monkeypatch, content):
    path = tmp_path / "cal.json"
    path.write_text(content)
    monkeypatch.setenv(calibrate.CACHE_ENV, str(path))
    calibrate.forget()
    with pytest.warns(UserWarning, match="ignoring the calibration cache"):
        assert calibrate.lookup(2, "taco") is None
    x = gauss((2, 4, 256))     # the default threshold: plain
    np.testing.assert_array_equal(per_device(lambda v: taco_jax.psum(v, "tp"), x),
                                  per_device(lambda v: lax.psum(v, "tp"), x))


def test_foreign_or_malformed_entry_is_ignored(tmp_path, monkeypatch):
    path = tmp_path / "cal.json"
    monkeypatch.setenv(calibrate.CACHE_ENV, str(path))
    key = calibrate.machine_key(2)
    foreign = _cal(ROWS, key="NVIDIA H200|2|nvlink").to_json()
    bad_rows = _cal([{"mib": -1, "lax_us": "x"}]).to_json()
    path.write_text(json.dumps({"version": 1, "entries": {
        f"{key}|taco": foreign, f"{key}|taco-int8": bad_rows}}))
    calibrate.forget()
    with pytest.warns(UserWarning, match="written for 'NVIDIA H200"):
        assert calibrate.lookup(2, "taco") is None
    with pytest.warns(UserWarning, match="bad row"):
        assert calibrate.lookup(2, "taco-int8") is None


def test_best_route_and_margin():
    row = {"mib": 1, "lax_us": 100.0, "xla_us": 98.0, "fused_us": 40.0}
    assert calibrate.best_route(row, 0.97) == "fused"
    assert calibrate.best_route(row, 0.97, available=("xla",)) == "lax"   # 0.98 > margin
    assert calibrate.best_route({**row, "fused_us": math.nan}, 1.0) == "xla"
    assert calibrate.link() == "cpu"


# -- the decode-and-sum kernel (Pallas interpreter) -------------------------------------------
@pytest.mark.parametrize("name,b,dtype", [("taco", 256, jnp.bfloat16), ("taco-int8", 64,
                                                                         jnp.float32)])
def test_decode_sum_kernel_matches_reference(name, b, dtype):
    from taco_jax.kernels import references
    from taco_jax.kernels.triton import decode_sum
    c = codecs.get(name, block_size=b)
    x = gauss((3, 21, b), seed=8)
    x[1, 4, 2] = np.nan
    recv = jnp.stack([references.compress_reference(jnp.asarray(v), c) for v in x])
    got = np.asarray(decode_sum.decode_sum(recv, c, dtype, interpret=True), np.float32)
    want = np.asarray(references.decode_sum_reference(recv, c, dtype), np.float32)
    assert got.shape == (21, b) and got.dtype == np.float32
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(got[4]).all()
    ok = ~np.isnan(want)
    np.testing.assert_allclose(got[ok], want[ok], rtol=0, atol=2e-2 * np.abs(want[ok]).max()
                               if dtype == jnp.bfloat16 else 1e-5 * np.abs(want[ok]).max())
    with pytest.raises(ValueError, match="decode_sum kernel"):
        decode_sum.decode_sum(recv[:, :, :-1], c, dtype, interpret=True)
