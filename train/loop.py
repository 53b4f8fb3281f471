"""The training program: jitted train step on a ("data", "pipe", "tp") mesh, and the loop
around it.

    from train import run, load_config
    summary = run(load_config("tiny", ["train.steps=20", "codec=none"]))

For benchmarks, `make_train_step(cfg, mesh) -> (init_state_fn, step_fn)` gives the jitted step
without the loop (see docs/training.md).

Every jitted function is traced under the run's `taco_jax.config` recipe (`cfg.recipe`), so
the model's sites that leave their codec or threshold unset take the recipe's.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import signal
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from models import parallel, zero as zero_lib
from models.parallel import ShardedGPT
from taco_jax import telemetry
from train import config as config_lib
from train.checkpoint import Checkpointer, saved_steps
from train.config import Config
from train.data import load_corpus, split_batches
from train.errors import RunChanged, RunDirInUse
from train.metrics import MetricsWriter, plot_runs
from train.multihost import agree_any
from train.rundir import RunDirLock

State = dict  # {"step", "params", "opt_state", "rng"}: one pytree, checkpointed


# ---------------------------------------------------------------------------------------------
# Devices and mesh

def setup_backend(cfg: Config) -> None:
    """Ask for `parallel.cpu_devices` simulated CPU devices. Must run before JAX starts its
    backends; afterwards (tests, notebooks) the devices already there are kept."""
    try:
        jax.config.update("jax_num_cpu_devices", max(cfg.parallel.cpu_devices, 1))
    except RuntimeError:
        pass


def build_mesh(cfg: Config, devices=None) -> jax.sharding.Mesh:
    """The ("data", "pipe", "tp") mesh `cfg.parallel` asks for, on the default backend's
    devices (with parallel.emulate_tp: a ("data",) mesh, tensor parallelism emulated per
    device)."""
    devices = list(jax.devices() if devices is None else devices)
    pa = cfg.parallel
    if pa.emulate_tp:
        return parallel.make_emulation_mesh(pa.data or len(devices), devices)
    data, pipe, tp = parallel.mesh_shape(len(devices), pa.tp, pa.data, pa.pipe)
    return parallel.make_mesh(data, tp, devices, pipe=pipe)


# ---------------------------------------------------------------------------------------------
# Optimizer and the jitted step

def decay_mask(params):
    """Weight decay on matrices and embeddings; not on biases or LayerNorm."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: str(path[-1].key).endswith("kernel")
        or str(path[-1].key) in ("wte", "wpe", "lm_head"), params)


def make_optimizer(cfg: Config, mask: Any = decay_mask
                   ) -> tuple[optax.GradientTransformation, Callable]:
    """-> (AdamW after the global-norm clip, the LR schedule). mask: the weight-decay mask
    (a pytree of bools like the updated tree, or a function of it; ZeRO-1 passes one flag
    per bucket)."""
    o, steps = cfg.optim, cfg.train.steps
    warmup = min(o.warmup_steps, steps - 1)  # short (smoke) runs keep a decay phase
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=o.lr, warmup_steps=warmup, decay_steps=steps,
        end_value=o.min_lr)
    adamw = optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                        mask=mask)
    tx = optax.chain(optax.clip_by_global_norm(o.grad_clip), adamw) if o.grad_clip else adamw
    return tx, schedule


@dataclasses.dataclass(frozen=True)
class Program:
    """Everything jitted for one (config, mesh)."""

    cfg: Config
    mesh: jax.sharding.Mesh
    model: ShardedGPT
    init: Callable[[int], State]  # seed -> fresh state, sharded on the mesh
    step: Callable[[State, jax.Array, jax.Array], tuple[State, dict]]  # donates the state
    eval_loss: Callable[[dict, jax.Array, jax.Array], jax.Array]  # params, x, y -> loss
    state_shardings: Any  # NamedShardings, same structure as the state

    tx: optax.GradientTransformation
    # ZeRO-1 (parallel.zero=1 with data > 1): the optimizer state is that of the parameters'
    # shards, {"tx": optax state, "master": shards (a lossy recipe.codec_wd only)}
    zero: zero_lib.Zero1 | None = None

    def abstract_state(self) -> State:
        """ShapeDtypeStructs (with shardings) of the state, without allocating it."""
        params = self.model.abstract_params()
        if self.zero is None:
            opt = jax.eval_shape(self.tx.init, params)
        else:
            shards = self.zero.abstract_shards()
            opt = {"tx": jax.eval_shape(self.tx.init, shards),
                   **({"master": shards} if self.zero.master else {})}
        state = {"step": jax.ShapeDtypeStruct((), np.int32), "params": params,
                 "opt_state": opt, "rng": jax.ShapeDtypeStruct((2,), np.uint32)}
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            state, self.state_shardings)

    @property
    def optimizer_layout(self) -> dict:
        """How the optimizer state is laid out (checkpoint metadata: a run resumes only
        from checkpoints of the same layout)."""
        if self.zero is None:
            return {"zero": 0}
        return {"zero": 1, "data": self.model.data, "master": self.zero.master}

    def put_batch(self, x: np.ndarray) -> jax.Array:
        return parallel.put_batch(x, self.mesh)


def under_recipe(cfg: Config, fn: Callable) -> Callable:
    """fn entering `cfg.recipe`'s taco_jax.config around its body: jitted, the recipe is in
    effect wherever and whenever jax traces it."""
    @functools.wraps(fn)
    def traced(*args):
        with cfg.recipe.context():
            return fn(*args)
    return traced


def build(cfg: Config, mesh: jax.sharding.Mesh) -> Program:
    """Validate `cfg` on `mesh` and build the jitted init / train step / eval loss.
    Raises ValueError before anything compiles if the config does not fit the mesh."""
    cfg.validate()
    model = parallel.shard_gpt(cfg.model, mesh, emulate_tp=cfg.parallel.emulate_tp,
                               microbatches=cfg.parallel.microbatches,
                               schedule=cfg.parallel.schedule,
                               codec_dp=cfg.recipe.dp_codec, codec_pp=cfg.recipe.pp_codec)
    parallel.check_batch(cfg.train.batch_size, cfg.model.seq_len, cfg.model, mesh,
                         cfg.parallel.microbatches)
    zero = None
    if cfg.parallel.zero and model.data > 1:  # with data=1 there is nothing to shard over
        zero = zero_lib.Zero1.build(model, decay_mask(model.param_shapes()),
                                    cfg.recipe.dp_codec, cfg.recipe.wd_codec)
    tx, schedule = make_optimizer(cfg, decay_mask if zero is None else zero.decay_mask())
    replicated = NamedSharding(mesh, P())
    param_sh = model.shardings
    opt_params, opt_params_sh = ((model.abstract_params(), param_sh) if zero is None
                                 else (zero.abstract_shards(), zero.shardings))
    opt_sh = optax.tree_map_params(  # moments sharded like their params, counters replicated
        tx, lambda _, s: s, jax.eval_shape(tx.init, opt_params), opt_params_sh,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, NamedSharding))
    if zero is not None:
        opt_sh = {"tx": opt_sh, **({"master": zero.shardings} if zero.master else {})}
    state_sh = {"step": replicated, "params": param_sh, "opt_state": opt_sh,
                "rng": replicated}

    if zero is None:
        loss_and_grad = model.loss_and_grad_fn()
        init_opt = jax.jit(tx.init, out_shardings=opt_sh)
    else:
        shards_of, zero_grads, zero_gather = zero.shards_fn(), zero.grad_fn(), zero.gather_fn()

        @functools.partial(jax.jit, out_shardings=opt_sh)
        def init_opt(params):
            shards = shards_of(params)  # the master starts as the parameters themselves
            return {"tx": tx.init(shards), **({"master": shards} if zero.master else {})}

    def init(seed: int) -> State:
        params = model.init(seed)
        # rng: raw threefry key data of jax.random.key(seed). Consumers (dropout, stochastic
        # codecs) derive per-step keys as fold_in(wrap_key_data(rng), step): stateless, so
        # resuming at any step reproduces them.
        # Codecs keep no state across steps: TACO has none, and Echo's feedback state lives
        # for one forward pass (docs/training.md "Error feedback").
        rng = np.array([0, seed & 0xFFFFFFFF], np.uint32)
        return {"step": jax.device_put(np.zeros((), np.int32), replicated),
                "params": params, "opt_state": init_opt(params),
                "rng": jax.device_put(rng, replicated)}

    def step(state: State, tokens, targets) -> tuple[State, dict]:
        loss, grads = loss_and_grad(state["params"], tokens, targets)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads),
                   "lr": schedule(state["step"])}
        new = {"step": state["step"] + 1, "params": params, "opt_state": opt_state,
               "rng": state["rng"]}
        return new, metrics

    def zero_step(state: State, tokens, targets) -> tuple[State, dict]:
        """ZeRO-1: reduce-scatter the gradients, update this rank's shards, all-gather."""
        loss, grads, own = zero_grads(state["params"], tokens, targets)
        opt = state["opt_state"]
        master = opt["master"] if zero.master else own
        updates, tx_state = tx.update(grads, opt["tx"], master)
        master = optax.apply_updates(master, updates)
        params, replica = zero_gather(state["params"], master)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads),
                   "lr": schedule(state["step"])}
        if zero.master:  # what the replicas lag the exact master by, after this step
            metrics["wd_rel_error"] = (optax.tree.norm(jax.tree.map(jnp.subtract, replica,
                                                                    master))
                                       / jnp.maximum(optax.tree.norm(master), 1e-30))
        new = {"step": state["step"] + 1, "params": params,
               "opt_state": {"tx": tx_state, **({"master": master} if zero.master else {})},
               "rng": state["rng"]}
        return new, metrics

    batch_sh = NamedSharding(mesh, parallel.BATCH_SPEC)
    step_fn = jax.jit(under_recipe(cfg, step if zero is None else zero_step),
                      in_shardings=(state_sh, batch_sh, batch_sh),
                      out_shardings=(state_sh, replicated), donate_argnums=0)
    eval_fn = jax.jit(under_recipe(cfg, model.loss_fn()),
                      in_shardings=(param_sh, batch_sh, batch_sh))
    return Program(cfg, mesh, model, init, step_fn, eval_fn, state_sh, tx, zero)


def make_train_step(cfg: Config, mesh: jax.sharding.Mesh):
    """-> (init_state_fn, step_fn) for benchmarks.

    init_state_fn(seed: int) -> state (pytree of global arrays sharded on `mesh`)
    step_fn(state, tokens, targets) -> (state, {"loss", "grad_norm", "lr"})
        tokens/targets: int32 (batch_size, seq_len) global arrays split over "data"
        (`parallel.put_batch(np_array, mesh)`); `state` is donated.
    """
    prog = build(cfg, mesh)
    return prog.init, prog.step


# ---------------------------------------------------------------------------------------------
# The loop

def _run_dir(cfg: Config, resume: bool) -> Path:
    if cfg.train.run_dir:
        return Path(cfg.train.run_dir)
    out = Path(cfg.train.out_dir)
    if resume and (newest := config_lib.newest_run(out, cfg.name)) is not None:
        return newest
    stamp = int(time.time())
    if jax.process_count() > 1:  # every process must agree on the directory
        from jax.experimental import multihost_utils
        stamp = int(multihost_utils.broadcast_one_to_all(np.int64(stamp)))
    return out / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(stamp))}"


class _StopFlag:
    """SIGINT/SIGTERM -> finish the current step, checkpoint, exit. A second SIGINT aborts."""

    def __init__(self):
        self.signum = None
        self._old = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)


def _host(x) -> np.ndarray:
    """A replicated global array's value (with several processes, from a local shard)."""
    return np.asarray(x if x.is_fully_addressable else x.addressable_data(0))


def evaluate(prog: Program, params, batches, n: int) -> float:
    losses = [prog.eval_loss(params, *map(prog.put_batch, batches[i])) for i in range(n)]
    return float(np.mean([_host(x) for x in losses]))


# ---------------------------------------------------------------------------------------------
# What compression did: call sites, bytes on the wire, codec error

# ops whose transpose sends as much again through the same codec (ppermute: the reverse
# permutation; all_gather and psum_scatter: each other); their sites are noted forward only
_SENDS_BACK = ("ppermute", "all_gather", "psum_scatter")


def _sends_back(site: telemetry.Site) -> bool:
    # the "data" axis's collectives (dp_reduce, ZeRO-1's reduce-scatter and all-gather) run
    # after differentiation: nothing flows back through them
    return site.op in _SENDS_BACK and site.axes != (parallel.DATA,)


def step_wire_bytes(sites: list[tuple[telemetry.Site, int]], backward: bool = True) -> int:
    """Bytes one device sends per train step through these sites. A site is one call: an
    all-reduce (psum forward, pvary backward) or a send; with `backward` (a training step)
    a ppermute, all_gather or psum_scatter inside the differentiated model also sends its
    cotangent back, which its site, noted in the forward pass, does not count (except for
    the calls `telemetry.undifferentiated` names: a 1F1B schedule's hand-offs and
    forward ticks)."""
    return sum(telemetry.wire_bytes(s) * (n + (n - telemetry.undifferentiated(s)
                                               if backward and _sends_back(s) else 0))
               for s, n in sites)


def state_bytes(state: State) -> dict:
    """Bytes of the train state's "params" and "opt_state" on one device (this process's
    first): what each device holds, replicated arrays whole, sharded ones their shard."""
    dev = jax.local_devices()[0]

    def on_device(tree) -> int:
        return sum(sh.data.nbytes for x in jax.tree.leaves(tree)
                   for sh in x.addressable_shards if sh.device == dev)
    return {"params": on_device(state["params"]), "opt_state": on_device(state["opt_state"])}


def step_memory(step: Callable, *args) -> dict | None:
    """Per-device memory of the compiled step, in bytes, from XLA's memory analysis:
    `temp` (the activations kept for the backward pass and the work buffers), `arguments`
    and `outputs`. Called after the step ran with arguments of the same types, the lowering
    and the compilation come from jax's caches. None where the backend does not say."""
    try:
        m = step.lower(*args).compile().memory_analysis()
    except Exception:  # noqa: BLE001 - a missing analysis must not stop a run
        return None
    if m is None:
        return None
    return {"temp": int(m.temp_size_in_bytes), "arguments": int(m.argument_size_in_bytes),
            "outputs": int(m.output_size_in_bytes)}


class CodecErrorProbe:
    """The relative error of the compressed all-reduces, measured on demand: a loss and
    gradient of its own (the train step is untouched), traced inside telemetry.collect(),
    whose records then come from every call. Each all-reduce it measures adds an exact fp32
    psum and a host callback, hence its use at evaluations only."""

    def __init__(self, prog: Program):
        sh = NamedSharding(prog.mesh, parallel.BATCH_SPEC)
        self._fn = jax.jit(under_recipe(prog.cfg, prog.model.loss_and_grad_fn()),
                           in_shardings=(prog.model.shardings, sh, sh))
        self._put = prog.put_batch
        self._log = None

    def __call__(self, params, x: np.ndarray, y: np.ndarray) -> dict:
        """{"codec_rel_error_mean", "codec_rel_error_max"} over the compressed all-reduces
        of one forward and backward pass on (x, y); {} if nothing is compressed."""
        args = (params, self._put(x), self._put(y))
        if self._log is None:
            with telemetry.collect() as log:
                out = self._fn(*args)  # the first call traces: inside the block
            self._log = log
        else:
            out = self._fn(*args)
        jax.block_until_ready(out)
        jax.effects_barrier()  # the records arrive by host callbacks
        errors = [r["rel_error"] for r in self._log.records]
        self._log.records.clear()
        if not errors:
            return {}
        return {"codec_rel_error_mean": float(np.mean(errors)),
                "codec_rel_error_max": float(np.max(errors))}


class _Profile:
    """jax.profiler trace of steps first..last (train.profile_steps) into `directory`."""

    def __init__(self, steps: tuple[int, int] | None, directory: Path):
        self.steps, self.directory, self.active = steps, directory, False

    def before(self, step: int) -> None:
        if self.steps and not self.active and self.steps[0] <= step <= self.steps[1]:
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory))
            self.active = True

    def after(self, step: int, outputs) -> None:
        if self.active and step >= self.steps[1]:
            self.stop(outputs)

    def stop(self, outputs=None) -> None:
        if self.active:
            jax.block_until_ready(outputs)  # the traced steps' device work, complete
            jax.profiler.stop_trace()
            self.active = False


# ---------------------------------------------------------------------------------------------
# The run: set-up, restore, the step loop, the summary

def check_fresh_run_dir(run_dir: Path) -> None:
    """A fresh run would train from step 0 and fail when it reached a step already saved in
    `run_dir`: refuse it at the start. Raises RunDirInUse naming the directory, its newest
    checkpoint and how to continue that run instead."""
    steps = saved_steps(run_dir / "ckpt")
    if not agree_any(bool(steps)):
        return
    newest = f"step {max(steps)}" if steps else "seen by another process"
    raise RunDirInUse(f"run directory {run_dir} already holds checkpoints (newest: {newest}); "
                      f"continue that run with `python -m train --resume {run_dir}` "
                      f"(train.run(..., resume=True)), or give another train.run_dir")


def check_resume_config(run_dir: Path, cfg: Config) -> dict:
    """A resumed run keeps what it is: `cfg` may differ from the run's config.yaml only in
    `config.RESUME_MAY_CHANGE` (train.steps to extend it, logging, checkpoint cadence).
    -> those changes {key: (saved, new)}; RunChanged naming the others. No config.yaml
    (nothing saved yet): no changes."""
    saved_file = run_dir / "config.yaml"
    if not saved_file.is_file():
        return {}
    saved = config_lib.from_dict(config_lib.read_yaml(saved_file.read_text()) or {})
    allowed, identity = config_lib.config_changes(saved, cfg)
    if identity:
        raise RunChanged(config_lib.identity_error(run_dir, saved.name, "the config given",
                                                   identity))
    return allowed


def _note_changes(run_dir: Path, step: int, changes: dict) -> None:
    """Record the settings a resumed run changed, at the step it resumed from, in
    config_changes.jsonl (config.yaml holds the new values)."""
    row = {"step": step, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
           "changes": {k: {"from": a, "to": b} for k, (a, b) in changes.items()}}
    with (run_dir / "config_changes.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(f"[train] resumed at step {step} with "
          + ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items())
          + f" (config.yaml updated; noted in {run_dir / 'config_changes.jsonl'})", flush=True)


def run_files(run_dir: Path) -> dict:
    """Where a run's files are (those that exist)."""
    files = {"config": "config.yaml", "metrics": "metrics.jsonl", "metrics_csv": "metrics.csv",
             "tensorboard": "tb", "loss_plot": "loss.png", "checkpoints": "ckpt",
             "config_changes": "config_changes.jsonl", "profile": "profile",
             "summary": "summary.json"}
    return {k: str(run_dir / v) for k, v in files.items()
            if (run_dir / v).exists() or k == "summary"}


def _as_config(config: Config | dict | str | Path) -> Config:
    """A Config, a dict like the YAML presets, or a preset name / YAML path -> a checked
    Config."""
    if isinstance(config, (str, Path)):
        return config_lib.load_config(config)
    if isinstance(config, dict):
        return config_lib.from_dict(config)
    return config.validate()


def _load_batches(cfg: Config, verbose: bool) -> tuple:
    """-> (training batches, validation batches) of the run's corpus."""
    corpus = load_corpus(cfg.data, cfg.model.vocab_size, verbose=verbose)
    if corpus.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"tokenizer vocabulary {corpus.vocab_size} > model.vocab_size="
                         f"{cfg.model.vocab_size}")
    return split_batches(corpus, cfg.train.batch_size, cfg.model.seq_len, cfg.train.seed)


def _restore(prog: Program, ckpt: Checkpointer, resume: bool
             ) -> tuple[State, int, int | None]:
    """-> (the state to start from, its data position, the step it was restored from or
    None): a fresh state, or with `resume` the newest checkpoint that verifies."""
    state = prog.init(prog.cfg.train.seed)
    if not resume:
        return state, 0, None
    try:
        restored = ckpt.restore_latest(state, name=prog.cfg.name,
                                       optimizer=prog.optimizer_layout)
    except BaseException:
        ckpt.close()
        raise
    if restored is None:
        return state, 0, None
    state, meta, step = restored
    return state, int(meta["data_pos"]), step


def _describe(prog: Program, run_dir: Path, n_params: int, codecs: dict,
              resumed_at: int | None) -> str:
    """The line a run starts with: model size, mesh, codecs per axis, run directory."""
    cfg, model = prog.cfg, prog.model
    pipe = (f" x pipe={model.pipe} ({model.schedule}, {model.microbatches} micro-batches, "
            f"bubble {model.bubble_fraction:.0%})" if model.pipe > 1 else "")
    zero = (f", ZeRO-1 over data (weights: {cfg.recipe.wd_codec})" if prog.zero else
            ", parallel.zero=1 has nothing to shard at data=1" if cfg.parallel.zero else "")
    return (f"[train] {cfg.name}: {n_params / 1e6:.2f}M params, mesh "
            f"data={prog.mesh.shape['data']}{pipe} x tp={model.tp}"
            f"{' (emulated)' if model.emulate_tp else ''} on {jax.devices()[0].platform}, "
            f"codec fwd={codecs['fwd']} bwd={codecs['bwd']} head={codecs['head']} "
            f"pp={codecs['pp']} dp={codecs['dp']}{zero}"
            + (", error feedback" if cfg.model.feedback else "") + f", run dir {run_dir}"
            + (f", resumed at step {resumed_at}" if resumed_at is not None else ""))


class _Loop:
    """The step loop of one run, and what it measures on the way: step times, the last
    losses, the train step's collectives (from its first trace) and memory."""

    def __init__(self, prog: Program, state: State, start: int, batches: tuple,
                 run_dir: Path, ckpt: Checkpointer, writer: MetricsWriter):
        t = prog.cfg.train
        self.prog, self.t, self.state, self.start, self.step = prog, t, state, start, start
        self.train_batches, self.val_batches = batches
        self.ckpt, self.writer = ckpt, writer
        self.lead, self.multi = jax.process_index() == 0, jax.process_count() > 1
        self.tokens_per_step = t.batch_size * prog.cfg.model.seq_len
        self.probe = CodecErrorProbe(prog) if t.codec_error else None
        self.profile = _Profile(t.profile_range(), run_dir / "profile"
                                / (f"process{jax.process_index()}" if self.multi else ""))
        self.step_times, self.compile_s, self.row = [], None, {}
        self.last_loss = self.val_loss = None
        self.sites = self.wire_bytes = self.memory = None
        self.stop, self.stopped, self.bar = None, False, None

    def run(self) -> None:
        """Steps start+1 .. train.steps, or to a halt (train.halt_at, a signal), which is
        checkpointed. Closes the checkpointer and the metrics writer."""
        self.t0 = self.t_prev = time.perf_counter()
        self.pending = 0  # steps since the last host sync
        if self.lead and self.t.progress:
            from tqdm import tqdm
            self.bar = tqdm(total=self.t.steps, initial=self.start, desc=self.prog.cfg.name,
                            unit="step", dynamic_ncols=True)
        self.say = self.bar.write if self.bar is not None else functools.partial(print,
                                                                                 flush=True)
        with _StopFlag() as self.stop:
            try:
                for self.step in range(self.start + 1, self.t.steps + 1):
                    if self._train_step(self.step):
                        break
            finally:
                self.profile.stop()
                if self.bar is not None:
                    self.bar.close()
                try:
                    self.ckpt.close()  # waits for the last save: raises if it failed
                finally:
                    self.writer.close()

    def _train_step(self, step: int) -> bool:
        """One step, then its log row, evaluation and checkpoint where due -> halt?"""
        t, prog = self.t, self.prog
        x, y = self.train_batches[step - 1]
        self.profile.before(step)
        batch = (prog.put_batch(x), prog.put_batch(y))
        if self.sites is None:
            metrics = self._first_step(batch)
        else:
            self.state, metrics = prog.step(self.state, *batch)
        self.profile.after(step, metrics)
        self.pending += 1
        last = step == t.steps
        is_eval = bool(t.eval_every and step % t.eval_every == 0) or last
        every_ckpt = bool(t.ckpt_every and step % t.ckpt_every == 0) or last
        is_log = step % t.log_every == 0 or is_eval or every_ckpt
        # Stop on a signal only when every process does: with several, the flags are
        # compared at the log steps (the host waits for the step there anyway), so all
        # processes save the same step and none is left in a collective alone.
        signalled = self.stop.signum is not None
        if self.multi:
            signalled = agree_any(signalled) if is_log else False
        self.stopped = self.stopped or signalled
        halt = step == t.halt_at or signalled
        if is_log or halt:
            self._log(step, metrics, is_eval)
        if self.bar is not None:
            self.bar.update(1)
        if every_ckpt or halt:
            self.ckpt.save(step, self.state, {"data_pos": step, "name": prog.cfg.name,
                                              "time": time.time(),
                                              "optimizer": prog.optimizer_layout})
        if is_eval or every_ckpt or halt:
            self.t_prev = time.perf_counter()  # keep eval/save time out of step times
        return halt

    def _first_step(self, batch) -> dict:
        """The step that traces and compiles: note its collectives, the bytes they send and
        its memory; report them. -> the step's metrics."""
        (self.state, metrics), self.sites = telemetry.traced_sites(self.prog.step, self.state,
                                                                   *batch)
        self.wire_bytes = step_wire_bytes(self.sites)
        self.memory = step_memory(self.prog.step, self.state, *batch)
        if self.probe is not None and not any(s.encoded for s, _ in self.sites):
            self.probe = None  # nothing compressed: no error to measure
        if self.lead:
            self.say(f"[train] taco_jax collectives of one train step "
                     f"({self.wire_bytes / 2**20:.3g} MiB sent per device):\n"
                     + telemetry.site_report(self.sites))
        return metrics

    def _log(self, step: int, metrics: dict, is_eval: bool) -> None:
        """A metrics row; it syncs the host, so the interval's time is real. At evaluations
        the validation loss and the codec error too. A non-finite loss raises
        FloatingPointError."""
        m = jax.tree.map(_host, metrics)
        now = time.perf_counter()
        dt = (now - self.t_prev) / self.pending
        if self.compile_s is None:
            self.compile_s = now - self.t_prev  # first interval includes compilation
        else:
            self.step_times.append(dt)
        self.t_prev, self.pending = now, 0
        self.last_loss = float(m["loss"])
        self.row = row = {"step": step, "loss": self.last_loss, "lr": float(m["lr"]),
                          "grad_norm": float(m["grad_norm"]), "step_time_s": dt,
                          "tokens_per_s": self.tokens_per_step / dt, "elapsed_s": now - self.t0,
                          "wire_bytes": self.wire_bytes}
        if "wd_rel_error" in m:
            row["wd_rel_error"] = float(m["wd_rel_error"])
        if not math.isfinite(self.last_loss):
            raise FloatingPointError(f"loss became {self.last_loss} at step {step}")
        if is_eval:
            params = self.state["params"]
            self.val_loss = row["val_loss"] = evaluate(self.prog, params, self.val_batches,
                                                       self.t.eval_batches)
            if self.probe is not None:
                row.update(self.probe(params, *self.val_batches[0]))
        self.writer.write(row)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{self.last_loss:.4f}",
                                 tok_s=f"{row['tokens_per_s']:.0f}", ms=f"{1e3 * dt:.1f}",
                                 refresh=False)
            if is_eval:
                self.bar.write(f"step {step}: val loss {self.val_loss:.4f}")

    @property
    def interrupted(self) -> bool:
        return self.step < self.t.steps

    def why_stopped(self) -> str:
        if not self.stopped:
            return "train.halt_at"
        return ("signal " + str(self.stop.signum)) if self.stop.signum is not None \
            else "a signal to another process"


def _summary(prog: Program, loop: _Loop, run_dir: Path, resumed_from: int | None,
             n_params: int, codecs: dict) -> dict:
    """The run's summary (returned by `run` and written to summary.json)."""
    cfg, model, sites = prog.cfg, prog.model, loop.sites or ()
    step_time = statistics.median(loop.step_times) if loop.step_times else None
    return {
        "run_dir": str(run_dir), "name": cfg.name, "step": loop.step, "steps": cfg.train.steps,
        "interrupted": loop.interrupted, "resumed_from": resumed_from,
        "final_train_loss": loop.last_loss, "final_val_loss": loop.val_loss,
        "step_time_s": step_time,
        "tokens_per_s": loop.tokens_per_step / step_time if step_time else None,
        "compile_s": loop.compile_s, "params": n_params, "arch": cfg.model.arch,
        "mesh": {"data": model.data, "pipe": model.pipe, "tp": model.tp,
                 "emulated_tp": bool(model.emulate_tp)},
        "microbatches": model.microbatches, "bubble_fraction": model.bubble_fraction,
        "schedule": model.schedule,
        "platform": jax.devices()[0].platform, "devices": jax.device_count(),
        "codec_fwd": codecs["fwd"], "codec_bwd": codecs["bwd"], "codec_head": codecs["head"],
        "codec_pp": codecs["pp"], "codec_dp": codecs["dp"],
        "feedback": cfg.model.feedback, "sequence_parallel": cfg.model.sequence_parallel,
        "tp_overlap": cfg.model.tp_overlap,
        "zero": 1 if prog.zero else 0, "codec_wd": cfg.recipe.wd_codec if prog.zero else None,
        "wire_bytes_per_step": loop.wire_bytes, "step_memory": loop.memory,
        "state_bytes": state_bytes(loop.state),
        "sites": {"compressed": sum(n for s, n in sites if s.encoded),
                  # codec "none" through the collective matmuls: the values, in steps
                  "uncompressed_steps": sum(n for s, n in sites
                                            if s.compressed and not s.encoded),
                  "plain": sum(n for s, n in sites if not s.compressed)},
        "files": run_files(run_dir),
    }


def run(config: Config | dict | str, *, resume: bool = False) -> dict:
    """Train per `config` (a Config, a dict like the YAML presets, or a preset name/path).

    resume=True continues the run in `train.run_dir` (or the newest `<name>-*` in out_dir)
    from its newest checkpoint that restores and verifies (a corrupt newer one is reported
    and set aside); `config` may change only what `check_resume_config` allows (else
    RunChanged). The run holds its directory's lock while it trains: another trainer there
    raises RunDirInUse, as does a fresh run into a directory that holds checkpoints, before
    anything is built. Returns a summary dict (also written to summary.json). Expected
    stops raise a `train.errors.TrainError` whose message says what to do.
    """
    cfg = _as_config(config)
    setup_backend(cfg)
    lead = jax.process_index() == 0
    run_dir = _run_dir(cfg, resume)
    changes = check_resume_config(run_dir, cfg) if resume else {}
    lock = None
    try:
        # one trainer per run directory (process 0 holds the lock for all processes)
        refused = None
        if lead:
            try:
                lock = RunDirLock(run_dir)
            except RunDirInUse as e:
                refused = e
        if agree_any(refused is not None):
            raise refused or RunDirInUse(f"run directory {run_dir} is in use by another "
                                         f"trainer (process 0 was refused its lock)")
        if not resume:
            check_fresh_run_dir(run_dir)
        return _run_locked(cfg, run_dir, resume, changes)
    finally:
        if lock is not None:
            lock.release()


def _run_locked(cfg: Config, run_dir: Path, resume: bool, changes: dict) -> dict:
    """`run` once it holds the run directory."""
    lead = jax.process_index() == 0
    prog = build(cfg, build_mesh(cfg))
    batches = _load_batches(cfg, verbose=lead)
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt = Checkpointer(run_dir / "ckpt", keep=cfg.train.keep, async_save=cfg.train.async_ckpt)
    state, start, resumed_from = _restore(prog, ckpt, resume)
    if lead:
        (run_dir / "config.yaml").write_text(config_lib.dump(cfg))
        if changes:
            _note_changes(run_dir, start, changes)
    try:
        writer = MetricsWriter(run_dir, truncate_after=start if resumed_from is not None
                               else None, enabled=lead)
    except BaseException:
        ckpt.close()
        raise
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(state["params"]))
    codecs = cfg.codecs()
    if lead:
        print(_describe(prog, run_dir, n_params, codecs,
                        start if resumed_from is not None else None), flush=True)
    loop = _Loop(prog, state, start, batches, run_dir, ckpt, writer)
    loop.run()
    if lead and (run_dir / "metrics.jsonl").exists() and loop.row:
        plot_runs([run_dir], run_dir / "loss.png", title=f"{cfg.name}: loss")
    summary = _summary(prog, loop, run_dir, resumed_from, n_params, codecs)
    if lead:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        steps = saved_steps(run_dir / "ckpt")
        print(f"[train] run directory {run_dir}:\n"
              + "".join(f"  {what:<15} {summary['files'][key]}\n" for key, what in (
                  ("config", "config"), ("metrics", "metrics"), ("metrics_csv", "metrics (CSV)"),
                  ("loss_plot", "loss curve"), ("tensorboard", "TensorBoard"),
                  ("summary", "summary")) if key in summary["files"])
              + f"  {'checkpoints':<15} {run_dir / 'ckpt'} (steps "
              + (", ".join(map(str, steps)) or "none") + ")", flush=True)
        if loop.interrupted:
            print(f"[train] stopped at step {loop.step} ({loop.why_stopped()}); checkpoint "
                  f"saved. Continue with: python -m train --resume {run_dir}", flush=True)
    return summary
