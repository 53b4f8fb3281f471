"""taco_jax.ppermute (pipeline sends, compressed) and the tah4 activation codec. CPU."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax import lax

import taco_jax
from taco_jax import codecs

from codec_bounds import FACTOR, assert_blockwise_close, roundtrip_error
from meshes import per_device

RING = [(i, (i + 1) % 4) for i in range(4)]
CHAIN = [(0, 1), (1, 2), (2, 3)]          # device 0 receives nothing


def gauss(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def grad_of(fn, x, vma=False):
    """d/dx Σ w · fn(x) on a 4-device mesh."""
    mesh = jax.make_mesh((4,), ("tp",), devices=jax.devices()[:4])
    w = jnp.asarray(gauss(x.shape, seed=99))
    spec = jax.sharding.PartitionSpec("tp")
    with jax.set_mesh(mesh):
        sm = jax.shard_map(lambda b: fn(b[0])[None], mesh=mesh, in_specs=spec,
                           out_specs=spec, check_vma=vma)
        xs = jax.device_put(jnp.asarray(x), jax.NamedSharding(mesh, spec))
        return np.asarray(jax.jit(jax.grad(lambda v: jnp.sum(sm(v) * w)))(xs))


def per_device_jnp(fn, v):
    return jax.vmap(fn, axis_name="tp")(v)


@pytest.mark.parametrize("perm", [RING, CHAIN], ids=["ring", "chain"])
def test_codec_none_is_lax_ppermute_bit_for_bit(perm):
    x = gauss((4, 3, 200))
    ours = per_device(lambda v: taco_jax.ppermute(v, "tp", perm, codec="none"), x)
    theirs = per_device(lambda v: lax.ppermute(v, "tp", perm), x)
    np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(
        grad_of(lambda v: taco_jax.ppermute(v, "tp", perm, codec="none"), x),
        grad_of(lambda v: lax.ppermute(v, "tp", perm), x))


@pytest.mark.parametrize("perm", [RING, CHAIN], ids=["ring", "chain"])
def test_compressed_ppermute_and_its_gradient(perm):
    x = gauss((4, 3, 200), seed=1)
    fn = lambda v: taco_jax.ppermute(v, "tp", perm, codec="taco", min_bytes=0)
    ours = per_device(fn, x)
    theirs = per_device(lambda v: lax.ppermute(v, "tp", perm), x)
    got = [d for _, d in perm]
    assert 1e-4 < rel(ours[got], theirs[got]) < 0.05
    for d in set(range(4)) - set(got):           # nothing arrives: zeros, as lax gives
        np.testing.assert_array_equal(ours[d], 0.0)
    g, g_ref = grad_of(fn, x), grad_of(lambda v: lax.ppermute(v, "tp", perm), x)
    senders = [s for s, _ in perm]
    assert 1e-4 < rel(g[senders], g_ref[senders]) < 0.05
    np.testing.assert_array_equal(g[list(set(range(4)) - set(senders))], 0.0)
    # the same under vmap (emulated stages), gradient included: another program, so equal
    # within the codec's error per block (each side is one round trip of the same block)
    tol = FACTOR * roundtrip_error("taco", x)
    assert_blockwise_close(np.asarray(per_device_jnp(fn, jnp.asarray(x))), ours, theirs, tol,
                           256, what="vmap vs mesh")
    w = jnp.asarray(gauss(x.shape, seed=99))
    g_vmap = jax.grad(lambda v: jnp.sum(per_device_jnp(fn, v) * w))(jnp.asarray(x))
    assert_blockwise_close(np.asarray(g_vmap), g, g_ref, FACTOR * roundtrip_error("taco", w),
                           256, what="vmap vs mesh, gradient")


@pytest.mark.parametrize("perm,vma", [(RING, True), (CHAIN, True), (CHAIN, False)],
                         ids=["ring-check_vma", "chain-check_vma", "chain-no_check_vma"])
def test_gradient_is_lax_ppermutes_under_both_check_vma_modes(perm, vma):
    """codec none: lax.ppermute's gradient bit for bit; tah4: each sender's gradient is the
    codec's round trip of the cotangent it gets back (the reverse send, compressed once),
    non-senders' exactly zero, as lax gives."""
    x = gauss((4, 3, 256), seed=4)
    g_ref = grad_of(lambda v: lax.ppermute(v, "tp", perm), x, vma)
    g = grad_of(lambda v: taco_jax.ppermute(v, "tp", perm, codec="none"), x, vma)
    np.testing.assert_array_equal(g, g_ref)
    g = grad_of(lambda v: taco_jax.ppermute(v, "tp", perm, codec="tah4", min_bytes=0), x, vma)
    w = gauss(x.shape, seed=99)                  # grad_of's cotangent
    senders, dsts = [s for s, _ in perm], [d for _, d in perm]
    # whole groups of 128 per device, so one round trip of the stacked cotangents; computed
    # by another program, so equal within the codec's error per group
    back = jax.jit(codecs.get("tah4").roundtrip)(jnp.asarray(w[dsts]))
    assert_blockwise_close(g[senders], np.asarray(back), w[dsts],
                           FACTOR * roundtrip_error("tah4", w[dsts]), 128,
                           what="gradient vs the cotangent's round trip")
    assert 0.02 < rel(g[senders], g_ref[senders]) < 0.15
    np.testing.assert_array_equal(g[list(set(range(4)) - set(senders))], 0.0)


def test_check_vma_input_not_varying_over_the_axis_goes_to_lax():
    """Under check_vma=True a tensor every stage holds (invariant over "pipe", varying over
    "data" or over nothing) is sent by lax.ppermute, exactly, gradient included."""
    from jax.sharding import PartitionSpec as P
    mesh = jax.make_mesh((2, 4), ("data", "pipe"), devices=jax.devices()[:8])
    x = jnp.asarray(gauss((2, 3, 256), seed=5))

    def value_and_grad(send, spec):
        with jax.set_mesh(mesh):
            sm = jax.shard_map(lambda b: send(b[0])[None, None], mesh=mesh, in_specs=spec,
                               out_specs=P("data", "pipe"), check_vma=True)
            xs = jax.device_put(x, jax.NamedSharding(mesh, spec))
            out = jax.jit(jax.value_and_grad(lambda v: jnp.sum(sm(v) ** 2)))(xs)
            return [np.asarray(a) for a in out]

    taco_jax.telemetry.clear_sites()
    for spec in (P("data"), P()):
        ours = value_and_grad(
            lambda v: taco_jax.ppermute(v, "pipe", CHAIN, codec="taco", min_bytes=0), spec)
        theirs = value_and_grad(lambda v: lax.ppermute(v, "pipe", CHAIN), spec)
        for a, b in zip(ours, theirs):
            np.testing.assert_array_equal(a, b)
    assert {s.reason for s, _ in taco_jax.telemetry.sites()} == {"input invariant over the axis"}


def test_ppermute_keeps_nonfinite_and_checks_perm():
    x = gauss((4, 2, 256), seed=2)
    x[1, 0, 3] = np.nan
    y = per_device(lambda v: taco_jax.ppermute(v, "tp", RING, codec="taco", min_bytes=0), x)
    assert np.isnan(y[2, 0]).all() and np.isfinite(y[2, 1]).all()
    with pytest.raises(ValueError, match="distinct"):
        per_device(lambda v: taco_jax.ppermute(v, "tp", [(0, 1), (2, 1)]), x)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        per_device(lambda v: taco_jax.ppermute(v, "tp", [(0, 4)]), x)


# -- tah4 -----------------------------------------------------------------------------------
def activations(tokens=64, channels=512, seed=3):
    """Activations with a few outlier channels, as transformer hidden states have."""
    x = gauss((tokens, channels), seed)
    x[:, [7, 100, channels - 3]] *= 40.0
    return x


def test_tah4_beats_plain_4bit_groups_on_outlier_channels():
    x = jnp.asarray(activations())
    tah, echo = codecs.get("tah4"), codecs.get("echo4")
    e_tah, e_echo = rel(tah.roundtrip(x), x), rel(echo.roundtrip(x), x)
    assert e_tah < 0.7 * e_echo, (e_tah, e_echo)
    assert tah.wire_bytes(x.size) == echo.wire_bytes(x.size) == x.size // 128 * 72


def test_tah4_zero_nan_and_shapes():
    tah = codecs.get("tah4")
    z = jnp.zeros((3, 128))
    np.testing.assert_array_equal(np.asarray(tah.roundtrip(z)), 0.0)
    x = np.asarray(activations(4, 256))
    x[1, 5] = np.nan
    y = np.asarray(tah.roundtrip(jnp.asarray(x)))
    assert np.isnan(y[1, :128]).all() and np.isfinite(y[1, 128:]).all()
    odd = jnp.asarray(gauss((5, 77)))
    assert tah.roundtrip(odd).shape == (5, 77)
