"""The fused transport under jax.vmap (emulated tensor parallelism): the vmap members are
the virtual devices of one launch of the one-launch kernels (their loopback). On CPU the
kernels are stood in for by their jnp models (Mosaic GPU has no interpreter), so these tests
check the collective code around them: which kernel runs, its input and output layout,
gradients, telemetry, and that the emulation agrees with the xla transport's within the
codec's error. On a GPU the same tests run the kernels themselves."""
import dataclasses

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import taco_jax
from taco_jax import codecs, telemetry
from taco_jax.collectives import fused
from taco_jax.kernels import fused as kernels
from taco_jax.kernels.fused import checked

from codec_bounds import FACTOR, assert_blockwise_close, roundtrip_error
from fused_lowering import COVERED, assumed_table

ON_GPU = jax.default_backend() == "gpu"


def gauss(shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


@pytest.fixture
def loopback(monkeypatch):
    """On CPU: the loopback kernels' jnp models, each row what device d computes, and the
    platform check passed; records which kernel ran. On a GPU: the kernels, recorded."""
    ran = []
    monkeypatch.setattr(checked, "JAX", jax.__version__)
    monkeypatch.setattr(checked, "CHECKED", assumed_table(COVERED))   # as if GPU-checked
    models = {kernels.one_shot_loopback: kernels.one_shot_reference,
              kernels.two_shot_loopback: kernels.two_shot_reference}
    for kernel, model in models.items():
        def run(xs, codec, kernel=kernel, model=model):
            ran.append(kernel.__name__)
            if ON_GPU:
                return kernel(xs, codec)
            return jnp.broadcast_to(model(xs, codec), xs.shape)
        monkeypatch.setitem(fused.LOOPBACK_KERNELS, kernel, run)
    if not ON_GPU:
        monkeypatch.setattr(fused, "unavailable_reason", lambda axes: None)
    return ran


def emulated(fn, xs):
    return jax.jit(jax.vmap(fn, axis_name="tp"))(xs)


@pytest.mark.parametrize("p,kernel,dtype", [(2, "one_shot_loopback", jnp.bfloat16),
                                             (4, "two_shot_loopback", np.float32)])
def test_psum_under_vmap_runs_the_one_launch_kernel_for_all_members(loopback, p, kernel,
                                                                    dtype):
    xs = jnp.asarray(gauss((p, 3, 700), seed=p)).astype(dtype)
    telemetry.clear_sites()
    y = emulated(lambda v: taco_jax.psum(v, "tp", min_bytes=0, transport="fused"), xs)
    assert loopback == [kernel]                 # one launch for every member
    assert y.shape == xs.shape and y.dtype == xs.dtype
    y = np.asarray(y, np.float32)
    for d in range(1, p):                       # every member holds the same bits
        np.testing.assert_array_equal(y[d], y[0])
    # the kernel's own math, member d's row ...
    model = (kernels.one_shot_reference if p == 2
             else kernels.two_shot_reference)
    want = np.asarray(jax.jit(model, static_argnums=1)(xs, codecs.get("taco")), np.float32)
    x32 = np.asarray(xs, np.float32)
    scale = np.abs(x32).sum(0)
    tol = FACTOR * roundtrip_error("taco", x32)
    assert_blockwise_close(y[0], want, scale, tol, 256, lead=0, what="loopback vs its model")
    # ... and the xla transport's emulation: two schedules, within the codec's error
    xla = emulated(lambda v: taco_jax.psum(v, "tp", min_bytes=0, transport="xla"), xs)
    assert_blockwise_close(y[0], np.asarray(xla, np.float32)[0], scale, tol, 256, lead=0,
                           what="loopback vs xla")
    sites = [s for s, _ in telemetry.sites() if s.compressed]
    assert {s.transport for s in sites} == {"fused (loopback)", "xla"}
    assert "compressed (taco, fused (loopback))" in telemetry.site_report()


def test_gradients_through_the_loopback_match_the_xla_transport(loopback):
    """psum's transpose under vmap (the compressed psum of the cotangent), and pvary's
    backward under the recipe's vmap_check_vma (as the emulated GPT runs: a shared input,
    each member its own weights), through the kernel: within the codec's error of the xla
    transport's emulation and of the exact gradient."""
    p = 4
    x = jnp.asarray(gauss((2, 512), seed=3))
    ws = jnp.asarray(gauss((p, 2, 512), seed=4))
    c = jnp.asarray(gauss((2, 512), seed=5))

    def grad(transport, vma, codec="taco"):
        kw = dict(min_bytes=0, transport=transport, codec=codec)

        def member(x, w):
            h = (taco_jax.pvary(x, "tp", **kw) if vma else x) * w
            return jnp.sum(taco_jax.psum(h * h, "tp", **kw) * c)

        def total(x):
            with taco_jax.config(vmap_check_vma=vma):
                return jnp.sum(jax.vmap(member, in_axes=(None, 0), axis_name="tp")(x, ws))
        return np.asarray(jax.jit(jax.grad(total))(x))

    for vma in (False, True):
        loopback.clear()
        g = grad("fused", vma)
        assert "two_shot_loopback" in loopback, vma
        exact = grad("xla", vma, codec="none")
        tol = FACTOR * roundtrip_error("taco", np.asarray(ws) * np.asarray(x) * 4)
        assert_blockwise_close(g, exact, exact, tol, 256, lead=0, what=f"exact, {vma=}")
        assert_blockwise_close(g, grad("xla", vma), exact, 2 * tol, 256, lead=0,
                               what=f"xla, {vma=}")
        assert np.abs(g - exact).max() > 0          # compressed, really


def test_the_gpt_emulated_through_the_loopback_equals_the_xla_emulation(loopback):
    """A training step's loss and gradients, emulated TP4 through the fused transport's
    loopback, against the same emulation through the xla transport: within the codec's
    error, as emulation and mesh agree."""
    from models import parallel
    from model_cases import CFG, _max_rel_err, _tokens

    cfg = dataclasses.replace(CFG, codec_fwd="taco", codec_bwd="taco", min_bytes=0)

    def run(transport, codec="taco"):
        c = dataclasses.replace(cfg, codec_fwd=codec, codec_bwd=codec)
        mesh = parallel.make_emulation_mesh(1)
        model = parallel.shard_gpt(c, mesh, emulate_tp=4)
        params = model.init(0)
        x, y = (parallel.put_batch(a, mesh) for a in _tokens(c))
        with taco_jax.config(transport=transport):
            loss, grads = jax.jit(model.loss_and_grad_fn())(params, x, y)
        return float(loss), jax.device_get(grads)

    telemetry.clear_sites()
    l_f, g_f = run("fused")
    assert "two_shot_loopback" in loopback
    assert any(s.transport == "fused (loopback)" for s, _ in telemetry.sites())
    l_x, g_x = run("xla")
    l_e, g_e = run("xla", codec="none")
    assert abs(l_f - l_x) <= FACTOR * abs(l_x - l_e) + 1e-5 * abs(l_x), (l_f, l_x, l_e)
    assert _max_rel_err(g_f, g_x) <= FACTOR * _max_rel_err(g_x, g_e)
    assert _max_rel_err(g_f, g_e) > 1e-3          # compressed, really


@pytest.mark.skipif(ON_GPU, reason="the CPU's answer")
def test_fused_under_vmap_on_cpu_is_a_clear_error_and_auto_takes_xla():
    xs = jnp.asarray(gauss((2, 4, 256)))
    with pytest.raises(ValueError, match="loopback over vmap members needs a GPU"):
        emulated(lambda v: taco_jax.psum(v, "tp", min_bytes=0, transport="fused"), xs)
    telemetry.clear_sites()
    emulated(lambda v: taco_jax.psum(v, "tp", min_bytes=0), xs)
    assert {s.transport for s, _ in telemetry.sites() if s.compressed} == {"xla"}


def test_what_the_loopback_does_not_cover_keeps_the_separate_kernels(loopback):
    """taco-int8 at P = 4 (no tile codec: the one-launch kernels have FP8 and echo4's tile
    math) and all_gather: the fused transport's separate kernels, the exchange left to the
    vmap."""
    xs = jnp.asarray(gauss((4, 2, 512), seed=9))
    telemetry.clear_sites()
    y = emulated(lambda v: taco_jax.psum(v, "tp", codec="taco-int8", min_bytes=0,
                                         transport="fused"), xs)
    g = emulated(lambda v: taco_jax.all_gather(v, "tp", min_bytes=0, transport="fused"), xs)
    assert loopback == []
    labels = {s.transport for s, _ in telemetry.sites() if s.compressed}
    assert "fused (exchange emulated)" in labels and len(labels) == 2       # all_gather's
    psum, = labels - {"fused (exchange emulated)"}
    assert psum.startswith("fused (separate kernels, exchange emulated): taco-int8: ")
    y_xla = emulated(lambda v: taco_jax.psum(v, "tp", codec="taco-int8", min_bytes=0,
                                             transport="xla"), xs)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_xla), rtol=0, atol=0)
    assert g.shape == (4, 4, 2, 512)


def test_one_launch_covers_p2_one_shot_and_p3_to_8_two_shot_for_taco_and_echo4(all_checked):
    taco, echo4 = codecs.get("taco"), codecs.get("echo4")
    assert fused.one_launch_kernel(2) == "one_shot" and fused.one_launch_kernel(8) == "two_shot"
    for p in (2, 3, 4, 8):
        assert fused.one_launch_reason(taco, p, jnp.bfloat16) is None
    for p in (2, 3, 4, 8):
        assert fused.one_launch_reason(echo4, p, jnp.bfloat16) is None
    assert "taco-int8" in fused.one_launch_reason(codecs.get("taco-int8"), 4, jnp.bfloat16)
    assert "P=9" in fused.one_launch_reason(taco, 9, jnp.bfloat16)
    # wire bytes: the one-shot sends all its codes once, the two-shot 2(P − 1)/P of them
    n = 8 * 64 * 256 * 10
    rows = n // 256
    assert fused.one_launch_wire_bytes(taco, 2, n) == rows * taco.row_bytes
    assert fused.one_launch_wire_bytes(taco, 8, n) == 2 * 7 * (rows // 8) * taco.row_bytes
    # echo4: a tile row of 256 values is two groups of 128 on the wire
    assert fused.one_launch_wire_bytes(echo4, 8, n) == 2 * 7 * (rows // 8) * 2 * echo4.row_bytes
