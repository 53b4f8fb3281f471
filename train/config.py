"""Run configuration: frozen dataclasses, YAML presets (`configs/*.yaml`), dotted CLI
overrides.

    cfg = load_config("tiny", ["model.n_layer=2", "codec=none"])   # or a YAML path

`codec=X` is shorthand for every axis at once: `model.codec_fwd=X model.codec_bwd=X` (tensor
parallelism), `recipe.codec_pp=X` (pipeline hand-offs) and `recipe.codec_dp=X` (data-parallel
gradients), with `recipe.codec=X` the default, so `codec=none` is the exact baseline. Values
are parsed as YAML (`train.steps=50`, `data.paths=[a.txt, b/]`). Unknown keys and mistyped
values raise ValueError naming them; `Config.validate` checks everything that does not need
devices.
"""
from __future__ import annotations

import contextlib
import dataclasses
import typing
from pathlib import Path
from typing import Any, Iterable

import yaml

import taco_jax
from models.gpt import GPTConfig, codec_name
from models.parallel import check_pipeline


class _Loader(yaml.SafeLoader):
    """YAML as PyYAML reads it, except that YAML 1.1's base-60 numbers stay text: `2:3` is
    the step range "2:3", not the integer 123."""


def _no_base_60(constructor):
    def construct(loader, node):
        return node.value if ":" in node.value else constructor(loader, node)
    return construct


_Loader.add_constructor("tag:yaml.org,2002:int",
                        _no_base_60(yaml.constructor.SafeConstructor.construct_yaml_int))
_Loader.add_constructor("tag:yaml.org,2002:float",
                        _no_base_60(yaml.constructor.SafeConstructor.construct_yaml_float))


def read_yaml(text: str) -> Any:
    """Parse a config file or an override's value (safe YAML, no base-60 numbers)."""
    return yaml.load(text, Loader=_Loader)


# train/ runs from a checkout (the wheel installs taco_jax alone), so the presets are found
# beside it rather than through the working directory or sys.path.
PRESET_DIR = Path(__file__).resolve().parent.parent / "configs"


def preset_names() -> list[str]:
    """Names of the presets in configs/ ("tiny", "small", ...)."""
    return sorted(f.stem for f in PRESET_DIR.glob("*.yaml"))


def preset_descriptions() -> dict[str, str]:
    """{preset name: one line}: what it is for (the first comment line of its file, up to
    its first colon) and its model's shape."""
    out = {}
    for name in preset_names():
        text = (PRESET_DIR / f"{name}.yaml").read_text()
        first = next((line for line in text.splitlines() if line.startswith("#")), "#")
        what = first.lstrip("# ").rstrip(":").split(": ")[0].split(" (")[0].strip()
        try:
            m = load_config(name, validate=False).model
            kv = f", {m.kv_heads} KV heads" if m.kv_heads != m.n_head else ""
            shape = (f" ({m.n_layer} x {m.d_model}, {m.n_head} heads{kv}, vocab "
                     f"{m.vocab_size}, T={m.seq_len}; {m.num_params() / 1e6:.3g}M params)")
        except (ValueError, TypeError, AttributeError):
            shape = ""
        out[name] = what + shape
    return out


SCHEDULES = ("gpipe", "1f1b")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    tp: int = 0  # tensor-parallel size; 0 = all devices not used by `data` and `pipe`
    data: int = 1  # data-parallel size; 0 = all devices not used by `tp` and `pipe`
    pipe: int = 1  # pipeline stages (GPipe); model.n_layer must be divisible by it
    microbatches: int = 1  # micro-batches per data shard's batch (with pipe > 1)
    # pipeline schedule (with pipe > 1): "gpipe" (all forwards, then all backwards) or
    # "1f1b" (forwards and backwards interleaved: at most `pipe` micro-batches in flight)
    schedule: str = "gpipe"
    cpu_devices: int = 4  # simulated CPU devices when JAX runs on CPU (set before backend start)
    # > 0: tensor parallelism of this size emulated on each device (jax.vmap over the shards,
    # the same compression sites as on that many devices); the mesh is then data only
    emulate_tp: int = 0
    # 1: ZeRO-1, the optimizer state sharded over "data" (gradients reduce-scattered, the
    # updated shards all-gathered); 0: replicated. With data=1 there is nothing to shard: 0
    zero: int = 0


@dataclasses.dataclass(frozen=True)
class RecipeConfig:
    """The `taco_jax.config` recipe every jitted function of the run is traced under (the
    one home of the compression policy: the model's codec_* and min_bytes fields name only
    the TP sites that differ from it). None = the value named in each field's comment."""

    codec: str = "taco"  # the default codec: the TP sites the model leaves None, and below
    codec_pp: str | None = None  # pipeline stage hand-offs (activations, cotangents); None = codec
    # data-parallel gradient all-reduce; None = codec. Exact unless asked: gradients feed the
    # optimizer directly, and runs saved before the field existed resume unchanged
    codec_dp: str | None = "none"
    # ZeRO-1's weight all-gather (parallel.zero=1): "none" sends the updated shards exactly;
    # a lossy codec sends the quantized difference to the replicas (the exact master shard
    # kept with the optimizer state); None = codec. Not set by the `codec=X` shorthand
    codec_wd: str | None = "none"
    # collectives smaller than this stay lax's; None = taco_jax's (calibrated or default)
    min_bytes: int | None = None
    # kernels: auto (Pallas on GPU, jnp elsewhere) | pallas | interpret | reference
    backend: str = "auto"

    @property
    def pp_codec(self) -> str:
        """The codec of the pipeline hand-offs in effect."""
        return self.codec if self.codec_pp is None else self.codec_pp

    @property
    def dp_codec(self) -> str:
        """The codec of the data-parallel gradient all-reduce in effect."""
        return self.codec if self.codec_dp is None else self.codec_dp

    @property
    def wd_codec(self) -> str:
        """The codec of ZeRO-1's weight all-gather in effect."""
        return self.codec if self.codec_wd is None else self.codec_wd

    def fields(self) -> dict:
        """Keyword arguments of taco_jax.config."""
        return {"codec": self.codec, "min_bytes": self.min_bytes, "backend": self.backend}

    def recipe(self) -> taco_jax.Recipe:
        """This recipe as a value (what `context()` puts in effect), for the checks that
        resolve the model's sites against it."""
        return taco_jax.Recipe(**self.fields())

    def context(self) -> contextlib.AbstractContextManager:
        return taco_jax.config(**self.fields())

    def validate(self) -> "RecipeConfig":
        for name in ("codec", "codec_pp", "codec_dp", "codec_wd"):
            value = getattr(self, name)
            if value is None and name != "codec":
                continue
            if value == "" and name != "codec":
                raise ValueError(f"recipe.{name}='' is not a codec: write null (or leave the "
                                 f"key out) for recipe.codec")
            try:
                taco_jax.codecs.get(value)
            except ValueError as e:
                raise ValueError(f"recipe.{name}={value!r}: {e}") from None
        if self.min_bytes is not None and self.min_bytes < 0:
            raise ValueError(f"recipe.min_bytes={self.min_bytes} must be >= 0, or null (the key "
                             f"left out) for taco_jax's threshold")
        if self.backend not in taco_jax.recipe.BACKENDS:
            raise ValueError(f"recipe.backend={self.backend!r} must be one of "
                             f"{list(taco_jax.recipe.BACKENDS)}")
        return self


@dataclasses.dataclass(frozen=True)
class DataConfig:
    paths: tuple = ()  # files or folders of text; empty = this interpreter's stdlib sources; also python:stdlib, python:site-packages
    glob: str = "*.py"  # file pattern searched for inside folders
    tokenizer: str = "bpe"  # bpe (trained locally with HF tokenizers) | bytes
    cache_dir: str = ".cache/taco_jax"  # tokenizer + token memmap cache (gitignored)
    val_fraction: float = 0.02  # tail of the token stream held out for validation
    max_mb: float = 0  # cap on the corpus (every k-th file, sorted); 0 = every file
    shuffle_files: bool = False  # file order by hash of the path: the val tail is a mix of files


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-3  # peak learning rate (after warmup)
    min_lr: float = 1e-4  # end of the cosine decay
    warmup_steps: int = 20  # linear warmup from 0 (cut to train.steps - 1 for short runs)
    weight_decay: float = 0.1  # AdamW decay on matrices and embeddings only
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # clip by global norm; 0 disables


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 200  # optimizer steps (the cosine schedule spans all of them)
    batch_size: int = 16  # global batch in sequences, split over "data"
    seed: int = 0  # parameter init, data order, RNG state
    log_every: int = 1  # steps between metric rows (each one syncs the host)
    eval_every: int = 50  # steps between validation losses (and at the end); 0 = only at end
    eval_batches: int = 4  # validation batches per evaluation (fixed set)
    ckpt_every: int = 100  # steps between checkpoints (and at the end); 0 = only at end
    keep: int = 3  # checkpoints kept by the CheckpointManager
    async_ckpt: bool = True  # orbax async save: training continues while it writes
    out_dir: str = "runs"  # parent of run directories (gitignored)
    run_dir: str = ""  # explicit run directory; empty = out_dir/<name>-<timestamp>
    halt_at: int = 0  # stop at this step as if interrupted (checkpoint + exit); 0 = never
    progress: bool = True  # tqdm progress bar
    codec_error: bool = True  # at each evaluation: relative error of the compressed all-reduces
    profile_steps: str = ""  # "A:B": jax.profiler trace of steps A..B into <run_dir>/profile/

    def profile_range(self) -> tuple[int, int] | None:
        """(A, B) of profile_steps, or None when empty."""
        if not self.profile_steps:
            return None
        a, sep, b = self.profile_steps.partition(":")
        try:
            first, last = int(a), int(b)
        except ValueError:
            first = last = 0
        if not sep or not 1 <= first <= last:
            raise ValueError(f"train.profile_steps={self.profile_steps!r} must look like "
                             f"'A:B' with 1 <= A <= B (steps A to B, inclusive)")
        return first, last


@dataclasses.dataclass(frozen=True)
class Config:
    name: str = "tiny"  # preset name, prefix of run directories
    recipe: RecipeConfig = RecipeConfig()
    model: GPTConfig = GPTConfig()
    parallel: ParallelConfig = ParallelConfig()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()

    def validate(self) -> "Config":
        """Device-independent checks (the mesh-dependent ones are in models.parallel)."""
        pa = self.parallel
        if pa.emulate_tp < 0:
            raise ValueError(f"parallel.emulate_tp={pa.emulate_tp} must be >= 0")
        if pa.emulate_tp and pa.tp not in (0, 1):
            raise ValueError(f"parallel.emulate_tp={pa.emulate_tp} emulates tensor parallelism "
                             f"on each device; it cannot be combined with parallel.tp={pa.tp}")
        for name in ("tp", "data"):
            if getattr(pa, name) < 0:
                raise ValueError(f"parallel.{name}={getattr(pa, name)} must be >= 0 (0 = auto)")
        if pa.schedule not in SCHEDULES:
            raise ValueError(f"parallel.schedule={pa.schedule!r} must be one of {SCHEDULES}")
        if pa.zero not in (0, 1):
            raise ValueError(f"parallel.zero={pa.zero} must be 0 (optimizer state replicated "
                             f"over data) or 1 (ZeRO-1: sharded over data)")
        self.recipe.validate()
        if not pa.zero and not taco_jax.codecs.get(self.recipe.wd_codec).is_identity:
            raise ValueError(f"recipe.codec_wd={self.recipe.wd_codec!r} compresses ZeRO-1's "
                             f"weight all-gather, but parallel.zero=0 sends no weights (set "
                             f"parallel.zero=1, or recipe.codec_wd=none)")
        self.model.validate(tp=pa.emulate_tp or pa.tp or 1, recipe=self.recipe.recipe())
        check_pipeline(self.model, pa.pipe, pa.microbatches, pa.emulate_tp)
        t, o, d = self.train, self.optim, self.data
        for name in ("steps", "batch_size", "log_every", "eval_batches", "keep"):
            if getattr(t, name) <= 0:
                raise ValueError(f"train.{name}={getattr(t, name)} must be positive")
        for name in ("eval_every", "ckpt_every", "halt_at"):
            if getattr(t, name) < 0:
                raise ValueError(f"train.{name}={getattr(t, name)} must be >= 0")
        if self.parallel.cpu_devices < 0:
            raise ValueError(f"parallel.cpu_devices={self.parallel.cpu_devices} must be >= 0")
        if o.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps={o.warmup_steps} must be >= 0")
        if o.lr <= 0 or o.min_lr < 0 or o.min_lr > o.lr:
            raise ValueError(f"need 0 <= optim.min_lr={o.min_lr} <= optim.lr={o.lr}, lr > 0")
        if o.grad_clip < 0:
            raise ValueError(f"optim.grad_clip={o.grad_clip} must be >= 0")
        if d.tokenizer not in ("bpe", "bytes"):
            raise ValueError(f"data.tokenizer={d.tokenizer!r} must be 'bpe' or 'bytes'")
        if d.tokenizer == "bytes" and self.model.vocab_size < 257:
            raise ValueError(f"model.vocab_size={self.model.vocab_size} < 257 needed by "
                             f"data.tokenizer='bytes' (256 bytes + end-of-text)")
        if not 0.0 < d.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction={d.val_fraction} must be in (0, 1)")
        if d.max_mb < 0:
            raise ValueError(f"data.max_mb={d.max_mb} must be >= 0 (0 = no cap)")
        t.profile_range()
        return self

    def codecs(self) -> dict:
        """Names of the codecs in effect: {"fwd", "bwd", "head"} at the model's TP sites,
        "pp" at the pipeline hand-offs, "dp" at the data-parallel gradient all-reduce."""
        sites = self.model.sites(self.recipe.recipe())
        return {"fwd": codec_name(sites.fwd), "bwd": codec_name(sites.bwd),
                "head": codec_name(sites.head), "pp": self.recipe.pp_codec,
                "dp": self.recipe.dp_codec}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _coerce(key: str, value: Any, default: Any) -> Any:
    """Type-check `value` against the field's default (YAML gives int/float/str/bool/list)."""
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
    elif isinstance(default, int):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(default, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        try:  # PyYAML reads "1e-3" (no dot) as a string
            return float(value)
        except (TypeError, ValueError):
            pass
    elif isinstance(default, str):
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    elif isinstance(default, tuple):
        if isinstance(value, str):
            return (value,)
        if isinstance(value, (list, tuple)):
            return tuple(str(v) for v in value)
        if value is None:
            return ()
    raise ValueError(f"{key}={value!r}: expected {type(default).__name__}")


def _optional(hint) -> type | None:
    """T for a field annotated `T | None` (null in YAML means the field's default policy),
    else None."""
    args = typing.get_args(hint)
    if type(None) in args and len(args) == 2:
        return next(a for a in args if a is not type(None))
    return None


def _build(cls, values: dict, prefix: str = ""):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for k, v in (values or {}).items():
        key = f"{prefix}{k}"
        if k not in fields:
            raise ValueError(f"unknown config key {key!r}; valid keys here: {sorted(fields)}")
        default = fields[k].default
        base = _optional(hints[k])
        if dataclasses.is_dataclass(default):
            if not isinstance(v, dict):
                raise ValueError(f"{key} must be a mapping, got {v!r}")
            kwargs[k] = _build(type(default), v, prefix=f"{key}.")
        elif base is not None:  # `T | None`: null, or a value of type T
            kwargs[k] = None if v is None else _coerce(key, v, base())
        else:
            kwargs[k] = _coerce(key, v, default)
    return cls(**kwargs)


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {key!r}: {p!r} is not a section")
    node[parts[-1]] = value


# what `codec=X` sets: one codec on every axis of the mesh
SHORTHAND_FIELDS = ("model.codec_fwd", "model.codec_bwd", "recipe.codec_pp", "recipe.codec_dp")


def parse_overrides(overrides: Iterable[str]) -> dict:
    """["model.n_layer=2", "codec=none"] -> nested dict of YAML-parsed values."""
    tree: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like key=value (e.g. train.steps=50)")
        key, raw = item.split("=", 1)
        value = read_yaml(raw) if raw else ""
        if key == "codec":  # shorthand: every axis (both TP directions, pipeline, data)
            if value is not None:  # null: the recipe's codec on every axis
                try:
                    taco_jax.codecs.get(value)
                except (ValueError, TypeError) as e:  # named as typed, not as expanded
                    raise ValueError(f"{item}: {e}") from None
                # the recipe's default too, so config.yaml names the codec that runs
                _set_dotted(tree, "recipe.codec", value)
            for field in SHORTHAND_FIELDS:
                _set_dotted(tree, field, value)
        else:
            _set_dotted(tree, key, value)
    return tree


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def resolve_preset(path: str | Path):
    """A YAML path, or the name of a preset in configs/ ("tiny", "tiny.yaml" or
    "configs/tiny.yaml", from any working directory) -> its Path."""
    p = Path(path)
    if p.is_file():
        return p
    name = p.name[:-5] if p.name.endswith(".yaml") else p.name
    if p.parent == Path(".") or p.parent == Path(PRESET_DIR.name):  # "tiny", configs/tiny.yaml
        preset = PRESET_DIR / f"{name}.yaml"
        if preset.is_file():
            return preset
    raise ValueError(f"config {str(path)!r} not found: neither a file nor a preset "
                     f"(presets: {preset_names()})")


def load_config(path: str | Path | None = None, overrides: Iterable[str] = (),
                validate: bool = True) -> Config:
    """Preset name or YAML path (default the tiny preset) + dotted overrides -> Config."""
    p = resolve_preset(path or "tiny")
    values = read_yaml(p.read_text()) or {}
    values.setdefault("name", p.name[:-5] if p.name.endswith(".yaml") else p.name)
    cfg = _build(Config, _merge(values, parse_overrides(overrides)))
    return cfg.validate() if validate else cfg


def from_dict(values: dict, overrides: Iterable[str] = ()) -> Config:
    return _build(Config, _merge(values, parse_overrides(overrides))).validate()


def replace(cfg: Config, overrides: Iterable[str]) -> Config:
    """cfg with dotted overrides applied (e.g. for benchmarks)."""
    return from_dict(cfg.to_dict(), overrides)


# ---------------------------------------------------------------------------------------------
# Resuming: what may change when a run continues

# The fields a resumed run may change: how long it trains (train.steps extends it), what it
# logs and measures, how often and how many checkpoints it keeps, where its files and the
# token cache are. Everything else (codecs and recipe, model, data, optimizer, parallel
# layout, batch and seed, the run's name) is what the run is: changing it mid-run would
# make one run directory hold two different runs.
RESUME_MAY_CHANGE = frozenset({
    "train.steps", "train.log_every", "train.eval_every", "train.eval_batches",
    "train.ckpt_every", "train.keep", "train.async_ckpt", "train.out_dir", "train.run_dir",
    "train.halt_at", "train.progress", "train.codec_error", "train.profile_steps",
    "data.cache_dir"})
# where a run's files are, not what it does: not worth a note when they change
_LOCATION_FIELDS = frozenset({"train.out_dir", "train.run_dir"})


def _flat(values: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in values.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
    return out


def _effective(cfg: Config) -> dict:
    """cfg's fields by dotted key, each codec field as the codec in effect there (so that
    `codec=taco` on a run whose sites take the recipe's taco changes nothing)."""
    flat = _flat(cfg.to_dict())
    with contextlib.suppress(ValueError, TypeError):  # an unknown codec: compared as written
        c = cfg.codecs()
        flat.update({"model.codec_fwd": c["fwd"], "model.codec_bwd": c["bwd"],
                     "model.codec_head": c["head"], "recipe.codec_pp": c["pp"],
                     "recipe.codec_dp": c["dp"], "recipe.codec_wd": cfg.recipe.wd_codec})
    return flat


def config_changes(saved: Config, new: Config) -> tuple[dict, dict]:
    """-> (changes a resumed run may make, changes that would make it another run): each
    {dotted key: (saved value, new value)}, codec fields compared by the codec in effect.
    The first leaves out where the run's files are (train.run_dir, train.out_dir)."""
    a, b = _effective(saved), _effective(new)
    changed = {k: (a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys())
               if a.get(k) != b.get(k)}
    allowed = {k: v for k, v in changed.items()
               if k in RESUME_MAY_CHANGE and k not in _LOCATION_FIELDS}
    identity = {k: v for k, v in changed.items() if k not in RESUME_MAY_CHANGE}
    return allowed, identity


def identity_error(run_dir: str | Path, name: str, what: str, changes: dict) -> str:
    """The message refusing `what` (an override as typed, or "this config") that would
    change the run `name` in `run_dir` (`changes`: key -> (saved, new))."""
    diff = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changes.items())
    override = f" {what}" if "=" in what else ""
    return (f"{what} would change what the run in {run_dir} is ({diff}). A resumed run keeps "
            f"its own config.yaml and may change only {', '.join(sorted(RESUME_MAY_CHANGE))}. "
            f"Start a new run instead: `python -m train --config {name}{override}`, or with "
            f"this run's settings, `python -m train --config {Path(run_dir) / 'config.yaml'}"
            f"{override} train.run_dir=NEW_DIR`")


def resume_config(run_dir: str | Path, overrides: Iterable[str] = ()) -> Config:
    """The config of the run in `run_dir` (its config.yaml, train.run_dir set to it) with
    `overrides` a resumed run may make (RESUME_MAY_CHANGE). An override that would change
    what the run is raises ValueError naming it as written (`codec=none`) and saying how
    to start a new run instead."""
    run_dir = Path(run_dir)
    values = read_yaml((run_dir / "config.yaml").read_text()) or {}
    saved = _build(Config, values)
    for item in overrides:
        _, identity = config_changes(saved, _build(Config, _merge(values,
                                                                  parse_overrides([item]))))
        if identity:
            raise ValueError(identity_error(run_dir, saved.name, item, identity))
    return from_dict(values, [*overrides, f"train.run_dir={run_dir}"])


def newest_run(out_dir: str | Path, name: str) -> Path | None:
    """The most recently modified run directory `<out_dir>/<name>-*` holding a
    config.yaml, or None."""
    runs = [p for p in Path(out_dir).glob(f"{name}-*") if (p / "config.yaml").is_file()]
    return max(runs, key=lambda p: p.stat().st_mtime) if runs else None


def dump(cfg: Config) -> str:
    def plain(x):
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, tuple):
            return [plain(v) for v in x]
        return x
    return yaml.safe_dump(plain(cfg.to_dict()), sort_keys=False)
