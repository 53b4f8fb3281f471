"""Parallel plumbing for models/gpt.py: the ("data", "tp") mesh, parameter shardings, and the
loss/gradient of one global batch run as a single `jax.shard_map`.

Emulated tensor parallelism (`emulate_tp=N`): the mesh has only "data"; inside its
shard_map the N tensor-parallel shards of every split parameter are stacked and the same
per-device model code runs under `jax.vmap(axis_name="tp")`, the taco_jax collectives
following shard_map's check_vma convention (`taco_jax.config(vmap_check_vma=True)`), so an
emulated run compresses the same tensors at the same sites as a run on N devices.

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
import taco_jax
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


def make_emulation_mesh(data: int, devices=None) -> jax.sharding.Mesh:
    """A ("data",) mesh: tensor parallelism is emulated on each device (`emulate_tp`)."""
    devices = list(jax.devices() if devices is None else devices)
    if data > len(devices):
        raise ValueError(f"mesh data={data} needs {data} devices but only {len(devices)} "
                         f"{devices[0].platform} devices are available")
    return jax.make_mesh((data,), (DATA,), axis_types=(AxisType.Explicit,),
                         devices=devices[:data])


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
    emulate_tp: int = 0  # > 0: TP of this size emulated under jax.vmap on each device
    tp_specs: dict | None = None  # emulation: the specs a real TP mesh would use

    @property
    def tp(self) -> int:
        """The tensor-parallel degree, real or emulated."""
        return self.emulate_tp or int(self.mesh.shape[TP])

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

    def _members(self, params):
        """Emulation: each TP-split parameter as (N, *local shard); in_axes for vmap."""
        n = self.emulate_tp

        def split(x, spec):
            dims = [i for i, a in enumerate(tuple(spec)) if a == TP]
            if not dims:
                return x, None
            k = dims[0]
            x = x.reshape(*x.shape[:k], n, x.shape[k] // n, *x.shape[k + 1:])
            return jax.numpy.moveaxis(x, k, 0), 0
        pairs = jax.tree.map(split, params, self.tp_specs, is_leaf=lambda v: isinstance(v, P))
        is_pair = lambda v: isinstance(v, tuple)  # noqa: E731
        return (jax.tree.map(lambda t: t[0], pairs, is_leaf=is_pair),
                jax.tree.map(lambda t: t[1], pairs, is_leaf=is_pair))

    def _local(self, fn: Callable) -> Callable:
        """fn(params, *args) on this device's shards: directly, or for every emulated TP
        member under jax.vmap, returning member 0's result (the outputs used here are
        replicated over "tp")."""
        if not self.emulate_tp:
            return fn

        def emulated(params, *args):
            stacked, axes = self._members(params)
            with taco_jax.config(vmap_check_vma=True):
                out = jax.vmap(fn, in_axes=(axes, *([None] * len(args))), axis_name=TP)(
                    stacked, *args)
            return jax.tree.map(lambda v: v[0], out)
        return emulated

    @property
    def _check_vma(self) -> bool:
        # Collectives over a vmap axis fail inside a shard_map with check_vma=True (jax
        # 0.11: its psum rule asks for the vmap axis among the mesh's), so the emulation's
        # shard_map over "data" runs without it and reduces the gradients explicitly.
        return not self.emulate_tp

    def loss_fn(self) -> Callable:
        """(params, tokens, targets) -> mean loss over the global batch, as a shard_map."""
        member = self._local(lambda p, t, y: self.bind(p).loss(t, y))

        def local_loss(params, tokens, targets):
            return jax.lax.pmean(member(params, tokens, targets), DATA)  # invariant

        return jax.shard_map(local_loss, mesh=self.mesh, in_specs=(self.specs, BATCH_SPEC,
                             BATCH_SPEC), out_specs=P(), check_vma=self._check_vma)

    def logits_fn(self) -> Callable:
        """(params, tokens) -> logits (B, T, V) fp32, batch over "data", vocab over "tp"."""
        if self.emulate_tp:
            def all_logits(params, tokens):
                stacked, axes = self._members(params)
                with taco_jax.config(vmap_check_vma=True):
                    out = jax.vmap(lambda p, t: self.bind(p)(t), in_axes=(axes, None),
                                   axis_name=TP)(stacked, tokens)      # (N, B, T, V/N)
                return jax.numpy.concatenate(list(out), axis=-1)
            return jax.shard_map(all_logits, mesh=self.mesh, in_specs=(self.specs, BATCH_SPEC),
                                 out_specs=P(DATA, None, None), check_vma=False)
        return jax.shard_map(lambda p, t: self.bind(p)(t), mesh=self.mesh,
                             in_specs=(self.specs, BATCH_SPEC), out_specs=P(DATA, None, TP),
                             check_vma=True)

    def loss_and_grad_fn(self) -> Callable:
        """(params, tokens, targets) -> (loss, grads); grads sharded like params."""
        member = self._local(lambda p, t, y: self.bind(p).loss(t, y))

        def local(params, tokens, targets):
            if self.emulate_tp:     # this device's gradients, averaged over "data" by hand
                loss, grads = jax.value_and_grad(lambda p: member(p, tokens, targets))(params)
                return jax.lax.pmean((loss, grads), DATA)

            def loss(p):
                return jax.lax.pmean(member(p, tokens, targets), DATA)
            return jax.value_and_grad(loss)(params)

        return jax.shard_map(local, mesh=self.mesh, in_specs=(self.specs, BATCH_SPEC, BATCH_SPEC),
                             out_specs=(P(), self.specs), check_vma=self._check_vma)


def param_specs(template) -> dict:
    """Pure dict of PartitionSpec from each Variable's `pspec` metadata (default replicated)."""
    flat = {path: P(*var.get_metadata().get("pspec", ())) for path, var in
            nnx.to_flat_state(template)}
    return traversals.unflatten_mapping(flat)


def shard_gpt(cfg: GPTConfig, mesh: jax.sharding.Mesh, emulate_tp: int = 0) -> ShardedGPT:
    """Validate `cfg` against `mesh` and build the abstract model (no parameters allocated).
    emulate_tp > 0: `mesh` is a ("data",) mesh and TP of that size is emulated."""
    want = (DATA,) if emulate_tp else (DATA, TP)
    if tuple(mesh.axis_names) != want:
        raise ValueError(f"mesh axes {mesh.axis_names} must be {want}"
                         + (f" with emulate_tp={emulate_tp}" if emulate_tp else ""))
    if emulate_tp < 0:
        raise ValueError(f"emulate_tp={emulate_tp} must be >= 0")
    if emulate_tp and cfg.feedback:
        raise ValueError("model.feedback=True is not supported with emulated tensor "
                         "parallelism (parallel.emulate_tp); run it on a TP mesh")
    cfg.validate(tp=emulate_tp or mesh.shape[TP])
    model = nnx.eval_shape(lambda: GPT(cfg, nnx.Rngs(0)))
    graphdef, template = nnx.split(model)
    specs = param_specs(template)
    if not emulate_tp:
        return ShardedGPT(cfg, mesh, graphdef, template, specs)
    replicated = jax.tree.map(lambda s: P(*[None if a == TP else a for a in s]), specs,
                              is_leaf=lambda v: isinstance(v, P))
    return ShardedGPT(cfg, mesh, graphdef, template, replicated, emulate_tp, specs)


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


