"""The GEMM kernels with the codec in their epilogue (taco_jax/kernels/gemm) on CPU: lowered
for CUDA (one device, the loopback, a mesh), their shared memory as the lowering allocates
it, their pipeline, tile order and exchange run by the Mosaic GPU interpreter with a
stand-in tile codec (the interpreter has no inline_mgpu, which the real tile math is made
of), their jnp references against the codecs' own, and the wrappers' errors. Their numerics
with the real tile codecs run on a Hopper GPU (tests/kernels/test_gpu_gemm_codec.py, `-k gpu`;
`python -m bench.gemm_codec`)."""
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import NamedSharding, PartitionSpec as P

from taco_jax import codecs
from taco_jax.kernels import gemm
from taco_jax.kernels.fused import peers as peers_lib
from taco_jax.kernels.gemm import decode_residual as dr, encode_epilogue as ee
from taco_jax.kernels.gemm.config import SMEM_PER_SM, SMEM_RESERVED, GemmConfig
from taco_jax.kernels.mosaic import registers
from taco_jax.numerics.blocks import to_blocks

from codec_bounds import roundtrip_error
from fused_lowering import rel_l2, scratch_bytes
from test_import_graph import import_graph

TACO, ECHO4 = codecs.get("taco"), codecs.get("echo4")
# (M, K, N): 350m's row-parallel GEMM with its 16k tokens cut to 256 (K = N = d_model), and
# an odd shape: 3 row tiles (one compute warpgroup), 5 K steps, 3 column tiles
SHAPE_350M, ODD = (256, 1024, 1024), (192, 320, 768)


def lower(fn, *shapes):
    return jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()


def operands(p, shape, dtype=jnp.bfloat16):
    m, k, n = shape
    return (jax.ShapeDtypeStruct((p, m, k), dtype), jax.ShapeDtypeStruct((p, k, n), dtype))


def wires(codec, p, m, n, lead=()):
    rows, row = m * n // 256, ee.tile_codec(codec).row_bytes
    return jax.ShapeDtypeStruct((*lead, p, rows, row), jnp.uint8)


@pytest.mark.parametrize("codec", ["taco", "echo4"])
def test_kernels_lower_and_fit_shared_memory(monkeypatch, codec):
    """At 350m's shape both launches lower for CUDA; the shared memory the lowering
    allocates (each buffer aligned to 1 KiB), + 1 KiB for the barriers, is what
    `smem_bytes` counts, and it fits: the GEMM one program a multiprocessor, the decode
    two (every program of both launches independent of the others but for the exchange's
    end, so no residency is needed beyond the loopback's)."""
    c = codecs.get(codec)
    m, _, n = SHAPE_350M
    got = scratch_bytes(monkeypatch,
                        lambda a: gemm.gemm_encode.__wrapped__(a[0][0], a[1][0], c),
                        operands(1, SHAPE_350M))
    need = ee.smem_bytes(c, jnp.bfloat16, ee.default_config(m))
    assert got + 1024 == need and need + SMEM_RESERVED <= SMEM_PER_SM
    got = scratch_bytes(monkeypatch, lambda a: dr.decode_sum_residual.__wrapped__(*a, c),
                        (wires(c, 2, m, n), jax.ShapeDtypeStruct((m, n), jnp.bfloat16)))
    cfg = dr.DecodeConfig()
    need = dr.smem_bytes(c, jnp.bfloat16, cfg)
    assert got + 1024 == need and cfg.per_sm * (need + SMEM_RESERVED) <= SMEM_PER_SM


def launches(text):
    """The Mosaic GPU launches of a lowered module, in order: (kernel, operand shapes, result
    shapes, whether it addresses other devices' buffers: XLA's collective metadata, which a
    kernel's peer stores and semaphores translate their addresses through)."""
    out = []
    for line in text.splitlines():
        if "@mosaic_gpu_v2" not in line:
            continue
        kernel = [k for k in ("taco_gemm_encode", "taco_decode_residual", "taco_gemm")
                  if k in line][0]
        ins, outs = line[line.rindex(" : (") + 4:].split(") -> ")
        shapes = lambda s: [tuple(int(d) for d in t.split("x")[:-1])    # noqa: E731
                            for t in re.findall(r"tensor<([^>]*)>", s)]
        peers = re.search(r"uses_xla_collective_metadata = (true|false)", line).group(1)
        out.append((kernel, shapes(ins), shapes(outs), peers == "true"))
    return out


def lines(codec, m, n, p=1):
    """TMA lines of (M, N)'s wire, or of one owner's rows of P."""
    return m * n // 256 * ee.tile_codec(codec).row_bytes // 256 // p


def test_loopback_kernels_lower_at_an_odd_shape():
    """4 virtual devices, one compute warpgroup (M = 192), 5 K steps, 3 column tiles: one
    launch of the GEMM for all of them, its result the (P, P, …) receive buffers, nothing
    addressed outside this device; the decode one launch over the (P, P, …) buffers."""
    m, k, n = ODD
    (gemm_launch,) = launches(lower(lambda x, w: gemm.loopback_gemm_encode(x, w, TACO),
                                    *operands(4, ODD)))
    assert gemm_launch[0] == "taco_gemm_encode" and not gemm_launch[3]
    assert gemm_launch[1][:2] == [(4, m, k), (4, k, n)]
    assert gemm_launch[2][0] == (4, 4, lines(TACO, m, n), 256)
    (dec,) = launches(lower(lambda r, s: gemm.decode_sum_residual(r, s, ECHO4),
                            wires(ECHO4, 4, m, n, (4,)),
                            jax.ShapeDtypeStruct((4, m, n), jnp.bfloat16)))
    assert dec[0] == "taco_decode_residual" and not dec[3]
    assert dec[1][:2] == [(4, 4, lines(ECHO4, m, n), 256), (4, m, n)] and dec[2] == [(4, m, n)]


def test_the_row_parallel_all_reduce_lowers_on_a_mesh():
    """Inside shard_map (check_vma) over 2 devices: two launches, the GEMM with its epilogue
    (its result every device's wire, (P, lines, 256), written through addresses of the
    peers' buffers), then the decode with the residual on this device's buffer alone."""
    mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2])
    m, k, n = ODD

    def body(x, w, r):
        mat = jax.typeof(x).manual_axis_type.update(varying=frozenset())
        return gemm.gemm_allreduce(x[0], w[0], r, "tp", 2, ECHO4, out_mat=mat)
    f = jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P("tp"), P()), out_specs=P())
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, spec))
            for s, spec in [((2, m, k), P("tp")), ((2, k, n), P("tp")), ((m, n), P())]]
    enc, dec = launches(lower(f, *args))
    recv = (2, lines(ECHO4, m, n), 256)
    assert enc[0] == "taco_gemm_encode" and enc[3] and enc[1][:2] == [(m, k), (k, n)]
    assert enc[2][0] == recv
    assert dec[0] == "taco_decode_residual" and not dec[3]
    assert dec[1][:2] == [recv, (m, n)] and dec[2] == [(m, n)]


def test_the_reduce_scatter_lowers_on_a_mesh():
    """Megatron-SP's form over 4 devices: two launches; the GEMM's receive buffer holds one
    owner's rows (P slots of M·N/(256·P) wire rows, a quarter of the all-reduce's), and the
    decode turns it and the residual's shard into the device's M/P rows."""
    mesh = jax.make_mesh((4,), ("tp",), devices=jax.devices()[:4])
    m, k, n = SHAPE_350M

    def body(x, w, r):
        return gemm.gemm_reduce_scatter(x[0], w[0], r, "tp", 4, TACO)
    f = jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P("tp"), P("tp")),
                      out_specs=P("tp"), check_vma=False)
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, P("tp")))
            for s in [(4, m, k // 4), (4, k // 4, n), (m, n)]]
    enc, dec = launches(lower(f, *args))
    recv = (4, lines(TACO, m, n, 4), 256)
    assert enc[0] == "taco_gemm_encode" and enc[3] and enc[2][0] == recv
    assert dec[0] == "taco_decode_residual" and not dec[3]
    assert dec[1][:2] == [recv, (m // 4, n)] and dec[2] == [(m // 4, n)]


def test_plain_gemm_lowers_to_one_launch():
    m, k, n = SHAPE_350M
    (launch,) = launches(lower(lambda x, w: gemm.matmul(x[0], w[0]), *operands(1, SHAPE_350M)))
    assert launch[0] == "taco_gemm" and launch[2] == [(m, n)] and not launch[3]


# -- the pipeline, tile order and exchange, run by the Mosaic GPU interpreter ------------------
class HighBytes:
    """A stand-in tile codec in plain Pallas ops (the interpreter runs no inline_mgpu):
    a value's wire byte is its bf16's high byte (sign and exponent), decoded with a zero low
    byte, so every byte of the wire and of the result is known exactly."""
    codec = None
    row_bytes = 256

    def unsupported(self, dtype):
        return None

    def x_transforms(self, in_dtype):
        return ()

    def operands(self, in_dtype):
        return ()

    def encode(self, x_smem, consts):
        return x_smem[...]

    def store(self, view, wire):
        view[...] = (lax.bitcast_convert_type(wire, jnp.uint16) >> 8).astype(jnp.uint8)

    def load(self, view, part, parts):
        width = 256 // parts
        return view[:, pl.ds(part * width, width)]

    def decode_add(self, wire, consts, vec, part, parts, total=None):
        v = high_byte_values(wire)
        return v if total is None else total + v

    def finish(self, total, vec, parts):
        return total


def high_byte_values(codes):
    return lax.bitcast_convert_type(codes.astype(jnp.uint16) << 8, jnp.bfloat16).astype(
        jnp.float32)


class Unsynced(peers_lib.Loopback):
    """The loopback without its end-of-kernel handshake (the interpreter has no
    semaphores; one launch of every virtual device ends with all stores landed anyway)."""
    def semaphores(self, scratch, me, b):
        return None

    def signal(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass


@pytest.fixture
def interpreted(monkeypatch):
    kernel = plgpu.kernel
    monkeypatch.setattr(plgpu, "kernel", lambda *a, **k: kernel(
        *a, **k, interpret=plgpu.InterpretGPUParams()))
    monkeypatch.setattr(ee, "tile_codec", lambda codec: HighBytes())
    monkeypatch.setattr(ee, "tile_unsupported", lambda codec, dtype: None)
    monkeypatch.setattr(ee, "Loopback", Unsynced)
    monkeypatch.setattr(registers, "sm_count", lambda: 4)      # 2 or 4 programs a device


def random_operands(p, m, k, n, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    xs = jax.random.normal(k1, (p, m, k)).astype(jnp.bfloat16)
    ws = (jax.random.normal(k2, (p, k, n)) / np.sqrt(k)).astype(jnp.bfloat16)
    return xs, ws, jax.random.normal(k3, (m, n)).astype(jnp.bfloat16)


def test_interpreted_pipeline_and_exchange(interpreted):
    """With the stand-in codec, each of 3 virtual devices' receive buffers holds every
    device's wire of round(x_j @ w_j) in tile-major order, byte for byte, each in its slot j
    (exchange "owner": the slice of the receiver's own rows only). 3 virtual devices of one
    GEMM program each, 2 compute warpgroups, 6 codec tiles a device (3 row tiles of 128, 2
    column tiles), 2 K steps through 2 slots."""
    p, (m, k, n) = 3, (384, 128, 512)
    cfg = GemmConfig(steps=2)
    xs, ws, _ = random_operands(p, m, k, n)
    recv = np.asarray(gemm.loopback_gemm_encode.__wrapped__(xs, ws, None, cfg))
    assert recv.shape == (p, p, m * n // 256, 256)
    for j in range(p):
        y = gemm.matmul_reference(xs[j], ws[j])
        want = np.asarray(lax.bitcast_convert_type(gemm.tile_blocks(y), jnp.uint16) >> 8)
        for d in range(p):
            np.testing.assert_array_equal(recv[d, j], want, err_msg=f"device {d}, slot {j}")
    owned = np.asarray(gemm.loopback_gemm_encode.__wrapped__(xs, ws, None, cfg, "owner"))
    per_owner = m * n // 256 // p                # "owner": each device's rows' tiles only
    for o in range(p):
        np.testing.assert_array_equal(owned[o], recv[o, :, o * per_owner:(o + 1) * per_owner])


def order_sensitive(rng, d, p, m, n):
    """(D, P, M, N) f32 values the stand-in codec carries exactly (±2^e, e odd: a bf16 with
    a zero low byte) whose f32 sum over P = 3 depends on its order: at each element one
    source holds B, one −B and one s, |s| ≤ 2^-24 · B, the sources' roles drawn per device
    and element. In order, (±B ∓ B) + s = s only where s comes last; any other order of the
    sources absorbs s into B (0), so a decode that reorders, or reads another device's
    buffer, gives other sums."""
    assert p == 3
    big = np.exp2(rng.choice([27, 29, 31], (d, m, n))) * rng.choice([-1, 1], (d, m, n))
    small = np.exp2(rng.choice([-1, 1, 3], (d, m, n))) * rng.choice([-1, 1], (d, m, n))
    roles = rng.permuted(np.broadcast_to(np.arange(3), (d, m, n, 3)), axis=-1)
    roles = np.moveaxis(roles, -1, 1)                                   # (D, P, M, N)
    vals = np.choose(roles, [big[:, None], -big[:, None], small[:, None]])
    return vals.astype(np.float32)                                       # (D, P, M, N)


def test_interpreted_decode_sums_each_devices_wires_in_order(interpreted):
    """decode_sum_residual on 3 virtual devices, each with its own wires and its own
    residual: device d's result is round(residual_d + ((w_d0 + w_d1) + w_d2)) in f32, the
    order-sensitive values telling the device order from any other and one device's
    buffer from another's. One decode program a device, 4 tiles, 12 wire loads a tile
    (3 sources in 2 parts) through 5 slots, so loads run ahead into the next tile."""
    d = p = 3
    m, n = 128, 512
    rng = np.random.default_rng(0)
    vals = order_sensitive(rng, d, p, m, n)
    res = jax.random.normal(jax.random.key(4), (d, m, n)).astype(jnp.bfloat16)
    codes = (lax.bitcast_convert_type(jnp.asarray(vals, jnp.bfloat16), jnp.uint16) >> 8)
    recv = gemm.tile_blocks(codes.astype(jnp.uint8))                    # (D, P, rows, 256)
    got = gemm.decode_sum_residual.__wrapped__(recv, res, None,
                                               dr.DecodeConfig(ring=5, per_sm=1))

    def want(order, dev):
        total = np.zeros((m, n), np.float32)
        for j in order:
            total = total + vals[dev, j]
        return np.asarray(jnp.asarray(total + np.asarray(res[dev], np.float32), jnp.bfloat16),
                          np.float32)
    for dev in range(d):
        here = want(range(p), dev)
        # the values can tell: the reversed order, and device 0's wires, sum otherwise
        assert (here != want(reversed(range(p)), dev)).mean() > 0.3
        assert dev == 0 or (here != want(range(p), 0)).mean() > 0.3
        np.testing.assert_array_equal(np.asarray(got[dev], np.float32), here,
                                      err_msg=f"device {dev}")


def test_interpreted_plain_gemm_in_ping_pong_equals_its_reference(interpreted):
    """The kernel against `matmul_reference`, bit for bit, on integer operands whose f32
    sums are exact in any order (|Σ| < 2^24): both are the exact product rounded once to
    bf16 (a bf16 accumulator, or a second rounding, would differ: the sums need up to 16
    bits). Ping-pong: 2 programs a device of 3 tiles each (the turn passes from warpgroup 0
    to 1 and back, warpgroup 0 taking 2 tiles), 6 K steps through 2 slots a ring."""
    k1, k2 = jax.random.split(jax.random.key(1))
    xs = jax.random.randint(k1, (2, 192, 192), -16, 17).astype(jnp.bfloat16)
    ws = jax.random.randint(k2, (2, 192, 512), -16, 17).astype(jnp.bfloat16)
    got = gemm.matmul.__wrapped__(xs, ws, GemmConfig(tile_k=32, steps=2, pingpong=True))
    want = gemm.matmul_reference(xs, ws)
    exact = np.einsum("pmk,pkn->pmn", np.asarray(xs, np.float64), np.asarray(ws, np.float64))
    assert np.abs(exact).max() < 2 ** 24 and (np.asarray(want, np.float64) != exact).mean() > 0.3
    np.testing.assert_array_equal(np.asarray(want, np.float32),
                                  np.asarray(jnp.asarray(exact, jnp.bfloat16), np.float32))
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


# -- the references ---------------------------------------------------------------------------
@pytest.mark.parametrize("codec", [TACO, ECHO4], ids=["taco", "echo4"])
def test_reference_wire_is_the_codecs_own_encode_of_the_product(codec):
    """gemm_encode_reference's rows are the codec's compress of the product rounded to bf16
    (`matmul_reference`, f32 accumulation), block for block, in tile-major order
    (`tile_order`); echo4's two groups of a 256-value block are one 144-byte row."""
    m, k, n = ODD
    xs, ws, _ = random_operands(1, m, k, n, seed=2)
    y = gemm.matmul_reference(xs[0], ws[0])
    own = np.asarray(jax.jit(codec.compress_reference)(to_blocks(y, codec.block_size)))
    got = np.asarray(jax.jit(gemm.gemm_encode_reference, static_argnums=2)(xs[0], ws[0],
                                                                             codec))
    np.testing.assert_array_equal(got, own.reshape(m * n // 256, -1)[ee.tile_order(m, n)])
    np.testing.assert_array_equal(gemm.untile_blocks(gemm.tile_blocks(y), m, n), y)


@pytest.mark.parametrize("codec", [TACO, ECHO4], ids=["taco", "echo4"])
def test_all_reduce_reference_errs_as_one_round_trip_of_each_part_and_keeps_nan_rows(codec):
    """One quantization per element: the error against the exact sum of the parts
    p_j = round(x_j @ w_j) is within the codec's worst-block round-trip error on them
    (`codec_bounds.roundtrip_error`), and is that of one round trip of each part, summed,
    within 5% (a second quantization of the sum would add ~40%, none would give 0); a NaN
    in x_0 makes its output row NaN and no other."""
    p, (m, k, n) = 2, ODD
    xs, ws, res = random_operands(p, m, k, n, seed=3)
    xs = xs.at[0, 70, 5].set(jnp.nan)
    y = np.asarray(jax.jit(gemm.gemm_allreduce_reference, static_argnums=3)(xs, ws, res,
                                                                             codec), np.float64)
    assert np.isnan(y[70]).all() and np.isfinite(np.delete(y, 70, axis=0)).all()
    fin = np.arange(m) != 70                      # whole rows: the codec's blocks stay whole
    parts = [np.asarray(gemm.matmul_reference(xs[j], ws[j]), np.float64)[fin]
             for j in range(p)]
    exact, r = sum(parts), np.asarray(res, np.float64)[fin]
    err = rel_l2(y[fin] - r, exact)
    norm = np.linalg.norm
    rounding = 2.0 ** -8 * norm(exact + r) / norm(exact)        # y's one rounding to bf16
    worst = max(roundtrip_error(codec.name, pj) for pj in parts)
    assert err <= worst * sum(norm(pj) for pj in parts) / norm(exact) + rounding
    trip = jax.jit(codec.roundtrip)
    once = norm(sum(np.asarray(trip(jnp.asarray(pj, jnp.float32).reshape(-1)), np.float64)
                    .reshape(pj.shape) - pj for pj in parts)) / norm(exact)
    assert abs(err / once - 1) < 0.05, (err, once)


# -- what is covered ------------------------------------------------------------------------
@pytest.mark.parametrize("call,match", [
    (lambda: gemm.gemm_encode(jnp.ones((100, 64), jnp.bfloat16),
                              jnp.ones((64, 256), jnp.bfloat16), TACO), r"M=100"),
    (lambda: gemm.gemm_encode(jnp.ones((128, 96), jnp.bfloat16),
                              jnp.ones((96, 256), jnp.bfloat16), TACO), r"K=96.*tile_k=64"),
    (lambda: gemm.gemm_encode(jnp.ones((128, 64), jnp.bfloat16),
                              jnp.ones((64, 300), jnp.bfloat16), TACO), r"N=300"),
    (lambda: gemm.gemm_encode(jnp.ones((128, 64), jnp.float32),
                              jnp.ones((64, 256), jnp.float32), TACO), r"float32"),
    (lambda: gemm.gemm_encode(jnp.ones((128, 64), jnp.bfloat16),
                              jnp.ones((64, 256), jnp.float16), TACO), r"x is bfloat16"),
    (lambda: gemm.gemm_encode(jnp.ones((128, 64), jnp.bfloat16),
                              jnp.ones((64, 256), jnp.bfloat16), codecs.get("taco-int8")),
     r"taco-int8"),
    (lambda: gemm.loopback_gemm_encode(jnp.ones((9, 128, 64), jnp.bfloat16),
                                       jnp.ones((9, 64, 256), jnp.bfloat16), TACO), r"P=9"),
    (lambda: gemm.gemm_encode(jnp.ones((128, 64), jnp.bfloat16),
                              jnp.ones((64, 256), jnp.bfloat16), TACO,
                              GemmConfig(steps=8)), r"shared memory"),
    (lambda: GemmConfig(tile_k=48), r"tile_k=48"),
    (lambda: dr.DecodeConfig(parts=3), r"parts=3"),
    (lambda: gemm.decode_sum_residual(jnp.zeros((2, 100, 264), jnp.uint8),
                                      jnp.zeros((128, 256), jnp.bfloat16), TACO),
     r"wires \(2, 100, 264\)"),
    (lambda: gemm.decode_sum_residual(jnp.zeros((2, 128, 264), jnp.uint8),
                                      jnp.zeros((128, 256), jnp.bfloat16), TACO,
                                      dr.DecodeConfig(ring=8)), r"shared memory"),
])
def test_wrappers_refuse_what_they_do_not_cover(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_unsupported_gives_a_reason_for_a_dispatcher():
    assert gemm.unsupported(TACO, 2, (256, 1024), (1024, 1024), jnp.bfloat16) is None
    assert gemm.unsupported(ECHO4, 8, (192, 320), (320, 768), jnp.bfloat16) is None
    assert "N=1000" in gemm.unsupported(TACO, 2, (256, 1024), (1024, 1000), jnp.bfloat16)
    assert "fp8" in gemm.unsupported(codecs.get("fp8"), 2, (256, 64), (64, 256), jnp.bfloat16)


def test_only_the_checked_route_reaches_the_gemm_kernels():
    """The checked-selection rule: the library reaches them only through the fused route of
    the row-parallel collective matmuls (`collectives.gemm_fused`, which asks the checked
    table first) and the table's fingerprints (`kernels.fused.checked`): no other taco_jax
    module outside kernels/gemm imports them, at module level or inside a function, in any
    spelling (tests/test_import_graph.py's graph)."""
    graph = import_graph(nested=True)
    kernels = {m for m in graph if m == "taco_jax.kernels.gemm"
               or m.startswith("taco_jax.kernels.gemm.")}
    assert "taco_jax.kernels.gemm.encode_epilogue" in kernels
    users = sorted(m for m, deps in graph.items() if m not in kernels and deps & kernels)
    assert users == ["taco_jax.collectives.gemm_fused", "taco_jax.kernels.fused.checked"]
