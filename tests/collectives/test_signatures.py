"""The public ops' shared arguments: codec=None and transport=None mean the recipe's
everywhere, and a transport an op cannot honour is refused naming it. Trace only; CPU,
4 simulated devices."""
import inspect

import pytest

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import taco_jax
from taco_jax import feedback, telemetry

CHAIN = [(0, 1), (1, 2), (2, 3)]
OPS = ["psum", "pvary", "all_gather", "psum_scatter", "ppermute", "psum_with_feedback",
       "pvary_with_feedback"]


def mesh4():
    return jax.make_mesh((4,), ("tp",), devices=jax.devices()[:4])


def traced_sites(fn, vma=True, shape=(4 * 4, 512)):
    """The sites tracing fn on each device's block adds."""
    mesh = mesh4()
    sm = jax.shard_map(fn, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=vma)
    with jax.set_mesh(mesh):
        _, traced = telemetry.traced_sites(jax.make_jaxpr(sm), jax.ShapeDtypeStruct(
            shape, jnp.float32, sharding=NamedSharding(mesh, P("tp"))))
    return [s for s, _ in traced]


@pytest.mark.parametrize("op", OPS)
def test_every_op_takes_codec_min_bytes_and_transport_defaulting_to_none(op):
    params = inspect.signature(getattr(taco_jax, op)).parameters
    for name in ("codec", "min_bytes", "transport"):
        assert params[name].default is None, (op, name)
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, (op, name)


def test_feedback_sites_default_to_the_recipe_codec():
    def fn(v):
        st = feedback.zeros_like(v, "tp")
        y, st = taco_jax.psum_with_feedback(v, "tp", st, min_bytes=0)
        return y + st.residual
    with taco_jax.config(codec="tah4"):
        found = traced_sites(fn)
    assert [(s.op, s.codec, s.compressed) for s in found] == [
        ("psum_with_feedback", "tah4", True)]
    assert [s.codec for s in traced_sites(fn)] == [taco_jax.Recipe().codec]


def _send(v, **kw):
    return taco_jax.ppermute(v, "tp", CHAIN, codec="tah4", min_bytes=0, **kw)


def _feedback(v, **kw):
    y, st = taco_jax.psum_with_feedback(v, "tp", feedback.zeros_like(v, "tp"),
                                        codec="tah4", min_bytes=0, **kw)
    return y + st.residual


@pytest.mark.parametrize("fn", [_send, _feedback], ids=["ppermute", "psum_with_feedback"])
def test_xla_only_ops_refuse_fused_and_follow_xla_otherwise(fn):
    with pytest.raises(ValueError, match="transport='fused' cannot run it: .*use "
                                         "transport='xla' or 'auto'"):
        traced_sites(lambda v: fn(v, transport="fused"))
    with pytest.raises(ValueError, match="transport='nvlink'"):
        traced_sites(lambda v: fn(v, transport="nvlink"))
    for kw in (dict(transport="xla"), dict(transport="auto"), {}):
        found = traced_sites(lambda v: fn(v, **kw))
        assert [(s.compressed, s.transport) for s in found] == [(True, "xla")], kw
    with taco_jax.config(transport="fused"):    # the recipe's fused: xla for these ops
        found = traced_sites(lambda v: fn(v))
    assert [(s.compressed, s.transport) for s in found] == [(True, "xla")]


def test_psum_two_level_passes_transport_on():
    mesh = jax.make_mesh((2, 2), ("i", "o"), devices=jax.devices()[:4])
    sm = jax.shard_map(lambda v: taco_jax.psum_two_level(v, "i", "o", min_bytes=0,
                                                         transport="fused"),
                       mesh=mesh, in_specs=P(("i", "o")), out_specs=P(("i", "o")))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="transport='fused' cannot run"):
        jax.make_jaxpr(sm)(jax.ShapeDtypeStruct((4 * 512,), jnp.float32,
                                                sharding=NamedSharding(mesh, P(("i", "o")))))
