"""Parallel plumbing for models/gpt.py: the ("data", "tp") mesh, parameter shardings, and the
loss/gradient of one global batch run as a single `jax.shard_map`.

Parameters live as *global* fp32 arrays (a plain nested dict, `nnx.to_pure_dict` of the model
state) sharded with `NamedSharding(mesh, pspec)`; inside the shard_map each device sees its
local shards and rebuilds the NNX module around them. With `check_vma=True` JAX tracks which
values vary over which mesh axis, and the gradient of a parameter that is invariant over an
axis comes out summed over that axis: this is the data-parallel gradient all-reduce (over
"data"), and the all-reduce of replicated parameters' gradients (over "tp").
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx
from flax.nnx import traversals
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from models.gpt import DATA, GPT, TP, GPTConfig

BATCH_SPEC = P(DATA, None)  # tokens (B, T): batch split over "data", replicated over "tp"


def mesh_shape(n_devices: int, tp: int = 0, data: int = 0) -> tuple[int, int]:
    """(data, tp) for `n_devices`; 0 means "the rest" (tp=0: all devices go to TP)."""
    if tp < 0 or data < 0:
        raise ValueError(f"parallel.tp={tp} and parallel.data={data} must be >= 0 (0 = auto)")
    need = max(tp, 1) * max(data, 1)
    if tp == 0:
        tp = n_devices // (data or 1)
    if data == 0:
        data = n_devices // tp if tp else 0
    if tp == 0 or data == 0 or data * tp > n_devices:
        raise ValueError(f"mesh data={data or 'auto'} x tp={tp or 'auto'} needs "
                         f"{max(need, data * tp)} devices but only {n_devices} are available")
    return data, tp


def make_mesh(data: int, tp: int, devices=None) -> jax.sharding.Mesh:
    """A ("data", "tp") mesh on the first data*tp devices (TP neighbours adjacent)."""
    devices = list(jax.devices() if devices is None else devices)
    if data * tp > len(devices):
        raise ValueError(f"mesh data={data} x tp={tp} needs {data * tp} devices but only "
                         f"{len(devices)} {devices[0].platform} devices are available")
    return jax.make_mesh((data, tp), (DATA, TP), axis_types=(AxisType.Explicit,) * 2,
                         devices=devices[: data * tp])


@dataclasses.dataclass(frozen=True)
class ShardedGPT:
    """Everything needed to run `GPT` on a mesh, built without allocating parameters."""

    cfg: GPTConfig
    mesh: jax.sharding.Mesh
    graphdef: Any  # nnx GraphDef of GPT
    template: Any  # abstract nnx.State (Variables with metadata, ShapeDtypeStruct values)
    specs: dict  # pure dict of PartitionSpec, same structure as the params

    @property
    def shardings(self) -> dict:
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.specs,
                            is_leaf=lambda x: isinstance(x, P))

    def abstract_params(self) -> dict:
        """ShapeDtypeStructs with shardings (global shapes): for eval_shape and restore."""
        shapes = nnx.to_pure_dict(self.template)
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            shapes, self.shardings)

    def init(self, seed: int) -> dict:
        """fp32 parameters, drawn on the host from numpy's generator seeded with `seed` and
        placed into their shards. Host init is mesh-independent (same values at every TP
        size), works unchanged with several processes, and compiles nothing: XLA:CPU takes
        seconds to compile each threefry draw, which dominated small CPU runs."""
        host = nnx.to_pure_dict(nnx.state(GPT(self.cfg, np.random.default_rng(seed))))
        return jax.tree.map(lambda a, s: jax.make_array_from_callback(a.shape, s, a.__getitem__),
                            host, self.shardings)

    def bind(self, params: dict) -> GPT:
        """Rebuild the NNX module around `params` (global or, inside shard_map, local shards)."""
        state = jax.tree.map(lambda v: v, self.template)  # fresh Variables, same metadata
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(self.graphdef, state)

    def loss_fn(self) -> Callable:
        """(params, tokens, targets) -> mean loss over the global batch, as a shard_map."""

        def local_loss(params, tokens, targets):
            loss = self.bind(params).loss(tokens, targets)
            return jax.lax.pmean(loss, DATA)  # invariant over both axes

        return jax.shard_map(local_loss, mesh=self.mesh, in_specs=(self.specs, BATCH_SPEC,
                             BATCH_SPEC), out_specs=P(), check_vma=True)

    def logits_fn(self) -> Callable:
        """(params, tokens) -> logits (B, T, V) fp32, batch over "data", vocab over "tp"."""
        return jax.shard_map(lambda p, t: self.bind(p)(t), mesh=self.mesh,
                             in_specs=(self.specs, BATCH_SPEC), out_specs=P(DATA, None, TP),
                             check_vma=True)

    def loss_and_grad_fn(self) -> Callable:
        """(params, tokens, targets) -> (loss, grads); grads sharded like params."""

        def local(params, tokens, targets):
            def loss(p):
                return jax.lax.pmean(self.bind(p).loss(tokens, targets), DATA)
            return jax.value_and_grad(loss)(params)

        return jax.shard_map(local, mesh=self.mesh, in_specs=(self.specs, BATCH_SPEC, BATCH_SPEC),
                             out_specs=(P(), self.specs), check_vma=True)


def param_specs(template) -> dict:
    """Pure dict of PartitionSpec from each Variable's `pspec` metadata (default replicated)."""
    flat = {path: P(*var.get_metadata().get("pspec", ())) for path, var in
            nnx.to_flat_state(template)}
    return traversals.unflatten_mapping(flat)


def shard_gpt(cfg: GPTConfig, mesh: jax.sharding.Mesh) -> ShardedGPT:
    """Validate `cfg` against `mesh` and build the abstract model (no parameters allocated)."""
    if tuple(mesh.axis_names) != (DATA, TP):
        raise ValueError(f"mesh axes {mesh.axis_names} must be {(DATA, TP)}")
    cfg.validate(tp=mesh.shape[TP])
    model = nnx.eval_shape(lambda: GPT(cfg, nnx.Rngs(0)))
    graphdef, template = nnx.split(model)
    return ShardedGPT(cfg, mesh, graphdef, template, param_specs(template))


def check_batch(batch_size: int, seq_len: int, cfg: GPTConfig, mesh) -> None:
    data = mesh.shape[DATA]
    if batch_size <= 0 or batch_size % data:
        raise ValueError(f"train.batch_size={batch_size} must be a positive multiple of the "
                         f"data-parallel size data={data}")
    if seq_len > cfg.seq_len:
        raise ValueError(f"sequence length {seq_len} > model.seq_len={cfg.seq_len}")


def put_batch(array, mesh) -> jax.Array:
    """Host (B, T) array, identical on every process -> global array split over "data"."""
    sharding = NamedSharding(mesh, BATCH_SPEC)
    return jax.make_array_from_callback(array.shape, sharding, lambda idx: array[idx])


