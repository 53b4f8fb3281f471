"""A Flax NNX MLP block with Megatron tensor parallelism, compressed through the recipe.

    python examples/nnx_tp_block.py     # on CPU: 4 simulated devices

The block's up projection is column-parallel (its input goes through taco_jax.pvary:
identity forward, compressed all-reduce of the gradient backward) and its down projection
row-parallel (taco_jax.psum forward). The module names no codec: `taco_jax.config` sets
it for everything traced inside, so the same module trains exact or compressed."""
import jax

jax.config.update("jax_num_cpu_devices", 4)      # simulated devices where JAX runs on CPU

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import taco_jax  # noqa: E402

TP = 4
D, D_FF = 256, 1024
mesh = jax.make_mesh((TP,), ("tp",))


class TPBlock(nnx.Module):
    """One device's shard: up (D, D_FF/TP) and down (D_FF/TP, D)."""

    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(D, D_FF // TP, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(D_FF // TP, D, use_bias=False, rngs=rngs)

    def __call__(self, x):
        h = jax.nn.gelu(self.up(taco_jax.pvary(x, "tp")))     # Megatron's f
        return x + taco_jax.psum(self.down(h), "tp")          # Megatron's g


def shard_params(seed):
    """Each device's own shard of the block (stacked over "tp")."""
    graphdef, state = nnx.split(TPBlock(nnx.Rngs(seed)))
    shards = [nnx.state(TPBlock(nnx.Rngs(seed + 1 + i))) for i in range(TP)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *shards)
    return graphdef, jax.device_put(stacked, NamedSharding(mesh, P("tp")))


graphdef, params = shard_params(0)
x = jax.random.normal(jax.random.key(1), (256, D))
target = jax.random.normal(jax.random.key(2), (256, D))


def loss_fn(params, x, target):
    def local(p, x, t):
        block = nnx.merge(graphdef, jax.tree.map(lambda a: a[0], p))
        return jnp.mean((block(x) - t) ** 2)
    return jax.shard_map(local, mesh=mesh, in_specs=(P("tp"), P(), P()), out_specs=P())(
        params, x, target)


def grads(codec):
    with taco_jax.config(codec=codec, min_bytes=0):       # read when jax.jit traces
        return jax.jit(jax.value_and_grad(loss_fn))(params, x, target)


(l_exact, g_exact), (l_taco, g_taco) = grads("none"), grads("taco")
flat = lambda g: np.concatenate([np.ravel(a) for a in jax.tree.leaves(g)])
err = np.linalg.norm(flat(g_taco) - flat(g_exact)) / np.linalg.norm(flat(g_exact))
print(f"loss exact {float(l_exact):.5f}, taco {float(l_taco):.5f}; gradient relative error "
      f"{err:.4f}")
print(taco_jax.telemetry.site_report())
assert abs(float(l_taco) - float(l_exact)) / float(l_exact) < 0.01 and 1e-4 < err < 0.05
