"""The recipe context (taco_jax.config), tuples of mesh axes, tensor parallelism emulated
under jax.vmap, jax's unreduced sharding type, and the call-site report. CPU devices."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import taco_jax
from taco_jax import telemetry

from codec_bounds import FACTOR, assert_blockwise_close, roundtrip_error
from meshes import per_device

AXES = ("data", "tp")


def gauss(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# -- recipe ---------------------------------------------------------------------------------
def test_recipe_sets_codec_and_threshold_and_calls_override():
    x = gauss((4, 6, 256))
    exact = per_device(lambda v: lax.psum(v, "tp"), x)
    with taco_jax.config(min_bytes=0):
        lossy = per_device(lambda v: taco_jax.psum(v, "tp"), x)           # recipe codec: taco
        with taco_jax.config(codec="none"):                           # nested: codec only
            assert taco_jax.recipe.current().min_bytes == 0
            np.testing.assert_array_equal(per_device(lambda v: taco_jax.psum(v, "tp"), x), exact)
            override = per_device(lambda v: taco_jax.psum(v, "tp", codec="taco-int8"), x)
    assert 1e-4 < rel(lossy[0], exact[0]) < 0.05
    assert 1e-5 < rel(override[0], exact[0]) < 0.014
    np.testing.assert_array_equal(per_device(lambda v: taco_jax.psum(v, "tp"), x), exact)  # default
    assert taco_jax.recipe.current() == taco_jax.Recipe()


def test_recipe_rejects_bad_fields():
    with pytest.raises(TypeError, match="codek"):
        with taco_jax.config(codek="taco"):
            pass
    with pytest.raises(ValueError, match="'gpu'"):
        with taco_jax.config(backend="gpu"):
            pass
    with pytest.raises(ValueError, match="min_bytes=-1"):
        with taco_jax.config(min_bytes=-1):
            pass



def test_recipe_checks_every_field_when_made():
    """config(...) raises at the call, before its block (nothing traced), naming the value
    and the valid names; so does Recipe(...)."""
    with pytest.raises(ValueError, match="codec='fp4'.*taco, ") as e:
        taco_jax.config(codec="fp4")
    assert all(n in str(e.value) for n in taco_jax.codecs.names())
    with pytest.raises(ValueError, match="codec='tacoo'"):
        taco_jax.Recipe(codec="tacoo")
    with pytest.raises(TypeError, match="codec=3"):
        taco_jax.config(codec=3)
    with pytest.raises(ValueError, match="transport='nccl'"):
        taco_jax.config(transport="nccl")
    with pytest.raises(TypeError, match="vmap_check_vma=1"):
        taco_jax.config(vmap_check_vma=1)
    with pytest.raises(ValueError, match="min_bytes=1.5"):
        taco_jax.Recipe(min_bytes=1.5)
    assert taco_jax.recipe.current() == taco_jax.Recipe()      # nothing was pushed
    with taco_jax.config(codec=taco_jax.codecs.get("tah4")) as r:   # a Codec object
        assert r.codec.name == "tah4"


# -- tuples of axes ---------------------------------------------------------------------------
def _two_axis(fn, x, vma):
    mesh = jax.make_mesh((2, 4), AXES)
    spec = P(AXES)
    with jax.set_mesh(mesh):
        xs = jax.device_put(jnp.asarray(x), NamedSharding(mesh, spec))
        sm = jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=vma)
        y = jax.jit(sm)(xs)
        w = jnp.asarray(gauss(x.shape, seed=8))     # linear loss: the gradient's error is
        g = jax.jit(jax.grad(lambda v: jnp.sum(sm(v) * w)))(xs)   # the backward codec's own
    return np.asarray(y), np.asarray(g)


OPS = {
    "psum": (lambda v, **k: taco_jax.psum(v, AXES, **k), lambda v: lax.psum(v, AXES)),
    "all_gather": (lambda v, **k: taco_jax.all_gather(v, AXES, tiled=True, **k)[:v.shape[0]],
                   lambda v: lax.all_gather(v, AXES, tiled=True)[:v.shape[0]]),
    "psum_scatter": (lambda v, **k: jnp.tile(taco_jax.psum_scatter(v, AXES, tiled=True, **k),
                                             (8, 1)),
                     lambda v: jnp.tile(lax.psum_scatter(v, AXES, tiled=True), (8, 1))),
}


@pytest.mark.parametrize("op,vma", [("psum", False), ("all_gather", True),
                                    ("all_gather", False), ("psum_scatter", True),
                                    ("psum_scatter", False)])
def test_tuple_of_axes_matches_lax(op, vma):
    """Compressed over the product of ("data", "tp"): values and gradients as lax's, within
    the codec's error; bit-identical with codec "none". (psum under check_vma=True, whose
    result is invariant, is covered by the next test.)"""
    ours, theirs = OPS[op]
    x = gauss((8 * 8, 256), seed=3)
    y_ref, g_ref = _two_axis(theirs, x, vma)
    y, g = _two_axis(lambda v: ours(v, min_bytes=0), x, vma)
    assert 1e-4 < rel(y, y_ref) < 0.05 and rel(g, g_ref) < 0.05
    y0, g0 = _two_axis(lambda v: ours(v, codec="none", min_bytes=0), x, vma)
    np.testing.assert_array_equal(y0, y_ref)
    np.testing.assert_array_equal(g0, g_ref)


@pytest.mark.parametrize("vma", [True, False])
def test_tuple_of_axes_psum_and_pvary_grads(vma):
    """A column-parallel / row-parallel pair with f = pvary, g = psum over both axes."""
    mesh = jax.make_mesh((2, 4), AXES)
    x = gauss((16, 64), seed=4)
    w = gauss((8 * 64, 256), seed=5)

    def make(ours):
        def body(x, w):
            f = (lambda v: taco_jax.pvary(v, AXES, min_bytes=0)) if ours else (
                (lambda v: lax.pcast(v, AXES, to="varying")) if vma else (lambda v: v))
            g = (lambda v: taco_jax.psum(v, AXES, min_bytes=0)) if ours else (
                lambda v: lax.psum(v, AXES))
            h = jnp.tanh(f(x) @ w[:, :128] / 8)
            return g(h @ w[:, 128:].T)
        sm = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(AXES)), out_specs=P(),
                           check_vma=vma)
        c = jnp.asarray(gauss((16, 64), seed=6))
        return jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(sm(x, w) * c), (0, 1)))

    with jax.set_mesh(mesh):
        xs = jax.device_put(jnp.asarray(x), NamedSharding(mesh, P()))
        ws = jax.device_put(jnp.asarray(w), NamedSharding(mesh, P(AXES)))
        (l0, (gx0, gw0)), (l1, (gx1, gw1)) = make(False)(xs, ws), make(True)(xs, ws)
    assert rel(gx1, gx0) < 0.08 and rel(gw1, gw0) < 0.08


# -- tensor parallelism emulated under vmap ---------------------------------------------------
def _vmapped(fn, x):
    f = jax.vmap(fn, axis_name="tp")
    y = f(jnp.asarray(x))
    w = jnp.asarray(gauss(y.shape, seed=9))
    g = jax.grad(lambda v: jnp.sum(f(v) * w))(jnp.asarray(x))
    return np.asarray(y), np.asarray(g), w


def _meshed(fn, x, w):
    mesh = jax.make_mesh((x.shape[0],), ("tp",), devices=jax.devices()[:x.shape[0]])
    with jax.set_mesh(mesh):
        sh = NamedSharding(mesh, P("tp"))
        xs, ws = jax.device_put(jnp.asarray(x), sh), jax.device_put(w, sh)
        sm = jax.shard_map(lambda b: fn(b[0])[None], mesh=mesh, in_specs=P("tp"),
                           out_specs=P("tp"), check_vma=False)
        y = jax.jit(sm)(xs)
        g = jax.jit(jax.grad(lambda v: jnp.sum(sm(v) * ws)))(xs)
    return np.asarray(y), np.asarray(g)


EMULATED = {
    "psum": lambda v, **k: taco_jax.psum(v, "tp", **k),
    "all_gather": lambda v, **k: taco_jax.all_gather(v, "tp", **k),
    "psum_scatter": lambda v, **k: taco_jax.psum_scatter(v, "tp", tiled=True, **k),
}


@pytest.mark.parametrize("codec", ["taco", "none"])
@pytest.mark.parametrize("op", list(EMULATED))
def test_vmap_emulation_equals_mesh(op, codec):
    """The same collective under jax.vmap(axis_name="tp") on one device computes what it
    computes on a 4-device mesh (check_vma=False), forward and gradient: to fp32 rounding
    with codec "none", within the codec's error per block with taco (two programs: a
    value on a rounding boundary may round either way); the gradient goes through the
    compressed backward collective in both."""
    x = gauss((4, 8, 256), seed=11)
    fn = lambda v: EMULATED[op](v, codec=codec, min_bytes=0)
    y, g, w = _vmapped(fn, x)
    y_mesh, g_mesh = _meshed(fn, x, w)
    if codec == "none":
        np.testing.assert_allclose(y, y_mesh, rtol=0, atol=1e-5 * np.abs(y_mesh).max())
        np.testing.assert_allclose(g, g_mesh, rtol=0, atol=1e-5 * np.abs(g_mesh).max())
    else:   # relative to the magnitudes each output sums: the exact op on |x| and |w|
        y_abs, g_abs = _meshed(lambda v: EMULATED[op](v, codec="none"), np.abs(x), jnp.abs(w))
        tol = FACTOR * max(roundtrip_error(codec, x), roundtrip_error(codec, w))
        assert_blockwise_close(y, y_mesh, y_abs, tol, 256, what=f"{op} vmap vs mesh")
        assert_blockwise_close(g, g_mesh, g_abs, tol, 256, what=f"{op} gradient vmap vs mesh")
    if op == "psum":
        assert all((y[i] == y[0]).all() for i in range(4))      # replicated over members
    if codec == "taco":    # the backward really is compressed (not an exact sum)
        _, g_exact, _ = _vmapped(lambda v: EMULATED[op](v, codec="none", min_bytes=0), x)
        assert rel(g, g_exact) > 1e-4


# -- unreduced inputs; the site report ------------------------------------------------------
def test_unreduced_input_goes_through_as_lax():
    x = gauss((4, 2, 256))
    mesh = jax.make_mesh((4,), ("tp",), devices=jax.devices()[:4])

    def via(fn):
        with jax.set_mesh(mesh):
            xs = jax.device_put(jnp.asarray(x), NamedSharding(mesh, P("tp")))
            f = jax.shard_map(lambda b: fn(lax.pcast(b[0], "tp", to="unreduced")), mesh=mesh,
                              in_specs=P("tp"), out_specs=P())
            return np.asarray(jax.jit(f)(xs))
    np.testing.assert_array_equal(via(lambda u: taco_jax.psum(u, "tp", min_bytes=0)),
                                  via(lambda u: lax.psum(u, "tp")))
    assert any(s.reason == "reduced/unreduced sharding type" for s, _ in telemetry.sites())


def test_site_report_says_what_was_compressed_and_why():
    telemetry.clear_sites()
    x = gauss((4, 3, 256))
    per_device(lambda v: taco_jax.psum(v, "tp", min_bytes=0), x)
    per_device(lambda v: taco_jax.psum(v, "tp", min_bytes=1 << 20), x)
    per_device(lambda v: taco_jax.psum(v.astype(jnp.int32), "tp").astype(jnp.float32), x)
    sites = {(s.compressed, s.reason.split(" ")[0]): s for s, _ in telemetry.sites()}
    assert (True, "") in sites
    assert sites[(True, "")].bytes_per_device == 3 * 256 * 4
    # 3 blocks over P = 4: segments of 1 block; 3 of 4 sent, then the own one to 3 peers
    assert telemetry.wire_bytes(sites[(True, "")]) == 2 * 3 * 264
    plain_psum = [s for s, _ in telemetry.sites() if not s.compressed and s.op == "psum"
                  and s.dtype == "float32"][0]
    assert telemetry.wire_bytes(plain_psum) == 2 * 3 * (3 * 256 * 4) // 4
    plain = [s for (c, _), s in sites.items() if not c]
    assert any("min_bytes=1048576" in s.reason for s in plain)
    assert any(s.reason == "dtype int32" for s in plain)
    report = telemetry.site_report()
    assert "compressed (taco, xla)" in report and "plain: 3072 B < min_bytes=1048576" in report


# -- invariant all_gather; the two-level all-reduce --------------------------------------------
def test_all_gather_to_invarying_matches_lax():
    mesh = jax.make_mesh((4,), ("tp",), devices=jax.devices()[:4])
    x = gauss((4 * 3, 256), seed=12)
    w = jnp.asarray(gauss((12, 256), seed=13))

    def run(fn):
        with jax.set_mesh(mesh):
            xs = jax.device_put(jnp.asarray(x), NamedSharding(mesh, P("tp")))
            sm = jax.shard_map(fn, mesh=mesh, in_specs=P("tp"), out_specs=P(), check_vma=True)
            return (np.asarray(jax.jit(sm)(xs)),
                    np.asarray(jax.jit(jax.grad(lambda v: jnp.sum(sm(v) * w)))(xs)))
    y, g = run(lambda v: taco_jax.all_gather(v, "tp", tiled=True, to="invarying",
                                             min_bytes=0))
    y0, g0 = run(lambda v: lax.all_gather(v, "tp", tiled=True, to="invarying"))
    assert 1e-4 < rel(y, y0) < 0.05
    np.testing.assert_array_equal(g, g0)        # the backward is a slice: exact
    with pytest.raises(ValueError, match="to='everywhere'"):
        run(lambda v: taco_jax.all_gather(v, "tp", to="everywhere"))


@pytest.mark.parametrize("vma", [True, False])
def test_psum_two_level_matches_psum_over_both_axes(vma):
    mesh = jax.make_mesh((2, 4), ("hosts", "local"))
    x = gauss((8, 5, 333), seed=14)
    w = jnp.asarray(gauss((5, 333), seed=15))
    spec = P(("hosts", "local"))

    def run(fn):
        with jax.set_mesh(mesh):
            xs = jax.device_put(jnp.asarray(x).reshape(8 * 5, 333), NamedSharding(mesh, spec))
            sm = jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=P() if vma else spec,
                               check_vma=vma)
            y = np.asarray(jax.jit(sm)(xs))
            ww = w if vma else jnp.tile(w, (8, 1)) / 8     # per-device copies, same weight
            g = np.asarray(jax.jit(jax.grad(lambda v: jnp.sum(sm(v) * ww)))(xs))
            return y, g
    y, g = run(lambda v: taco_jax.psum_two_level(v, "local", "hosts", min_bytes=0))
    y0, g0 = run(lambda v: lax.psum(v, ("hosts", "local")))
    assert 1e-4 < rel(y, y0) < 0.15            # 8-bit within a host, 4-bit across hosts
    assert rel(g, g0) < 0.15
    yn, gn = run(lambda v: taco_jax.psum_two_level(v, "local", "hosts", inner_codec="none",
                                                   outer_codec="none"))
    np.testing.assert_allclose(yn, y0, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(gn, g0, rtol=1e-6, atol=1e-5)
    if not vma:
        assert all((y[i * 5:(i + 1) * 5] == y[:5]).all() for i in range(8))


# -- emulation with the check_vma convention: a Megatron block as on the mesh -----------------
def _megatron(x, w_up, w_down, t, codec):
    """One device's shard of an MLP block: f = pvary, column-parallel up, row-parallel
    down, g = psum; a loss on the (replicated) output."""
    h = jnp.tanh(taco_jax.pvary(x, "tp", codec=codec, min_bytes=0) @ w_up)
    y = x + taco_jax.psum(h @ w_down, "tp", codec=codec, min_bytes=0)
    return jnp.mean((y - t) ** 2)


@pytest.mark.parametrize("codec", ["none", "taco"])
def test_vmap_with_check_vma_convention_equals_the_mesh(codec):
    """Under taco_jax.config(vmap_check_vma=True) a block written for shard_map(check_vma=
    True) gives, under jax.vmap, the mesh's loss and gradients (to fp32 rounding with codec
    "none", within the codec's error with taco): the same tensors are compressed at the
    same sites (f backward, g forward)."""
    p, d, ff = 4, 64, 256
    x, t = jnp.asarray(gauss((32, d), 20)), jnp.asarray(gauss((32, d), 21))
    w_up = jnp.asarray(gauss((p, d, ff // p), 22) / 8)
    w_down = jnp.asarray(gauss((p, ff // p, d), 23) / 8)
    mesh = jax.make_mesh((p,), ("tp",), devices=jax.devices()[:p])

    def mesh_loss(x, wu, wd, t):
        sm = jax.shard_map(lambda x, wu, wd, t: _megatron(x, wu[0], wd[0], t, codec),
                           mesh=mesh, in_specs=(P(), P("tp"), P("tp"), P()), out_specs=P(),
                           check_vma=True)
        return sm(x, wu, wd, t)

    def vmap_loss(x, wu, wd, t):
        per = jax.vmap(lambda wu, wd: _megatron(x, wu, wd, t, codec), axis_name="tp")(wu, wd)
        return per[0]                      # the loss is replicated: every member's is equal

    def site_set():
        return {(s.op, s.shape, s.codec, s.compressed, s.p) for s, _ in telemetry.sites()}

    telemetry.clear_sites()
    with jax.set_mesh(mesh):
        sh = NamedSharding(mesh, P("tp"))
        l0, g0 = jax.jit(jax.value_and_grad(mesh_loss, (0, 1, 2)))(
            x, jax.device_put(w_up, sh), jax.device_put(w_down, sh), t)
    on_mesh = site_set()
    telemetry.clear_sites()
    with taco_jax.config(vmap_check_vma=True):
        l1, g1 = jax.jit(jax.value_and_grad(vmap_loss, (0, 1, 2)))(x, w_up, w_down, t)
    assert site_set() == on_mesh and on_mesh           # the same sites, compressed alike
    if codec == "none":
        np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
        for a, b in zip(g1, g0):
            a, b = np.asarray(a), np.asarray(b)
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())
        return
    with taco_jax.config(vmap_check_vma=True):
        le, ge = jax.jit(jax.value_and_grad(
            lambda *a: jax.vmap(lambda wu, wd: _megatron(a[0], wu, wd, a[3], "none"),
                                axis_name="tp")(a[1], a[2])[0], (0, 1, 2)))(
            x, w_up, w_down, t)
    # two programs: equal within the codec's error, i.e. a few times what compression
    # itself changes (a block may round either way in one of them)
    assert abs(float(l1) - float(l0)) <= FACTOR * abs(float(l0) - float(le)) + 1e-6 * abs(
        float(l0)), (float(l1), float(l0), float(le))
    for a, b, e in zip(g1, g0, ge):
        assert rel(a, b) <= FACTOR * rel(b, e), (rel(a, b), rel(b, e))
    # compression happened, in both directions
    assert rel(g1[0], ge[0]) > 1e-4 and rel(g1[1], ge[1]) > 1e-4
