"""A tensor-parallel layer of your own, with lax.psum replaced by taco_jax.psum.

    python examples/drop_in.py          # on CPU: 4 simulated devices

A row-parallel matmul: x is split along its features and w along its rows, so each device
computes a partial product and the all-reduce sums them. Only the psum line changes."""
import jax

jax.config.update("jax_num_cpu_devices", 4)      # simulated devices where JAX runs on CPU

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import taco_jax  # noqa: E402

mesh = jax.make_mesh((4,), ("tp",))


@jax.jit
@jax.shard_map(mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P())
def row_parallel(x, w):                  # x: (tokens, d_ff/tp), w: (d_ff/tp, d)
    return taco_jax.psum(x @ w, "tp")    # was: jax.lax.psum(x @ w, "tp")


tokens, d_ff, d = 512, 1024, 256
x = jax.device_put(jax.random.normal(jax.random.key(0), (tokens, d_ff)),
                   NamedSharding(mesh, P(None, "tp")))
w = jax.device_put(jax.random.normal(jax.random.key(1), (d_ff, d)) / d_ff ** 0.5,
                   NamedSharding(mesh, P("tp", None)))
# Small tensors stay exact under the default threshold; force compression to see it work.
with taco_jax.config(min_bytes=0):
    y = row_parallel(x, w)
exact = np.asarray(x) @ np.asarray(w)
err = np.linalg.norm(np.asarray(y) - exact) / np.linalg.norm(exact)
print(f"y {y.shape}: relative error vs the exact product {err:.4f}")
print(taco_jax.telemetry.site_report())
assert y.shape == (tokens, d) and 1e-4 < err < 0.05
