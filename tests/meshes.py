"""Test helpers: run a function on each simulated CPU device of a 1-D ("tp",) mesh; lax's
collectives in place of the fused transport's Mosaic GPU exchange kernel."""
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P


def per_device(fn, x, vma=False):
    """fn on each device's x[i] (x: (p, ...)); every device's result, stacked."""
    p = x.shape[0]
    mesh = jax.make_mesh((p,), ("tp",), devices=jax.devices()[:p])
    with jax.set_mesh(mesh):
        xs = jax.device_put(jnp.asarray(x), NamedSharding(mesh, P("tp")))
        f = jax.shard_map(lambda b: fn(b[0])[None], mesh=mesh, in_specs=P("tp"),
                          out_specs=P("tp"), check_vma=vma)
        return np.asarray(jax.jit(f)(xs))


def lax_exchange_kernel(send, axis, p, gather, out_mat):
    """Stands in for `fused.exchange_kernel` (monkeypatched) where no 2 GPUs run it."""
    from taco_jax.collectives import fused
    assert send.dtype == jnp.uint8 and send.shape[-1] % fused.TILE_BYTES == 0
    return lax.all_gather(send, axis) if gather else lax.all_to_all(send, axis, 0, 0)
