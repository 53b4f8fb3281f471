"""The gather GEMM (taco_jax/kernels/gemm/gather_gemm.py) on CPU: its encode, exchange,
decoding producer, mainloop and epilogue run by the Mosaic GPU interpreter, with stand-in
tile codecs in plain Pallas ops (the interpreter has no inline_mgpu, which the real tile
math is made of): one that carries exact values (a bf16's high byte) and, for taco and
echo4, one that runs the codec's own jnp math on the tile, with the codec's wire rows
(264 and 144 bytes); the one-launch kernel (real tile codecs, semaphores) lowered for CUDA
at 350m's shapes with its shared memory; the reference; the wrappers' errors.

The interpreter runs grid programs one after another and has no semaphores, so it runs the
launch's two halves as two launches (`gather_gemm.loopback_launch(stages=...)`): the
encode and exchange into the receive buffers, then the GEMM from them. The semaphores
between them, and the real tile math, run on a Hopper GPU (`python -m bench.gather_gemm`)."""
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import NamedSharding, PartitionSpec as P

from taco_jax import codecs
from taco_jax.kernels import gemm
from taco_jax.kernels.gemm import encode_epilogue as ee, gather_gemm as gg
from taco_jax.kernels.gemm.config import SMEM_PER_SM, SMEM_RESERVED
from taco_jax.kernels.mosaic import registers
from taco_jax.numerics import hadamard

from fused_lowering import scratch_bytes

TACO, ECHO4 = codecs.get("taco"), codecs.get("echo4")


# -- stand-in tile codecs ----------------------------------------------------------------------
class HighBytes:
    """A value's wire byte is its bf16's high byte (sign, 7 exponent bits), decoded with a
    zero low byte: values ±2^e, e odd, travel exactly."""
    codec = None
    row_bytes = 256

    def unsupported(self, dtype):
        return None

    def x_transforms(self, in_dtype):
        return ()

    def operands(self, in_dtype):
        return ()

    def encode(self, x_smem, consts):
        return (lax.bitcast_convert_type(x_smem[...], jnp.uint16) >> 8).astype(jnp.uint8)

    def store(self, view, wire):
        view[...] = wire

    def load(self, view, part, parts):
        return view[...]

    def decode_add(self, wire, consts, vec, part, parts, total=None):
        width = 256 // parts
        v = lax.bitcast_convert_type(wire.astype(jnp.uint16) << 8, jnp.bfloat16)
        v = v.astype(jnp.float32)[:, part * width:(part + 1) * width]
        return v if total is None else total + v

    def finish(self, total, vec, parts):
        return total


class CodecMath:
    """The codec's own compress_reference / decompress_reference on a (64, 256) tile inside
    the kernel: its wire rows (taco 264 bytes, echo4 two groups of 72), the receive
    buffer's lines as the kernel lays them out. The interpreter takes no reshaped refs, so
    views stay (lines, 256) and the wire is reshaped as a value; a kernel captures no array
    constants, so H_16 comes in as an operand."""

    def __init__(self, codec):
        self.codec = codec
        self.row_bytes = codec.row_bytes * (256 // codec.block_size)
        self.taco = codec.name.startswith("taco")

    def unsupported(self, dtype):
        return None

    def x_transforms(self, in_dtype):
        return ()

    def operands(self, in_dtype):
        return ((jnp.asarray(hadamard.sylvester(16)), ()),) if self.taco else ()

    def _math(self, consts, fn, arg):
        if not self.taco:
            return fn(arg)
        h, own = consts[0][...], hadamard.sylvester
        hadamard.sylvester = lambda n: h          # noqa: E731 - the operand, traced
        try:
            return fn(arg)
        finally:
            hadamard.sylvester = own

    def encode(self, x_smem, consts):
        c = self.codec
        wire = self._math(consts, c.compress_reference, x_smem[...].reshape(-1, c.block_size))
        return wire.reshape(64, self.row_bytes)

    def store(self, view, wire):
        view[...] = wire.reshape(view.shape)

    def load(self, view, part, parts):
        return view[...].reshape(64, self.row_bytes)

    def decode_add(self, wire, consts, vec, part, parts, total=None):
        c = self.codec
        v = self._math(consts, c.decompress_reference, wire.reshape(-1, c.row_bytes))
        width = 256 // parts
        v = v.astype(jnp.float32).reshape(64, 256)[:, part * width:(part + 1) * width]
        return v if total is None else total + v

    def finish(self, total, vec, parts):
        return total


@pytest.fixture
def interpreted(monkeypatch):
    """Mosaic GPU kernels run by the interpreter; 4 multiprocessors (2 programs a device at
    P = 2, 1 at P = 3); returns a setter for the stand-in tile codec."""
    kernel = plgpu.kernel
    monkeypatch.setattr(plgpu, "kernel", lambda *a, **k: kernel(
        *a, **k, interpret=plgpu.InterpretGPUParams()))
    monkeypatch.setattr(ee, "tile_unsupported", lambda codec, dtype: None)
    monkeypatch.setattr(ee, "wire_view", lambda ref, row: ref)
    monkeypatch.setattr(registers, "sm_count", lambda: 4)
    return lambda tiles: monkeypatch.setattr(ee, "tile_codec", lambda codec: tiles)


def run_halves(xs, w, codec):
    """The encode-and-exchange launch, then the GEMM launch from its receive buffers."""
    recv = gg.loopback_launch(xs, w, codec, stages="encode")
    return recv, gg.loopback_launch(xs, w, codec, stages="gemm", recv=recv)


def by_device(p, mp, k, seed, exps):
    """(P, M/P, K) values ±2^e, device d's exponents `exps` shifted by 2d (so a row block
    from another device's slot changes the result)."""
    key = jax.random.key(seed)
    e = jax.random.choice(key, jnp.asarray(exps), (p, mp, k))
    sign = jax.random.choice(jax.random.fold_in(key, 1), jnp.asarray([-1.0, 1.0]), (p, mp, k))
    shift = 2.0 * jnp.arange(p)[:, None, None]
    return (sign * jnp.exp2(e + shift)).astype(jnp.bfloat16)


def test_interpreted_halves_are_exact_with_exact_values(interpreted):
    """2 virtual devices, 2 programs each, M/P = 128 (2 bands a device), K = 512 (2 codec
    tiles, 4 K steps through 2 slots), N = 512 (2 column tiles). With values the stand-in
    carries exactly and integer w, every f32 sum is exact (|Σ| < 2^24): each device's
    receive buffer holds every device's wire in its slot, tile-major, byte for byte, and
    each device's y is the reference (gathered x @ w, rounded once to bf16) bit for bit;
    the rows of device 1's block would differ if they came from device 0's slot."""
    interpreted(HighBytes())
    p, mp, k, n = 2, 128, 512, 512
    xs = by_device(p, mp, k, 0, [-3, -1, 1, 3])
    w = jax.random.randint(jax.random.key(1), (k, n), -8, 9).astype(jnp.bfloat16)
    recv, y = run_halves(xs, w, None)
    assert recv.shape == (p, p, mp * k // 256, 256)
    for j in range(p):
        want = np.asarray(lax.bitcast_convert_type(gemm.tile_blocks(xs[j]), jnp.uint16) >> 8)
        for d in range(p):
            np.testing.assert_array_equal(recv[d, j], want, err_msg=f"device {d}, slot {j}")
    exact = np.asarray(xs, np.float64).reshape(-1, k) @ np.asarray(w, np.float64)
    assert np.abs(exact).max() < 2 ** 24
    want = np.asarray(jnp.asarray(exact, jnp.bfloat16), np.float32)
    swapped = np.asarray(xs[::-1], np.float64).reshape(-1, k) @ np.asarray(w, np.float64)
    assert (np.asarray(jnp.asarray(swapped, jnp.bfloat16), np.float32) != want).mean() > 0.9
    for d in range(p):
        np.testing.assert_array_equal(np.asarray(y[d], np.float32), want, err_msg=f"device {d}")


def assert_reference(y, want):
    """y (P, M, N): the same bits on every device, and the reference up to the f32 rounding
    of the codec math and of the accumulation order (evaluated op by op in the interpreter,
    fused by XLA in the reference): one bf16 step at most, on a few elements; NaN where the
    reference has NaN."""
    y = np.asarray(y, np.float32)
    want = np.asarray(want, np.float32)
    for d in range(1, y.shape[0]):
        np.testing.assert_array_equal(y[d], y[0], err_msg=f"device {d} differs from device 0")
    np.testing.assert_array_equal(np.isnan(y[0]), np.isnan(want))
    fin = ~np.isnan(want)
    diff = np.abs(y[0][fin] - want[fin])
    assert (diff == 0).mean() > 0.99, (diff == 0).mean()
    assert np.all(diff <= 2.0 ** -7 * np.abs(want[fin]) + 1e-6), diff.max()


# each codec at one P (P = 3: an odd number of peers, the wrong slot seen; P = 2: the
# smallest): every codec's rows and every P's slots at half the interpreter's time
@pytest.mark.parametrize("codec,p", [(TACO, 3), (ECHO4, 2)], ids=["taco-3", "echo4-2"])
def test_interpreted_halves_match_the_reference_with_the_codecs_rows(interpreted, codec, p):
    """The codec's own math in the kernel's tiles (`CodecMath`), its wire rows in the
    receive buffers: every device computes the same bits, the reference's
    (`gather_gemm_reference`) up to f32 rounding; each device's shard has its own scale
    (e^d), so a block read from another device's slot is off by that factor. At P = 3 a
    NaN in device 1's row 70 makes that gathered row (M/P + 70) NaN, and nothing else."""
    interpreted(CodecMath(codec))
    mp, k, n = (128, 512, 512) if p == 2 else (64, 256, 256)
    k1, k2 = jax.random.split(jax.random.key(p))
    xs = jax.random.normal(k1, (p, mp, k)) * jnp.exp(jnp.arange(p))[:, None, None]
    xs = xs.astype(jnp.bfloat16)
    if p == 3:
        xs = xs.at[1, 30, 7].set(jnp.nan)
    w = (jax.random.normal(k2, (k, n)) / np.sqrt(k)).astype(jnp.bfloat16)
    _, y = run_halves(xs, w, codec)
    want = jax.jit(gg.gather_gemm_reference, static_argnums=2)(xs, w, codec)
    if p == 3:
        nan_rows = np.flatnonzero(np.isnan(np.asarray(y[0], np.float32)).any(axis=1))
        assert list(nan_rows) == [mp + 30] and np.isnan(np.asarray(y[:, mp + 30])).all()
    wrong = jax.jit(gg.gather_gemm_reference, static_argnums=2)(jnp.roll(xs, 1, axis=0), w,
                                                                 codec)
    fin = ~np.isnan(np.asarray(want, np.float32)) & ~np.isnan(np.asarray(wrong, np.float32))
    assert (np.asarray(wrong)[fin] != np.asarray(want)[fin]).mean() > 0.9
    assert_reference(y, want)


# -- the reference --------------------------------------------------------------------------
@pytest.mark.parametrize("codec", [TACO, ECHO4], ids=["taco", "echo4"])
def test_reference_is_the_codecs_round_trip_of_each_shard_gathered(codec):
    """gather_gemm_reference = (the codec's roundtrip of each shard, in bf16, stacked) @ w,
    f32 accumulation, rounded once; its wire (`gather_wire_reference`) is the codec's rows
    of each shard's blocks in tile-major order; a NaN stays in its row."""
    p, mp, k, n = 3, 64, 512, 256
    xs = jax.random.normal(jax.random.key(5), (p, mp, k)).astype(jnp.bfloat16)
    xs = xs.at[2, 10, 300].set(jnp.nan)
    w = jax.random.normal(jax.random.key(6), (k, n)).astype(jnp.bfloat16)
    y = np.asarray(jax.jit(gg.gather_gemm_reference, static_argnums=2)(xs, w, codec),
                   np.float32)
    trip = jax.jit(codec.roundtrip)
    x = jnp.concatenate([trip(xs[d].astype(jnp.float32)).astype(jnp.bfloat16)
                         for d in range(p)])
    want = np.asarray(gemm.matmul_reference(x, w), np.float32)
    np.testing.assert_array_equal(y, want)
    nan_rows = np.flatnonzero(np.isnan(y).any(axis=1))
    assert list(nan_rows) == [2 * mp + 10] and np.isnan(y[2 * mp + 10]).all()
    wire = np.asarray(gg.gather_wire_reference(xs[0], codec))
    own = np.asarray(codec.compress_reference(xs[0].reshape(-1, codec.block_size)))
    np.testing.assert_array_equal(
        wire, own.reshape(mp * k // 256, -1)[ee.tile_order(mp, k)])


# -- lowering ---------------------------------------------------------------------------------
def lower(fn, *shapes):
    return jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()


def kernel_launches(text):
    """(operand shapes, result shapes, addresses peers) of each taco_gather_gemm launch."""
    out = []
    for line in text.splitlines():
        if "@mosaic_gpu_v2" not in line or "taco_gather_gemm" not in line:
            continue
        ins, outs = line[line.rindex(" : (") + 4:].split(") -> ")
        shapes = lambda s: [tuple(int(d) for d in t.split("x")[:-1])    # noqa: E731
                            for t in re.findall(r"tensor<([^>]*)>", s)]
        peers = re.search(r"uses_xla_collective_metadata = (true|false)", line).group(1)
        out.append((shapes(ins), shapes(outs), peers == "true"))
    return out


def dims_350m():
    from bench.gemm_codec import preset_dims
    return preset_dims("350m")


def shapes_350m(p):
    """350m's column-parallel GEMMs at P: QKV (d_model → 3·d_model / P) and FC1 (d_model →
    d_ff / P), M = its tokens per step."""
    d = dims_350m()
    return {"qkv": (d["tokens"], d["d_model"], 3 * d["d_model"] // p),
            "fc1": (d["tokens"], d["d_model"], d["d_ff"] // p)}


@pytest.mark.parametrize("p", [2, 4, 8])
def test_lowers_at_350m_shapes_within_shared_memory(monkeypatch, p):
    """The one-launch loopback (real tile codecs, semaphores) lowers for CUDA at 350m's QKV
    and FC1 shapes (taco, and echo4 at P = 2); its shared memory as the lowering allocates
    it, + 1 KiB of barriers, is `smem_bytes`, within a Hopper multiprocessor. QKV at P = 8
    has N = 384 columns a device, not whole 256-column tiles: refused, with the reason."""
    for name, (m, k, n) in shapes_350m(p).items():
        why = gg.unsupported(TACO, p, (m // p, k), (k, n), jnp.bfloat16)
        if n % 256:
            assert f"N={n}" in why
            continue
        assert why is None
        for codec in [TACO] + ([ECHO4] if p == 2 else []):
            xs = jax.ShapeDtypeStruct((p, m // p, k), jnp.bfloat16)
            w = jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
            got = scratch_bytes(monkeypatch, lambda a: gg.loopback_gather_gemm.__wrapped__(
                *a, codec), (xs, w))
            need = gg.smem_bytes(codec, jnp.bfloat16, gg.GatherConfig())
            assert got + 1024 == need and need + SMEM_RESERVED <= SMEM_PER_SM, (name, codec)


def test_loopback_lowers_to_one_launch_at_an_odd_shape():
    """3 virtual devices, M/P = 192 (3 bands), K = 768 (3 codec tiles), N = 768: one launch,
    its operands the shards and w, taco's two H factors and the band semaphores (one per
    receiver, source and band: 3 · 3 · 3, passed through), its results y (P, M, N) and the
    receive buffers (P, P, lines, 256), nothing addressed outside this device."""
    p, mp, k, n = 3, 192, 768, 768
    (launch,) = kernel_launches(lower(lambda x, w: gemm.loopback_gather_gemm(x, w, TACO),
                                      jax.ShapeDtypeStruct((p, mp, k), jnp.bfloat16),
                                      jax.ShapeDtypeStruct((k, n), jnp.bfloat16)))
    ins, outs, peers = launch
    lines = mp * k // 256 * TACO.row_bytes // 256
    assert ins == [(p, mp, k), (k, n), (16, 16), (16, 16), (p * p * mp // 64,)] and not peers
    assert outs == [(p, p * mp, n), (p, p, lines, 256), (p * p * mp // 64,)]


def test_one_device_still_waits_for_its_bands():
    """At P = 1 the band semaphores stay (another program of the device encodes the band
    a program decodes): the launch takes its (bands,) semaphore array."""
    (launch,) = kernel_launches(lower(lambda x, w: gemm.loopback_gather_gemm(x, w, ECHO4),
                                      jax.ShapeDtypeStruct((1, 128, 256), jnp.bfloat16),
                                      jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)))
    assert launch[0][-1] == (2,)


def test_lowers_on_a_mesh_addressing_the_peers():
    """Inside shard_map (check_vma) over 4 devices, echo4: one launch on each device's shard,
    w's columns and its band semaphores (one per source and band, passed through), its
    results y (M, N) and the receive buffer (P, lines, 256), written
    through the peers' addresses (XLA's collective metadata)."""
    p, mp, k, n = 4, 64, 512, 256
    mesh = jax.make_mesh((p,), ("tp",), devices=jax.devices()[:p])

    def body(x, w):
        mat = jax.typeof(x).manual_axis_type
        return gemm.all_gather_gemm(x[0], w[0], "tp", p, ECHO4, out_mat=mat)[None]
    f = jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P("tp")), out_specs=P("tp"))
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, P("tp")))
            for s in [(p, mp, k), (p, k, n)]]
    (launch,) = kernel_launches(lower(f, *args))
    ins, outs, peers = launch
    assert ins == [(mp, k), (k, n), (p * mp // 64,)] and peers
    assert outs == [(p * mp, n), (p, mp * k // 256 * ECHO4.row_bytes * 2 // 256, 256),
                    (p * mp // 64,)]


# -- what is covered ------------------------------------------------------------------------
def ones(*shape):
    return jnp.ones(shape, jnp.bfloat16)


@pytest.mark.parametrize("call,match", [
    (lambda: gemm.loopback_gather_gemm(ones(2, 100, 256), ones(256, 256), TACO), r"M=100"),
    (lambda: gemm.loopback_gather_gemm(ones(2, 64, 384), ones(384, 256), TACO),
     r"K=384 is not a multiple of 256"),
    (lambda: gemm.loopback_gather_gemm(ones(2, 64, 256), ones(256, 384), TACO), r"N=384"),
    (lambda: gemm.loopback_gather_gemm(ones(9, 64, 256), ones(256, 256), TACO), r"P=9"),
    (lambda: gemm.loopback_gather_gemm(ones(2, 64, 256), ones(256, 256),
                                       codecs.get("taco-int8")), r"taco-int8"),
    (lambda: gemm.loopback_gather_gemm(ones(2, 64, 256), jnp.ones((256, 256), jnp.float16),
                                       TACO), r"x is bfloat16"),
    (lambda: gemm.loopback_gather_gemm(ones(2, 64, 256), ones(256, 256), TACO,
                                       gg.GatherConfig(steps=3)), r"shared memory"),
    (lambda: gg.GatherConfig(steps=1), r"steps=1"),
])
def test_wrappers_refuse_what_they_do_not_cover(call, match):
    with pytest.raises(ValueError, match=match):
        call()
