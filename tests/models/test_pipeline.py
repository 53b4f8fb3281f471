"""GPipe over a "pipe" mesh axis (models/pipeline.py): loss and gradients equal the same
layers run one after another on one device. CPU devices."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from models import pipeline

D = 64


def layer(w, x):                       # one stage: a residual MLP layer
    return x + jnp.tanh(x @ w[0]) @ w[1]


def make(stages, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((stages, 2, D, D)).astype(np.float32) / np.sqrt(D)
    x = rng.standard_normal((8, 16, D)).astype(np.float32)     # 8 sequences of 16 tokens
    t = rng.standard_normal((8, 16, D)).astype(np.float32)
    return jnp.asarray(w), jnp.asarray(x), jnp.asarray(t)


def sequential_loss(w, x, t):
    for s in range(w.shape[0]):
        x = layer(w[s], x)
    return jnp.mean((x - t) ** 2)


def pipelined_loss(stages, microbatches, codec="none", vma=True):
    mesh = jax.make_mesh((stages,), ("pipe",), devices=jax.devices()[:stages])

    def local(w, x, t):
        mbs = x.reshape(microbatches, -1, *x.shape[1:])
        out = pipeline.gpipe(layer, w[0], mbs, codec=codec, min_bytes=0)
        err = jnp.sum((out.reshape(x.shape) - t) ** 2)
        err = jnp.where(lax.axis_index("pipe") == stages - 1, err, 0.0)
        return lax.psum(err, "pipe") / x.size

    return mesh, jax.shard_map(local, mesh=mesh, in_specs=(P("pipe"), P(), P()),
                               out_specs=P(), check_vma=vma)


@pytest.mark.parametrize("stages,microbatches", [(2, 1), (2, 4), (4, 2), (4, 8)])
@pytest.mark.parametrize("vma", [True, False])
def test_gpipe_equals_sequential(stages, microbatches, vma):
    w, x, t = make(stages)
    ref_l, ref_g = jax.value_and_grad(sequential_loss)(w, x, t)
    mesh, fn = pipelined_loss(stages, microbatches, vma=vma)
    with jax.set_mesh(mesh):
        ws = jax.device_put(w, NamedSharding(mesh, P("pipe")))
        l, g = jax.jit(jax.value_and_grad(fn))(ws, x, t)
    np.testing.assert_allclose(float(l), float(ref_l), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(g), np.asarray(ref_g), rtol=1e-4,
                               atol=1e-5 * np.abs(np.asarray(ref_g)).max())


def test_gpipe_compressed_stage_boundaries():
    """tah4 / taco at the stage boundaries: close to the exact pipeline, not equal to it."""
    w, x, t = make(4, seed=1)
    ref_l, ref_g = jax.value_and_grad(sequential_loss)(w, x, t)
    for codec, bound in (("taco", 0.05), ("tah4", 0.25)):
        mesh, fn = pipelined_loss(4, 4, codec=codec)
        with jax.set_mesh(mesh):
            ws = jax.device_put(w, NamedSharding(mesh, P("pipe")))
            l, g = jax.jit(jax.value_and_grad(fn))(ws, x, t)
        g, ref = np.asarray(g), np.asarray(ref_g)
        err = np.linalg.norm(g - ref) / np.linalg.norm(ref)
        assert 1e-5 < err < bound, (codec, err)
        assert abs(float(l) - float(ref_l)) / float(ref_l) < bound


def test_bubble_fraction():
    assert pipeline.bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert pipeline.bubble_fraction(1, 8) == 0.0


def _head(v, y, t):                    # the last stage's loss, with a parameter of its own
    return jnp.sum((y * v - t) ** 2)


@pytest.mark.parametrize("stages,microbatches", [(2, 4), (4, 2)])
@pytest.mark.parametrize("vma", [True, False])
def test_one_f_one_b_equals_sequential(stages, microbatches, vma):
    """1F1B's loss, block gradients, loss-parameter gradient and input cotangents equal
    autodiff of the layers run one after another."""
    w, x, t = make(stages)
    v = jnp.float32(1.3)

    def ref(w, v, x):
        for s in range(stages):
            x = layer(w[s], x)
        return _head(v, x, t) / x.size
    ref_l, (ref_w, ref_v, ref_x) = jax.value_and_grad(ref, argnums=(0, 1, 2))(w, v, x)
    mesh = jax.make_mesh((stages,), ("pipe",), devices=jax.devices()[:stages])

    def local(w, v, x, t):
        split = lambda a: a.reshape(microbatches, -1, *a.shape[1:])   # noqa: E731
        if vma:
            v = lax.pcast(v, "pipe", to="varying")
        loss, gw, gv, gx = pipeline.one_f_one_b(layer, w[0], split(x), _head, v, split(t),
                                                scale=1.0 / x.size)
        return (lax.psum(loss, "pipe"), gw[None], lax.psum(gv, "pipe"),
                lax.psum(gx.reshape(x.shape), "pipe"))

    fn = jax.shard_map(local, mesh=mesh, in_specs=(P("pipe"), P(), P(), P()),
                       out_specs=(P(), P("pipe"), P(), P()), check_vma=vma)
    with jax.set_mesh(mesh):
        ws = jax.device_put(w, NamedSharding(mesh, P("pipe")))
        l, gw, gv, gx = jax.jit(fn)(ws, v, x, t)
    np.testing.assert_allclose(float(l), float(ref_l), rtol=1e-5)
    for got, want in ((gw, ref_w), (gv, ref_v), (gx, ref_x)):
        want = np.asarray(want)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4,
                                   atol=1e-5 * np.abs(want).max())


def test_one_f_one_b_schedule():
    """Each tick's hand-offs are swaps of neighbours of one parity; a step has 2(M + S - 1)
    ticks."""
    assert pipeline._swap(4, 0) == [(0, 1), (1, 0), (2, 3), (3, 2)]
    assert pipeline._swap(4, 1) == [(1, 2), (2, 1)]
    assert pipeline._swap(3, 1) == [(1, 2), (2, 1)]
    assert pipeline.one_f_one_b_ticks(4, 8) == 22
