"""The plain route: where a taco_jax op does not compress (codec "none", or a tensor below
min_bytes) it traces to exactly the jaxpr of the lax collective it replaces, under
check_vma True and False. Trace only; CPU, 4 simulated devices."""
import pytest

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import taco_jax

CHAIN = [(0, 1), (1, 2), (2, 3)]
X = jax.ShapeDtypeStruct((4 * 8, 6, 32), jnp.float32)       # (devices * 8, 6, 32)


def mesh4():
    return jax.make_mesh((4,), ("tp",), devices=jax.devices()[:4])


def jaxpr(fn, vma: bool) -> str:
    """The jaxpr of fn on each device's (8, 6, 32) block, as a shard_map."""
    mesh = mesh4()
    sm = jax.shard_map(fn, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=vma)
    with jax.set_mesh(mesh):
        x = jax.ShapeDtypeStruct(X.shape, X.dtype, sharding=NamedSharding(mesh, P("tp")))
        return str(jax.make_jaxpr(sm)(x))


# each pair: (taco_jax op with its plain-route kwargs, the lax call it replaces); results
# are made varying again (a pcast of the pair's common output) so out_specs P("tp") holds
PAIRS = {
    "psum": (lambda v, **kw: taco_jax.psum(v, "tp", **kw), lambda v: lax.psum(v, "tp")),
    "psum_tuple_axis": (lambda v, **kw: taco_jax.psum(v, ("tp",), **kw),
                        lambda v: lax.psum(v, ("tp",))),
    "all_gather": (lambda v, **kw: taco_jax.all_gather(v, "tp", axis=1, tiled=True, **kw),
                   lambda v: lax.all_gather(v, "tp", axis=1, tiled=True)),
    "all_gather_negative_axis": (
        lambda v, **kw: taco_jax.all_gather(v, "tp", axis=-1, **kw),
        lambda v: lax.all_gather(v, "tp", axis=-1)),
    "psum_scatter": (
        lambda v, **kw: taco_jax.psum_scatter(v, "tp", scatter_dimension=0, tiled=True, **kw),
        lambda v: lax.psum_scatter(v, "tp", scatter_dimension=0, tiled=True)),
    "ppermute": (lambda v, **kw: taco_jax.ppermute(v, "tp", CHAIN, **kw),
                 lambda v: lax.ppermute(v, "tp", CHAIN)),
}
ROUTES = {"codec_none": dict(codec="none", min_bytes=0),
          "below_min_bytes": dict(codec="taco", min_bytes=1 << 30),
          "default_threshold": dict(codec="taco")}


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("vma", [True, False], ids=["check_vma", "no_check_vma"])
@pytest.mark.parametrize("op", list(PAIRS))
def test_plain_route_traces_to_the_lax_jaxpr(op, vma, route):
    ours, theirs = PAIRS[op]
    kw = ROUTES[route]
    got = jaxpr(lambda v: ours(v, **kw), vma)
    want = jaxpr(theirs, vma)
    assert got == want


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("vma", [True, False], ids=["check_vma", "no_check_vma"])
def test_plain_pvary_traces_to_lax_pcast(vma, route):
    """pvary takes a value invariant over the axis (here a psum's result)."""
    kw = ROUTES[route]
    got = jaxpr(lambda v: taco_jax.pvary(lax.psum(v, "tp"), "tp", **kw), vma)
    want = jaxpr(lambda v: lax.pcast(lax.psum(v, "tp"), "tp", to="varying"), vma)
    assert got == want


def test_the_compressed_route_does_differ():
    """The comparison can fail: a compressed psum traces to something else."""
    ours, theirs = PAIRS["psum"]
    assert jaxpr(lambda v: ours(v, codec="taco", min_bytes=0), False) != jaxpr(theirs, False)


@pytest.mark.parametrize("n,compressed", [((1 << 30) // 4 - 256, False), ((1 << 30) // 4, True)])
def test_default_threshold_is_1_gib_per_device(n, compressed):
    """Without a calibration (conftest's cache path does not exist), min_bytes=None
    compresses from DEFAULT_MIN_BYTES, 1 GiB per device, the calibration's answer on 2×H200."""
    from taco_jax import telemetry
    assert taco_jax.DEFAULT_MIN_BYTES == 1 << 30
    mesh = mesh4()
    sm = jax.shard_map(lambda v: taco_jax.psum(v, "tp", codec="taco"), mesh=mesh,
                       in_specs=P("tp"), out_specs=P(), check_vma=False)
    before = dict(telemetry.sites())
    with jax.set_mesh(mesh):
        jax.make_jaxpr(sm)(jax.ShapeDtypeStruct((4 * n,), jnp.float32,
                                                sharding=NamedSharding(mesh, P("tp"))))
    new = [s for s, k in telemetry.sites() if k > before.get(s, 0)]
    assert len(new) == 1 and new[0].shape == (n,) and new[0].compressed is compressed, new
    if not compressed:
        assert new[0].reason == f"{4 * n} B < min_bytes={1 << 30}"
