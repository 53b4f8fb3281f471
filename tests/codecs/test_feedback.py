"""Error feedback (taco_jax.feedback) on a deep residual stream, TP over 4 simulated devices.

h_{k+1} = h_k + psum(W2_k · (W1_k · f(h_k))) + eps_k, W1 column- and W2 row-parallel, f the
Megatron pvary. One lax.scan of 64 layers gives the forward error at every depth (h_k vs
the lax.psum stream) and, through d loss / d eps_k = ct(h_{k+1}), the backward error after
any number of backward sites. Print the table with:

    .venv/bin/python -m pytest -q -s tests/codecs/test_feedback.py -k depth
"""
import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import taco_jax
from taco_jax import feedback

NP, T, D, H, N = 4, 8, 128, 256, 64
GAIN = 0.1          # branch gain: the exact stream grows ~1.4× over 64 layers
DEPTHS = (1, 4, 16, 64)


def mesh():
    return jax.make_mesh((NP,), ("tp",), devices=jax.devices()[:NP])


@functools.lru_cache(maxsize=None)
def weights(n=N):
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((n, D, H)).astype(np.float32) / np.sqrt(D)
    w2 = GAIN * rng.standard_normal((n, H, D)).astype(np.float32) / np.sqrt(H)
    h0 = rng.standard_normal((T, D)).astype(np.float32)
    c = rng.standard_normal((T, D)).astype(np.float32)
    m = mesh()
    return (jax.device_put(w1, NamedSharding(m, P(None, None, "tp"))),
            jax.device_put(w2, NamedSharding(m, P(None, "tp", None))), h0, c)


def stack(mode, codec, vma=True):
    """(loss, hs) as a function of eps (n, T, D); mode: exact | plain | fb."""
    w1, w2, h0, c = weights()
    kw = dict(codec=codec, min_bytes=0)

    def body(eps, h, a, b):
        def layer(carry, w):
            h, st = carry
            a, b, e = w
            if mode == "exact":
                u = lax.pcast(h, "tp", to="varying") if vma else h
                y = lax.psum((u @ a) @ b, "tp")
            elif mode == "plain":
                y = taco_jax.psum((taco_jax.pvary(h, "tp", **kw) @ a) @ b, "tp", **kw)
            else:
                u, st = feedback.pvary_with_feedback(h, "tp", st, **kw)
                y, st = feedback.psum_with_feedback((u @ a) @ b, "tp", st, **kw)
            h = h + y + e
            return (h, st), h
        _, hs = lax.scan(layer, (h, feedback.zeros(h.shape, "tp")), (a, b, eps))
        return jnp.sum(hs[-1] * c), hs                       # hs[k] = h_{k+1}
    f = jax.shard_map(body, mesh=mesh(), in_specs=(P(), P(), P(None, None, "tp"),
                                                   P(None, "tp", None)),
                      out_specs=(P(), P()), check_vma=vma)
    return lambda eps, h: f(eps, h, w1, w2)


@functools.lru_cache(maxsize=None)
def streams(mode, codec):
    """(forward stream hs[k] = h_{k+1}, cotangents ct[k] = ct(h_k)), (N, T, D), (N+1, T, D)."""
    eps = jnp.zeros((N, T, D), jnp.float32)
    h0 = jnp.asarray(weights()[2])
    with jax.set_mesh(mesh()):
        grad = jax.value_and_grad(stack(mode, codec), argnums=(0, 1), has_aux=True)
        (_, hs), (ct, ct0) = jax.jit(grad)(eps, h0)
    return np.asarray(hs), np.concatenate([np.asarray(ct0)[None], np.asarray(ct)])


def rms(v):
    return float(np.sqrt(np.mean(np.square(v))))


def errors(codec):
    """{mode: (fwd errors at DEPTHS, bwd errors after DEPTHS backward sites)}, rms."""
    hs0, ct0 = streams("exact", None)
    out = {}
    for mode in ("plain", "fb"):
        hs, ct = streams(mode, codec)
        fwd = [rms(hs[d - 1] - hs0[d - 1]) for d in DEPTHS]
        bwd = [rms(ct[N - d] - ct0[N - d]) for d in DEPTHS]
        out[mode] = fwd, bwd
    return out


@pytest.mark.parametrize("codec", ["echo4", "taco"])
def test_depth_error_bounded_with_feedback(codec):
    e = errors(codec)
    hs0, ct0 = streams("exact", None)
    print(f"\n{codec}: rms error vs lax.psum stream (rms h_64 = {rms(hs0[-1]):.3f}, "
          f"rms ct(h_0) = {rms(ct0[0]):.3f}); depth {DEPTHS}")
    for mode in ("plain", "fb"):
        for i, way in enumerate(("forward ", "backward")):
            print(f"  {mode:5s} {way}: " + "  ".join(f"{v:.5f}" for v in e[mode][i]))
    for i in range(2):                                        # forward, backward
        plain, fb = e["plain"][i], e["fb"][i]
        assert plain[3] > 4 * plain[1], plain                 # no feedback: grows ~√depth
        assert fb[3] < 2.5 * fb[1], fb                        # feedback: bounded
        assert fb[3] < plain[3] / 3, (fb, plain)


def test_backward_matches_reference_loop():
    """jax.grad through the custom_vjps == a hand-written backward loop that threads the
    backward residual through feedback.allreduce site by site, last layer first."""
    n = 8
    w1, w2, h0, c = weights()
    w1, w2 = w1[:n], w2[:n]

    def by_hand(c, a, b, codec="echo4"):
        ct, r, cts = c, feedback.zeros(c.shape, "tp").residual, []
        for k in reversed(range(n)):
            cts.append(ct)                                    # ct(h_{k+1})
            part = (lax.pcast(ct, "tp", to="varying") @ b[k].T) @ a[k].T   # this device's
            y, r = feedback.allreduce(part, "tp", r, codec=codec, min_bytes=0)
            ct = ct + y
        return jnp.stack(cts[::-1])
    ref, ref_exact = (jax.shard_map(functools.partial(by_hand, codec=codec), mesh=mesh(),
                                    in_specs=(P(), P(None, None, "tp"), P(None, "tp", None)),
                                    out_specs=P(), check_vma=True)
                      for codec in ("echo4", "none"))

    def model(eps, h, a, b):
        def layer(carry, w):
            h, st = carry
            u, st = feedback.pvary_with_feedback(h, "tp", st, codec="echo4", min_bytes=0)
            y, st = feedback.psum_with_feedback((u @ w[0]) @ w[1], "tp", st, codec="echo4",
                                                min_bytes=0)
            return (h + y + w[2], st), None
        (h, _), _ = lax.scan(layer, (h, feedback.zeros(h.shape, "tp")), (a, b, eps))
        return jnp.sum(h * c)
    f = jax.shard_map(model, mesh=mesh(), in_specs=(P(), P(), P(None, None, "tp"),
                                                    P(None, "tp", None)),
                      out_specs=P(), check_vma=True)
    with jax.set_mesh(mesh()):
        got = jax.jit(jax.grad(f))(jnp.zeros((n, T, D)), h0, w1, w2)
        want = jax.jit(ref)(jnp.asarray(c), w1, w2)
        exact = jax.jit(ref_exact)(jnp.asarray(c), w1, w2)
    # two programs (a scan of custom_vjps, an unrolled loop): a value on a rounding boundary
    # may go either way in one of them. The residual hands such a difference (one block's
    # quantization error) to the next site, which compensates it, so the two stay closer
    # than compression moves them from the exact loop; a residual not threaded through
    # (plain echo4) differs by twice that (measured)
    got, want, exact = (np.asarray(a, np.float64) for a in (got, want, exact))
    effect = np.linalg.norm(want - exact)
    assert effect > 1e-4 * np.linalg.norm(exact)               # compressed, really
    assert np.linalg.norm(got - want) <= effect, (np.linalg.norm(got - want), effect)


def test_check_vma_false_forward_feedback_and_grads():
    """Without check_vma: forward feedback works as above; the backward all-reduce sits at
    psum's transpose and runs compressed without feedback; gradients stay within 4-bit error."""
    m, p = mesh(), NP
    x = np.random.default_rng(5).standard_normal((p, 4, 8, 96)).astype(np.float32)
    xs = jax.device_put(jnp.asarray(x), NamedSharding(m, P("tp")))

    def run(mode):
        def body(b):
            h = jnp.zeros(b.shape[2:])
            st = feedback.zeros(h.shape, "tp")
            for k in range(b.shape[1]):
                v = jnp.sin(b[0, k]) * (1 + 0.1 * h)
                if mode == "fb":
                    y, st = feedback.psum_with_feedback(v, "tp", st, codec="echo4",
                                                        min_bytes=0)
                else:
                    y = lax.psum(v, "tp")
                h = h + y
            return jnp.mean(jnp.cos(h))
        f = jax.shard_map(body, mesh=m, in_specs=P("tp"), out_specs=P(), check_vma=False)
        with jax.set_mesh(m):
            return jax.jit(jax.value_and_grad(f))(xs)
    (l_fb, g_fb), (l_ex, g_ex) = run("fb"), run("exact")
    assert abs(float(l_fb) - float(l_ex)) < 0.01, (l_fb, l_ex)
    rel = np.linalg.norm(np.asarray(g_fb - g_ex)) / np.linalg.norm(np.asarray(g_ex))
    assert rel < 0.3, rel                                     # measured 0.19


def test_exact_fallback_and_validation():
    """Below min_bytes the sum is exact (f32) and the state drains to zero; bad arguments
    name themselves."""
    x = np.random.default_rng(6).standard_normal((NP, 3, 5)).astype(np.float32)
    xs = jax.device_put(jnp.asarray(x), NamedSharding(mesh(), P("tp")))

    def body(b):
        st = feedback.FeedbackState(b[0] * 0 + 1.0)           # residual 1 on every device
        y, st = feedback.psum_with_feedback(b[0], "tp", st)    # default min_bytes: exact
        return y, st.residual
    f = jax.shard_map(body, mesh=mesh(), in_specs=P("tp"), out_specs=(P(), P("tp")))
    y, r = jax.jit(f)(xs)
    np.testing.assert_allclose(np.asarray(y), x.sum(0) - NP, rtol=1e-5, atol=1e-5)
    assert not np.asarray(r).any()

    def bad(b):
        feedback.psum_with_feedback(b[0], "tp", feedback.zeros((2,), "tp"))
    with pytest.raises(ValueError, match="residual.shape"):
        jax.shard_map(bad, mesh=mesh(), in_specs=P("tp"), out_specs=P())(xs)
    with pytest.raises(TypeError, match="FeedbackState"):
        jax.shard_map(lambda b: feedback.psum_with_feedback(b[0], "tp", b[0]), mesh=mesh(),
                      in_specs=P("tp"), out_specs=P())(xs)
