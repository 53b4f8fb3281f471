"""Fidelity tooling: telemetry.capture hands the real all-reduce tensors to the host (and
costs nothing when off); bench/fidelity.py's metrics; train.ablation's driver (tiny smoke)."""
import json
import sysconfig
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import taco_jax
from models import parallel
from taco_jax import telemetry

CORPUS = Path(sysconfig.get_paths()["stdlib"]) / "json"


def _mesh(p=2):
    return jax.make_mesh((p,), ("tp",), devices=jax.devices()[:p])


def _put(args, specs):
    return [jax.device_put(a, NamedSharding(_mesh(), s)) for a, s in zip(args, specs)]


def _run(fn, *args, all_devices=False):
    with telemetry.capture(all_devices=all_devices) as cap:
        out = jax.jit(fn)(*args)        # traced inside the block
        jax.block_until_ready(out)
    jax.effects_barrier()
    return out, cap


VMA_SPECS = (P(), P("tp"), P("tp"))


def _f_vma(codec, min_bytes):
    """h replicated -> f (pvary) -> u * w (w sharded) -> g (psum). ct(u) on device i is w_i."""
    def local(h, w, x):
        u = taco_jax.pvary(h, "tp", codec=codec, min_bytes=min_bytes)
        y = taco_jax.psum(u * w + x, "tp", codec=codec, min_bytes=min_bytes)
        return jnp.sum(y)

    f = jax.shard_map(local, mesh=_mesh(), in_specs=VMA_SPECS, out_specs=P(),
                      check_vma=True)
    return jax.grad(f)


@pytest.mark.parametrize("codec,min_bytes", [("taco", 0), ("taco", None), ("none", 0)],
                         ids=["compressed", "lax-route", "codec-none"])
def test_capture_equals_inputs_vma(codec, min_bytes):
    rng = np.random.default_rng(0)
    h = rng.standard_normal((4, 64), np.float32)
    w = rng.standard_normal((8, 64), np.float32)
    x = rng.standard_normal((8, 64), np.float32)
    grad, cap = _run(_f_vma(codec, min_bytes), *_put([h, w, x], VMA_SPECS), all_devices=True)
    fwd, bwd = cap.by_kind("fwd"), cap.by_kind("bwd")
    assert len(fwd) == 2 and len(bwd) == 2                   # one site each, both devices
    for r in fwd:
        i = r["device"]
        assert r["op"] == "psum" and r["site"] == 0 and r["call"] == 0
        np.testing.assert_allclose(r["value"], h * w[4 * i:4 * i + 4] + x[4 * i:4 * i + 4],
                                   rtol=1e-6, atol=1e-6)
    for r in bwd:
        i = r["device"]
        assert r["op"] == "pvary"
        np.testing.assert_array_equal(r["value"], w[4 * i:4 * i + 4])   # ct(u) = w_i
    # the hook does not change the result: grad wrt h is psum over devices of w_i
    ref = w[:4] + w[4:]
    rel = np.linalg.norm(np.asarray(grad) - ref) / np.linalg.norm(ref)
    assert rel < (0.1 if codec == "taco" and min_bytes == 0 else 1e-6), rel


def test_capture_first_device_and_call_counter():
    rng = np.random.default_rng(1)
    h, w, x = (rng.standard_normal(s, np.float32) for s in [(4, 64), (8, 64), (8, 64)])
    fn = jax.jit(_f_vma("taco", 0))
    with telemetry.capture() as cap:
        for _ in range(3):
            jax.block_until_ready(fn(*_put([h, w, x], VMA_SPECS)))
    jax.effects_barrier()
    assert sorted((r["kind"], r["call"], r["device"]) for r in cap.records) == [
        ("bwd", 0, 0), ("bwd", 1, 0), ("bwd", 2, 0), ("fwd", 0, 0), ("fwd", 1, 0), ("fwd", 2, 0)]


def test_capture_bwd_without_vma():
    """check_vma=False: psum's transpose all-reduces the cotangent of its output."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((8, 64), np.float32)
    c = rng.standard_normal((4, 64), np.float32)

    def local(x, c):
        return jnp.sum(taco_jax.psum(x, "tp", codec="taco", min_bytes=0) * c)

    f = jax.shard_map(local, mesh=_mesh(), in_specs=(P("tp"), P()), out_specs=P(),
                      check_vma=False)
    _, cap = _run(jax.grad(f), *_put([x, c], [P("tp"), P()]))
    (fwd,), (bwd,) = cap.by_kind("fwd"), cap.by_kind("bwd")
    np.testing.assert_array_equal(fwd["value"], x[:4])
    # without vma JAX splits the replicated output's cotangent over the P devices (c / P
    # each) and psum's transpose sums them back: the all-reduce's input is c / 2
    np.testing.assert_allclose(bwd["value"], c / 2, rtol=1e-6)


def test_capture_off_adds_nothing():
    args = _put([jnp.zeros(s, jnp.float32) for s in [(4, 64), (8, 64), (8, 64)]], VMA_SPECS)
    # fresh functions each time: JAX caches traces by function identity (telemetry docstring)
    off = str(jax.make_jaxpr(_f_vma("taco", None))(*args))
    assert "callback" not in off
    with telemetry.capture():
        on = str(jax.make_jaxpr(_f_vma("taco", None))(*args))
    assert "debug_callback" in on
    assert str(jax.make_jaxpr(_f_vma("taco", None))(*args)) == off   # scoped to the block
