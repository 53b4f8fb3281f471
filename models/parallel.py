"""Parallel plumbing for models/gpt.py: the ("data", "pipe", "tp") mesh, parameter shardings,
and the loss/gradient of one global batch run as a single `jax.shard_map`.

Parameters live as *global* fp32 arrays (a plain nested dict, `nnx.to_pure_dict` of the model
state) sharded with `NamedSharding(mesh, pspec)`; inside the shard_map each device sees its
local shards and rebuilds the NNX module around them. With `check_vma=True` JAX tracks which
values vary over which mesh axis, and the gradient of a parameter that is invariant over an
axis comes out summed over that axis: that is how the replicated parameters' gradients are
summed over "tp".

Data parallelism reduces its gradients explicitly: the parameters are made varying over
"data" *before* differentiation (`lax.pcast`), so each data shard gets its own gradients,
which `ShardedGPT.dp_reduce` sums with `taco_jax.psum(grads, "data", codec=codec_dp)` (the
two-shot all-reduce: compressed reduce-scatter, then all-gather); codec "none" is the plain
lax.psum the implicit reduction was.

Pipeline parallelism (`pipe > 1`, `PipelinedGPT`): the blocks' parameters are stacked along
a leading layer axis split over "pipe" (stage s holds blocks [s·L/S, (s+1)·L/S)), and the
per-shard batch runs as `microbatches` micro-batches through `models.pipeline.gpipe`, the
stage hand-offs going through `taco_jax.ppermute(codec=codec_pp)`. Embeddings, final LN and
LM head are replicated over "pipe": every stage embeds (only stage 0's enters the pipeline)
and runs the head on the pipeline's output (real on the last stage, zeros elsewhere, masked
out of the loss): the other stages would idle meanwhile anyway. Their gradients, nonzero on
one stage only, are summed over "pipe" with an exact lax.psum.

Emulated tensor parallelism (`emulate_tp=N`): the mesh has only "data"; inside its
shard_map the N tensor-parallel shards of every split parameter are stacked and the same
per-device model code runs under `jax.vmap(axis_name="tp")`, the taco_jax collectives
following shard_map's check_vma convention (`taco_jax.config(vmap_check_vma=True)`), so an
emulated run compresses the same tensors at the same sites as a run on N devices.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import taco_jax
from flax import nnx
from flax.nnx import traversals
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from models import arch, pipeline
from models.gpt import DATA, GPT, PIPE, TP, Block, GPTConfig, vocab_parallel_xent

BATCH_SPEC = P(DATA, None)  # tokens (B, T): batch split over "data", replicated elsewhere
MESH_AXES = (DATA, PIPE, TP)


def mesh_shape(n_devices: int, tp: int = 0, data: int = 0, pipe: int = 1
               ) -> tuple[int, int, int]:
    """(data, pipe, tp) for `n_devices`; tp=0 or data=0 means "the devices the others leave"
    (tp=0: all of them go to TP)."""
    if tp < 0 or data < 0:
        raise ValueError(f"parallel.tp={tp} and parallel.data={data} must be >= 0 (0 = auto)")
    if pipe < 1:
        raise ValueError(f"parallel.pipe={pipe} must be >= 1")
    need = max(tp, 1) * max(data, 1) * pipe
    if tp == 0:
        tp = n_devices // ((data or 1) * pipe)
    if data == 0:
        data = n_devices // (tp * pipe) if tp else 0
    if tp == 0 or data == 0 or data * pipe * tp > n_devices:
        raise ValueError(f"mesh data={data or 'auto'} x pipe={pipe} x tp={tp or 'auto'} needs "
                         f"{max(need, data * pipe * tp)} devices but only {n_devices} are "
                         f"available")
    return data, pipe, tp


def make_emulation_mesh(data: int, devices=None) -> jax.sharding.Mesh:
    """A ("data",) mesh: tensor parallelism is emulated on each device (`emulate_tp`)."""
    devices = list(jax.devices() if devices is None else devices)
    if data > len(devices):
        raise ValueError(f"mesh data={data} needs {data} devices but only {len(devices)} "
                         f"{devices[0].platform} devices are available")
    return jax.make_mesh((data,), (DATA,), axis_types=(AxisType.Explicit,),
                         devices=devices[:data])


def make_mesh(data: int, tp: int, devices=None, *, pipe: int = 1) -> jax.sharding.Mesh:
    """A ("data", "pipe", "tp") mesh on the first data*pipe*tp devices: TP neighbours
    adjacent (the most traffic), pipeline stages next, data-parallel replicas outermost."""
    devices = list(jax.devices() if devices is None else devices)
    n = data * pipe * tp
    if n > len(devices):
        raise ValueError(f"mesh data={data} x pipe={pipe} x tp={tp} needs {n} devices but "
                         f"only {len(devices)} {devices[0].platform} devices are available")
    return jax.make_mesh((data, pipe, tp), MESH_AXES, axis_types=(AxisType.Explicit,) * 3,
                         devices=devices[:n])


def _vary(tree, axes):
    """Every leaf made varying over `axes` (pipeline.vary per leaf)."""
    return jax.tree.map(lambda v: pipeline.vary(v, axes), tree)


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
    # codec of the data-parallel gradient all-reduce; None = the taco_jax recipe's codec
    codec_dp: Any = None
    codec_pp: Any = None  # codec of the pipeline stage hand-offs (PipelinedGPT)
    microbatches: int = 1  # micro-batches per data shard (PipelinedGPT)
    schedule: str = "gpipe"  # PipelinedGPT's schedule: "gpipe" or "1f1b" (models/pipeline.py)

    @property
    def tp(self) -> int:
        """The tensor-parallel degree, real or emulated."""
        return self.emulate_tp or int(self.mesh.shape[TP])

    @property
    def data(self) -> int:
        return int(self.mesh.shape[DATA])

    @property
    def pipe(self) -> int:
        return int(dict(self.mesh.shape).get(PIPE, 1))

    @property
    def bubble_fraction(self) -> float:
        return pipeline.bubble_fraction(self.pipe, self.microbatches)

    @property
    def shardings(self) -> dict:
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.specs,
                            is_leaf=lambda x: isinstance(x, P))

    def param_shapes(self) -> dict:
        """Pure dict of ShapeDtypeStructs (global shapes, no shardings)."""
        return nnx.to_pure_dict(self.template)

    def abstract_params(self) -> dict:
        """ShapeDtypeStructs with shardings (global shapes): for eval_shape and restore."""
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            self.param_shapes(), self.shardings)

    def host_params(self, seed: int) -> dict:
        """The fp32 parameters as numpy arrays, in this model's layout."""
        model = arch.decoder(self.cfg)(self.cfg, np.random.default_rng(seed))
        return nnx.to_pure_dict(nnx.state(model))

    def init(self, seed: int) -> dict:
        """fp32 parameters, drawn on the host from numpy's generator seeded with `seed` and
        placed into their shards. Host init is mesh-independent (same values at every TP
        size and pipeline depth), works unchanged with several processes, and compiles
        nothing: XLA:CPU takes seconds to compile each threefry draw, which dominated small
        CPU runs."""
        return jax.tree.map(lambda a, s: jax.make_array_from_callback(a.shape, s, a.__getitem__),
                            self.host_params(seed), self.shardings)

    def bind(self, params: dict) -> GPT:
        """Rebuild the NNX module around `params` (global or, inside shard_map, local shards)."""
        state = jax.tree.map(lambda v: v, self.template)  # fresh Variables, same metadata
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(self.graphdef, state)

    def dp_reduce(self, grads):
        """Per-data-shard gradients -> their sum over "data", identical on every replica:
        `taco_jax.psum`'s two-shot all-reduce (compressed reduce-scatter, all-gather) with
        `codec_dp` (the recipe's min_bytes leaves a small one to lax.psum).

        The leaves go as buckets, one flat vector per dtype and set of axes they vary over
        (the TP-split ones and the replicated ones; the stacked stage blocks): a few large
        all-reduces instead of one per parameter, cheaper to launch and past the size
        threshold sooner; the price is that a bucket waits for all its gradients. With
        codec "none" the sums are those of lax.psum per leaf, bit for bit.

        The one place the data-parallel reduction happens: a data axis that spans hosts
        would be split in two mesh axes and reduced with
        `taco_jax.psum_two_level(bucket, inner, outer, ...)` here instead. Without data
        parallelism (data=1) there is nothing to reduce, and no site."""
        if self.data == 1:
            return grads
        leaves, tree = jax.tree.flatten(grads)
        buckets: dict = {}
        for i, g in enumerate(leaves):
            buckets.setdefault((g.dtype, pipeline.vma(g)), []).append(i)
        out = list(leaves)
        for idx in buckets.values():
            flat = jnp.concatenate([leaves[i].reshape(-1) for i in idx])
            total = taco_jax.psum(flat, DATA, codec=self.codec_dp)
            start = 0
            for i in idx:
                out[i] = total[start:start + leaves[i].size].reshape(leaves[i].shape)
                start += leaves[i].size
        return jax.tree.unflatten(tree, out)

    @property
    def _dp_axes(self) -> tuple:
        """The axes the parameters vary over before differentiation (see dp_reduce)."""
        return (DATA,) if self.data > 1 else ()

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
        # shard_map over "data" runs without it (its reductions are explicit anyway).
        return not self.emulate_tp

    def _shard_loss(self) -> Callable:
        """(params, tokens, targets) -> this data shard's mean loss, inside the shard_map."""
        return self._local(lambda p, t, y: self.bind(p).loss(t, y))

    def loss_fn(self) -> Callable:
        """(params, tokens, targets) -> mean loss over the global batch, as a shard_map."""
        member = self._shard_loss()

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

    def local_grads(self) -> Callable:
        """(params, tokens, targets) -> (mean loss over the global batch, this data shard's
        gradients of its share of it), inside the shard_map: the gradients before the
        data-parallel reduction (`dp_reduce`, or ZeRO-1's reduce-scatter, models/zero.py),
        each varying over "data" and over the axes its parameter is split over."""
        member = self._shard_loss()
        n = self.data

        def local(params, tokens, targets):
            if self._check_vma:   # varying over "data": no implicit all-reduce of the grads
                params = _vary(params, self._dp_axes)
            loss, grads = jax.value_and_grad(lambda p: member(p, tokens, targets) / n)(params)
            return jax.lax.psum(loss, DATA), grads
        return local

    def loss_and_grad_fn(self) -> Callable:
        """(params, tokens, targets) -> (loss, grads); grads sharded like params. Each data
        shard differentiates its own share of the mean loss; `dp_reduce` sums them."""
        grads_of = self.local_grads()

        def local(params, tokens, targets):
            loss, grads = grads_of(params, tokens, targets)
            return loss, self.dp_reduce(grads)

        return jax.shard_map(local, mesh=self.mesh, in_specs=(self.specs, BATCH_SPEC, BATCH_SPEC),
                             out_specs=(P(), self.specs), check_vma=self._check_vma)


@dataclasses.dataclass(frozen=True)
class PipelinedGPT(ShardedGPT):
    """`GPT` with its blocks pipelined over "pipe" (GPipe, models/pipeline.py). Parameters:
    {"wte", "wpe", "ln_f", "lm_head", "blocks"}, "blocks" holding every block parameter
    stacked along a leading layer axis (n_layer, ...) split over "pipe"."""

    block_graphdef: Any = None  # nnx GraphDef of one Block
    block_template: Any = None  # its abstract nnx.State

    @property
    def layers_per_stage(self) -> int:
        return self.cfg.n_layer // self.pipe

    def param_shapes(self) -> dict:
        shapes = nnx.to_pure_dict(self.template)
        shapes["blocks"] = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct((self.cfg.n_layer, *a.shape), a.dtype),
            nnx.to_pure_dict(self.block_template))
        return shapes

    def host_params(self, seed: int) -> dict:
        # the same draws as the unpipelined GPT's, blocks stacked afterwards
        return stack_blocks(super().host_params(seed), self.cfg.n_layer)

    def bind(self, params: dict) -> GPT:
        """The embeddings-and-head module around `params` (its "blocks" are not used)."""
        return super().bind({k: v for k, v in params.items() if k != "blocks"})

    def bind_block(self, params: dict) -> Block:
        state = jax.tree.map(lambda v: v, self.block_template)
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(self.block_graphdef, state)

    def _stage(self, blocks, x):
        """This stage's blocks, in order, on the stream x (mb, T, d)."""
        for j in range(self.layers_per_stage):
            x = self.bind_block(jax.tree.map(lambda a, j=j: a[j], blocks))(x)
        return x

    def _outputs(self, params, tokens):
        """-> (ends module, the pipeline's output stream (B, T, d): real on the last stage,
        zeros on the others)."""
        ends = self.bind(params)
        b = tokens.shape[0]
        m = self.microbatches
        if b % m:
            raise ValueError(f"{b} sequences per data shard cannot be split into "
                             f"parallel.microbatches={m} micro-batches")
        x = ends.embed(tokens)          # (b, t, d); (b, t/tp, d) with sequence parallelism
        y = pipeline.gpipe(self._stage, params["blocks"], x.reshape(m, b // m, *x.shape[1:]),
                           axis=PIPE, codec=self.codec_pp)
        return ends, y.reshape(x.shape)

    def _is_last(self):
        return lax.axis_index(PIPE) == self.pipe - 1

    def _shard_loss(self) -> Callable:
        """This data shard's mean loss on the last stage, 0 on the others."""
        def loss(params, tokens, targets):
            ends, y = self._outputs(params, tokens)
            xent = vocab_parallel_xent(ends.head(y), targets).mean()
            return jnp.where(self._is_last(), xent, 0.0)
        return loss

    def loss_fn(self) -> Callable:
        member = self._shard_loss()

        def local_loss(params, tokens, targets):
            params = _vary(params, (PIPE,))
            return lax.pmean(lax.psum(member(params, tokens, targets), PIPE), DATA)

        return jax.shard_map(local_loss, mesh=self.mesh, in_specs=(self.specs, BATCH_SPEC,
                             BATCH_SPEC), out_specs=P(), check_vma=True)

    def logits_fn(self) -> Callable:
        def local(params, tokens):
            ends, y = self._outputs(_vary(params, (PIPE,)), tokens)
            logits = ends.head(y)
            return lax.psum(jnp.where(self._is_last(), logits, 0.0), PIPE)
        return jax.shard_map(local, mesh=self.mesh, in_specs=(self.specs, BATCH_SPEC),
                             out_specs=P(DATA, None, TP), check_vma=True)

    def local_grads(self) -> Callable:
        """Every parameter varying over "data" and "pipe" before differentiation: each
        stage gets the gradients of what it ran. Those of the replicated embeddings and
        head (nonzero on one stage) are summed over "pipe" exactly; the sum over "data"
        is left to the caller (`dp_reduce` in `loss_and_grad_fn`). GPipe: autodiff of
        the forward schedule; 1F1B: `pipeline.one_f_one_b`, which computes the gradients
        itself, micro-batch by micro-batch."""
        if self.schedule == "1f1b":
            return self._local_grads_1f1b()
        member = self._shard_loss()
        n = self.data

        def local(params, tokens, targets):
            params = _vary(params, (*self._dp_axes, PIPE))
            loss, grads = jax.value_and_grad(lambda p: member(p, tokens, targets) / n)(params)
            grads = {k: (g if k == "blocks" else lax.psum(g, PIPE)) for k, g in grads.items()}
            return lax.psum(loss, (DATA, PIPE)), grads
        return local

    def _local_grads_1f1b(self) -> Callable:
        """The loss (mean over the shard's tokens, / data) and its gradients with the 1F1B
        schedule: embeddings differentiated around it (stage 0's micro-batch cotangents),
        blocks inside it, the LM head and loss on the last stage inside it."""
        n, m = self.data, self.microbatches

        def head_loss(ends_params, y, targets):
            return vocab_parallel_xent(self.bind(ends_params).head(y), targets).mean()

        def local(params, tokens, targets):
            params = _vary(params, (*self._dp_axes, PIPE))
            ends = {k: v for k, v in params.items() if k != "blocks"}
            b = tokens.shape[0]
            if b % m:
                raise ValueError(f"{b} sequences per data shard cannot be split into "
                                 f"parallel.microbatches={m} micro-batches")
            x, embed_pull = jax.vjp(lambda p: self.bind(p).embed(tokens), ends)
            loss, g_blocks, g_head, dxs = pipeline.one_f_one_b(
                self._stage, params["blocks"], x.reshape(m, b // m, *x.shape[1:]), head_loss,
                ends, targets.reshape(m, b // m, *targets.shape[1:]), axis=PIPE,
                codec=self.codec_pp, scale=1.0 / (m * n))
            (g_embed,) = embed_pull(dxs.reshape(x.shape).astype(x.dtype))
            grads = jax.tree.map(lambda a, c: lax.psum(a + c, PIPE), g_head, g_embed)
            grads["blocks"] = g_blocks
            return lax.psum(loss, (DATA, PIPE)), grads
        return local


def stack_blocks(params: dict, n_layer: int) -> dict:
    """Unpipelined layout {"blocks": {0: ..., 1: ...}, ...} -> the pipelined one (every
    block parameter stacked along a leading layer axis). numpy or jax arrays."""
    blocks = [params["blocks"][i] for i in range(n_layer)]
    stack = np.stack if isinstance(jax.tree.leaves(blocks[0])[0], np.ndarray) else jnp.stack
    return {**params, "blocks": jax.tree.map(lambda *xs: stack(xs), *blocks)}


def unstack_blocks(params: dict) -> dict:
    """The inverse of `stack_blocks`."""
    n = jax.tree.leaves(params["blocks"])[0].shape[0]
    return {**params, "blocks": {i: jax.tree.map(lambda a, i=i: a[i], params["blocks"])
                                 for i in range(n)}}


def param_specs(template, tp: int = 1) -> dict:
    """Pure dict of PartitionSpec from each Variable's `pspec` metadata (default replicated).
    A Variable whose `tp_heads` metadata is smaller than `tp` (grouped-query attention's KV
    heads, fewer than the TP ranks: models/qwen.py) is replicated instead."""
    def spec(var):
        meta = var.get_metadata()
        return P() if meta.get("tp_heads", tp) < tp else P(*meta.get("pspec", ()))
    return traversals.unflatten_mapping({path: spec(var)
                                         for path, var in nnx.to_flat_state(template)})


def _is_spec(v) -> bool:
    return isinstance(v, P)


def shard_gpt(cfg: GPTConfig, mesh: jax.sharding.Mesh, emulate_tp: int = 0, *,
              microbatches: int = 1, codec_dp=None, codec_pp=None,
              schedule: str = "gpipe") -> ShardedGPT:
    """Validate `cfg` against `mesh` and build the abstract model (no parameters allocated).

    mesh: ("data", "pipe", "tp") (`make_mesh`; ("data", "tp") is accepted too), or with
    emulate_tp > 0 a ("data",) mesh on which TP of that size is emulated. A "pipe" axis of
    size > 1 pipelines the blocks over `microbatches` micro-batches per data shard, with
    the `schedule` "gpipe" or "1f1b" (models/pipeline.py). codec_dp / codec_pp: codecs of the data-parallel gradient all-reduce and of the
    stage hand-offs (None: the taco_jax recipe's codec where traced)."""
    names = tuple(mesh.axis_names)
    want = ((DATA,),) if emulate_tp else ((DATA, PIPE, TP), (DATA, TP))
    if names not in want:
        raise ValueError(f"mesh axes {names} must be {' or '.join(map(str, want))}"
                         + (f" with emulate_tp={emulate_tp}" if emulate_tp else ""))
    if emulate_tp < 0:
        raise ValueError(f"emulate_tp={emulate_tp} must be >= 0")
    pipe = int(dict(mesh.shape).get(PIPE, 1))
    check_pipeline(cfg, pipe, microbatches)
    cfg.validate(tp=emulate_tp or mesh.shape[TP])
    if schedule not in pipeline.SCHEDULES:
        raise ValueError(f"schedule={schedule!r} must be one of {pipeline.SCHEDULES}")
    kw = {"codec_dp": codec_dp, "codec_pp": codec_pp, "microbatches": microbatches,
          "schedule": schedule}
    tp, decoder = emulate_tp or mesh.shape[TP], arch.decoder(cfg)
    if pipe > 1:
        graphdef, template = nnx.split(nnx.eval_shape(lambda: decoder(cfg, nnx.Rngs(0),
                                                                      layers=0)))
        block_graphdef, block_template = nnx.split(nnx.eval_shape(
            lambda: arch.block(cfg)(cfg, nnx.Rngs(0))))
        specs = param_specs(template, tp)
        specs["blocks"] = jax.tree.map(lambda s: P(PIPE, *s), param_specs(block_template, tp),
                                       is_leaf=_is_spec)
        return PipelinedGPT(cfg, mesh, graphdef, template, specs, **kw,
                            block_graphdef=block_graphdef, block_template=block_template)
    graphdef, template = nnx.split(nnx.eval_shape(lambda: decoder(cfg, nnx.Rngs(0))))
    specs = param_specs(template, tp)
    if not emulate_tp:
        return ShardedGPT(cfg, mesh, graphdef, template, specs, **kw)
    replicated = jax.tree.map(lambda s: P(*[None if a == TP else a for a in s]), specs,
                              is_leaf=_is_spec)
    return ShardedGPT(cfg, mesh, graphdef, template, replicated, emulate_tp, specs, **kw)


def check_pipeline(cfg: GPTConfig, pipe: int, microbatches: int,
                   emulate_tp: int = 0) -> None:
    """Raise ValueError naming the values if the blocks cannot be pipelined so."""
    if pipe < 1:
        raise ValueError(f"parallel.pipe={pipe} must be >= 1")
    if microbatches < 1:
        raise ValueError(f"parallel.microbatches={microbatches} must be >= 1")
    if pipe == 1 and microbatches > 1:
        raise ValueError(f"parallel.microbatches={microbatches} splits the batch for the "
                         f"pipeline, but parallel.pipe=1 (set parallel.pipe > 1, or "
                         f"parallel.microbatches=1)")
    if cfg.n_layer % pipe:
        raise ValueError(f"model.n_layer={cfg.n_layer} is not divisible by parallel.pipe="
                         f"{pipe}: every pipeline stage holds n_layer/pipe blocks")
    if pipe > 1 and emulate_tp:
        raise ValueError(f"parallel.emulate_tp={emulate_tp} emulates TP on a data-only "
                         f"mesh; it cannot be combined with parallel.pipe={pipe}")
    if pipe > 1 and cfg.feedback:
        raise ValueError(f"model.feedback=True is not supported with parallel.pipe={pipe}: "
                         f"the feedback state does not cross pipeline stages")


def check_batch(batch_size: int, seq_len: int, cfg: GPTConfig, mesh,
                microbatches: int = 1) -> None:
    data = mesh.shape[DATA]
    if batch_size <= 0 or batch_size % data:
        raise ValueError(f"train.batch_size={batch_size} must be a positive multiple of the "
                         f"data-parallel size data={data}")
    if (batch_size // data) % microbatches:
        raise ValueError(f"train.batch_size={batch_size} gives {batch_size // data} sequences "
                         f"per data shard (data={data}), which parallel.microbatches="
                         f"{microbatches} does not divide")
    if seq_len > cfg.seq_len:
        raise ValueError(f"sequence length {seq_len} > model.seq_len={cfg.seq_len}")


def put_batch(array, mesh) -> jax.Array:
    """Host (B, T) array, identical on every process -> global array split over "data"."""
    sharding = NamedSharding(mesh, BATCH_SPEC)
    return jax.make_array_from_callback(array.shape, sharding, lambda idx: array[idx])
