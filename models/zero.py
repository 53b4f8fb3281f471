"""ZeRO-1 over the "data" axis: each data rank keeps the optimizer state of 1/data of the
parameters, with SDP4Bit-style quantized weight differences on the way back.

The parameters stay replicated over "data" (every rank runs the whole forward and backward
pass on its part of the batch). One train step (train/loop.py wires the optimizer in):

1. `grad_fn`: each rank's gradients (`ShardedGPT.local_grads`) are flattened into buckets
   and reduce-scattered over "data" with `taco_jax.psum_scatter(codec=codec_dp)`: rank r
   gets the summed gradient of segment r of every bucket (its *shard*), nothing else.
2. The optimizer (optax, outside the shard_map) updates the shards: the state it keeps
   (Adam's moments) has the shards' shapes, 1/data of the parameters' per device. Shards
   are global arrays split over "data" (and over the axes their parameters are split
   over), so a global-norm clip sums every element once: XLA all-reduces the shards'
   squared norms.
3. `gather_fn`: the updated shards go back to every rank with `taco_jax.all_gather`. With
   an exact `codec_wd` ("none") the new shard itself is gathered: the replicas equal the
   updated parameters bit for bit. With a lossy one, the rank sends the difference
   Δ = (updated master shard) − (the replica's current values of that shard), quantized,
   and every rank, its owner included, adds the decoded Δ to its replica: the replicas stay
   identical across ranks (everyone decodes the same bytes), and since the next Δ is taken
   against the replica, the replica's error is that of one quantized Δ; it does not
   accumulate. The exact fp32 master shard is then kept with the optimizer state.

Buckets: one flat vector per dtype, set of mesh axes the parameters are split over, and
weight-decay flag (so a bucket decays as a whole and optax's mask stays a per-bucket flag),
zero-padded to a multiple of data × `quantum` (a multiple of both codecs' block sizes: every
shard is whole blocks); the padding is never read back into a parameter.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import taco_jax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from models.gpt import DATA
from models.parallel import BATCH_SPEC, MESH_AXES, ShardedGPT

QUANTUM = 256  # shard lengths are multiples of this (and of the codecs' block sizes)


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Parameters flattened into one vector, in the order of `jax.tree.leaves(params)`."""

    name: str
    leaves: tuple[int, ...]  # indices into jax.tree.leaves(params)
    shapes: tuple[tuple[int, ...], ...]  # their local (per-device) shapes
    axes: tuple[str, ...]  # the mesh axes other than "data" they are split over
    decay: bool  # weight decay applies (the optimizer's mask)
    dtype: Any
    size: int  # elements of the parameters, per device
    padded: int  # size rounded up to a multiple of data × quantum
    data: int

    @property
    def shard(self) -> int:
        """Elements of one data rank's shard."""
        return self.padded // self.data

    @property
    def spec(self) -> P:
        return P(*self.axes, DATA)

    @property
    def local_shape(self) -> tuple[int, ...]:
        return (1,) * len(self.axes) + (self.shard,)

    def flat(self, leaves) -> jax.Array:
        """This bucket's parameters (or gradients), flattened and zero-padded."""
        flat = jnp.concatenate([leaves[i].reshape(-1) for i in self.leaves])
        return jnp.pad(flat, (0, self.padded - self.size)) if self.padded > self.size else flat

    def unflat(self, flat, out: list) -> None:
        start = 0
        for i, shape in zip(self.leaves, self.shapes):
            n = math.prod(shape)
            out[i] = flat[start:start + n].reshape(shape)
            start += n


def _local_shape(shape, spec: P, mesh) -> tuple[int, ...]:
    out = list(shape)
    for d, entry in enumerate(tuple(spec)):
        for a in (entry if isinstance(entry, tuple) else (entry,)):
            if a is not None:
                out[d] //= int(mesh.shape[a])
    return tuple(out)


def _axes(spec: P) -> tuple[str, ...]:
    named = {a for e in tuple(spec) for a in (e if isinstance(e, tuple) else (e,))}
    return tuple(a for a in MESH_AXES if a in named and a != DATA)


def layout(model: ShardedGPT, decay, quantum: int = QUANTUM) -> tuple[Bucket, ...]:
    """The buckets of `model`'s parameters on its mesh; decay: a pytree of bools like the
    parameters (the optimizer's weight-decay mask)."""
    shapes, tree = jax.tree.flatten(model.param_shapes())
    specs = tree.flatten_up_to(model.specs)
    decays = tree.flatten_up_to(decay)
    groups: dict = {}
    for i, (a, spec, dec) in enumerate(zip(shapes, specs, decays)):
        groups.setdefault((np.dtype(a.dtype).name, _axes(spec), bool(dec)), []).append(i)
    data, buckets = model.data, []
    for k, ((dtype, axes, dec), idx) in enumerate(groups.items()):
        local = tuple(_local_shape(shapes[i].shape, specs[i], model.mesh) for i in idx)
        size = sum(math.prod(s) for s in local)
        padded = -(-size // (data * quantum)) * data * quantum
        name = f"{k}:{dtype}{''.join('/' + a for a in axes)}{'/decay' if dec else ''}"
        buckets.append(Bucket(name, tuple(idx), local, axes, dec, np.dtype(dtype), size,
                              padded, data))
    return tuple(buckets)


@dataclasses.dataclass(frozen=True)
class Zero1:
    """ZeRO-1 for `model` (data > 1): the bucket layout and the step's two shard_maps."""

    model: ShardedGPT
    buckets: tuple[Bucket, ...]
    codec_dp: Any  # the gradients' reduce-scatter
    codec_wd: Any  # the weights' all-gather (of Δ when lossy)

    @classmethod
    def build(cls, model: ShardedGPT, decay, codec_dp, codec_wd) -> "Zero1":
        """codec_dp / codec_wd: codec names or codecs (resolved now)."""
        if model.data < 2:
            raise ValueError(f"ZeRO-1 shards over data={model.data}: needs data > 1")
        dp, wd = taco_jax.codecs.get(codec_dp), taco_jax.codecs.get(codec_wd)
        quantum = math.lcm(QUANTUM, dp.block_size, wd.block_size)
        return cls(model, layout(model, decay, quantum), dp, wd)

    @property
    def mesh(self):
        return self.model.mesh

    @property
    def master(self) -> bool:
        """Whether an exact master shard is kept (a lossy codec_wd)."""
        return not self.codec_wd.is_identity

    # -- shapes ---------------------------------------------------------------------------

    @property
    def specs(self) -> dict:
        return {b.name: b.spec for b in self.buckets}

    @property
    def shardings(self) -> dict:
        return {b.name: NamedSharding(self.mesh, b.spec) for b in self.buckets}

    def abstract_shards(self) -> dict:
        """ShapeDtypeStructs (global, with shardings) of one shard set: a bucket's global
        array is (*sizes of its axes, padded), split over them and over "data"."""
        return {b.name: jax.ShapeDtypeStruct(
            tuple(int(self.mesh.shape[a]) for a in b.axes) + (b.padded,), b.dtype,
            sharding=NamedSharding(self.mesh, b.spec)) for b in self.buckets}

    def decay_mask(self) -> dict:
        return {b.name: b.decay for b in self.buckets}

    # -- the shard_maps ---------------------------------------------------------------------

    def _own(self, flat, b: Bucket):
        """This data rank's segment of a bucket's flat vector."""
        return lax.dynamic_slice_in_dim(flat, lax.axis_index(DATA) * b.shard, b.shard)

    def _shards(self, params: dict) -> dict:
        leaves = jax.tree.leaves(params)
        return {b.name: self._own(b.flat(leaves), b).reshape(b.local_shape)
                for b in self.buckets}

    def shards_fn(self) -> Callable:
        """params -> this rank's shard of every bucket (no communication)."""
        return jax.shard_map(self._shards, mesh=self.mesh, in_specs=(self.model.specs,),
                             out_specs=self.specs, check_vma=self.model._check_vma)

    def grad_fn(self) -> Callable:
        """(params, tokens, targets) -> (loss, gradient shards, parameter shards): the
        gradients summed over "data" by a reduce-scatter per bucket (codec_dp), each rank
        keeping its segment; the parameter shards are the replica's own segments (the
        optimizer's parameters when no master is kept; {} otherwise)."""
        grads_of = self.model.local_grads()
        exact_dp = self.codec_dp.is_identity

        def local(params, tokens, targets):
            loss, grads = grads_of(params, tokens, targets)
            leaves = jax.tree.leaves(grads)
            out = {}
            for b in self.buckets:
                g = taco_jax.psum_scatter(b.flat(leaves), DATA, tiled=True, codec=self.codec_dp)
                if not exact_dp and b.padded > b.size:
                    # a lossy codec may decode the zero padding to nonzeros (a Hadamard
                    # spreads a block's values): keep it out of the norm and the moments
                    pos = lax.axis_index(DATA) * b.shard + jnp.arange(b.shard)
                    g = jnp.where(pos < b.size, g, jnp.zeros_like(g))
                out[b.name] = g.reshape(b.local_shape)
            return loss, out, ({} if self.master else self._shards(params))

        return jax.shard_map(local, mesh=self.mesh,
                             in_specs=(self.model.specs, BATCH_SPEC, BATCH_SPEC),
                             out_specs=(P(), self.specs, {} if self.master else self.specs),
                             check_vma=self.model._check_vma)

    def gather_fn(self) -> Callable:
        """(params, updated shards) -> (params, the replica's own segments afterwards, {}
        when no master is kept: they are the shards): every rank's replica updated from
        the all-gather of the shards (codec_wd exact) or of their differences to it
        (lossy); identical on every data rank."""
        vma = self.model._check_vma
        to = "invarying" if vma else "varying"

        def local(params, shards):
            leaves, tree = jax.tree.flatten(params)
            out, own = list(leaves), {}
            for b in self.buckets:
                mine = shards[b.name].reshape(-1)
                if self.master:
                    flat = b.flat(leaves)
                    delta = mine - self._own(flat, b)
                    flat = flat + taco_jax.all_gather(delta, DATA, tiled=True, to=to,
                                                      codec=self.codec_wd)
                    own[b.name] = self._own(flat, b).reshape(b.local_shape)
                else:
                    flat = taco_jax.all_gather(mine, DATA, tiled=True, to=to,
                                               codec=self.codec_wd)
                b.unflat(flat, out)
            return jax.tree.unflatten(tree, out), own

        return jax.shard_map(local, mesh=self.mesh, in_specs=(self.model.specs, self.specs),
                             out_specs=(self.model.specs, self.specs if self.master else {}),
                             check_vma=vma)
