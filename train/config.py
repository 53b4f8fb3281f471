"""Run configuration: frozen dataclasses, YAML presets in configs/, dotted CLI overrides.

    cfg = load_config("configs/tiny.yaml", ["model.n_layer=2", "codec=none"])

`codec=X` is shorthand for `model.codec_fwd=X model.codec_bwd=X`. Values are parsed as YAML
(`train.steps=50`, `data.paths=[a.txt, b/]`). Unknown keys and mistyped values raise ValueError
naming them; `Config.validate` checks everything that does not need devices.
"""
from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any, Iterable

import yaml

from models.gpt import GPTConfig

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    tp: int = 0  # tensor-parallel size; 0 = all devices not used by `data`
    data: int = 1  # data-parallel size; 0 = all devices not used by `tp`
    cpu_devices: int = 4  # simulated CPU devices when JAX runs on CPU (set before backend start)


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


@dataclasses.dataclass(frozen=True)
class Config:
    name: str = "tiny"  # preset name, prefix of run directories
    model: GPTConfig = GPTConfig()
    parallel: ParallelConfig = ParallelConfig()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()

    def validate(self) -> "Config":
        """Device-independent checks (the mesh-dependent ones are in models.parallel)."""
        self.model.validate(tp=self.parallel.tp or 1)
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
        return self

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


def _build(cls, values: dict, prefix: str = ""):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in (values or {}).items():
        key = f"{prefix}{k}"
        if k not in fields:
            raise ValueError(f"unknown config key {key!r}; valid keys here: {sorted(fields)}")
        default = fields[k].default
        if dataclasses.is_dataclass(default):
            if not isinstance(v, dict):
                raise ValueError(f"{key} must be a mapping, got {v!r}")
            kwargs[k] = _build(type(default), v, prefix=f"{key}.")
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


def parse_overrides(overrides: Iterable[str]) -> dict:
    """["model.n_layer=2", "codec=none"] -> nested dict of YAML-parsed values."""
    tree: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like key=value (e.g. train.steps=50)")
        key, raw = item.split("=", 1)
        value = yaml.safe_load(raw) if raw else ""
        if key == "codec":  # shorthand: both directions
            _set_dotted(tree, "model.codec_fwd", value)
            _set_dotted(tree, "model.codec_bwd", value)
        else:
            _set_dotted(tree, key, value)
    return tree


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def resolve_preset(path: str | Path) -> Path:
    """A path, or a preset name looked up in configs/ ("tiny" -> configs/tiny.yaml)."""
    p = Path(path)
    if p.exists():
        return p
    for cand in (CONFIG_DIR / p, CONFIG_DIR / f"{p}.yaml"):
        if cand.exists():
            return cand
    raise ValueError(f"config {str(path)!r} not found (presets: "
                     f"{sorted(q.stem for q in CONFIG_DIR.glob('*.yaml'))})")


def load_config(path: str | Path | None = None, overrides: Iterable[str] = (),
                validate: bool = True) -> Config:
    """Preset YAML (default configs/tiny.yaml) + dotted overrides -> validated Config."""
    p = resolve_preset(path or "tiny")
    values = yaml.safe_load(p.read_text()) or {}
    values.setdefault("name", p.stem)
    cfg = _build(Config, _compat(values, _merge(values, parse_overrides(overrides)), p))
    return cfg.validate() if validate else cfg


def from_dict(values: dict, overrides: Iterable[str] = ()) -> Config:
    merged = _merge(values, parse_overrides(overrides))
    return _build(Config, _compat(values, merged, "a config dict")).validate()


def _compat(written: dict, merged: dict, source) -> dict:
    """Configs written before backward error feedback became opt-in (model.feedback_bwd,
    session 3) meant feedback in both directions by `model.feedback: true`: keep that
    meaning for them (a run resumed or reloaded must not change), and say so. `written`:
    the file's values (is feedback_bwd missing there?); `merged`: with the overrides."""
    model, final = written.get("model"), merged.get("model")
    if (isinstance(model, dict) and model.get("feedback") is True
            and "feedback_bwd" not in model and isinstance(final, dict)
            and final.get("feedback") is True and "feedback_bwd" not in final):
        warnings.warn(f"{source}: model.feedback: true without model.feedback_bwd was written "
                      f"when feedback ran in both directions; keeping that meaning "
                      f"(model.feedback_bwd=true). Set model.feedback_bwd explicitly to "
                      f"silence this; the default is now false (docs/echo.md).", stacklevel=3)
        merged = {**merged, "model": {**final, "feedback_bwd": True}}
    return merged


def replace(cfg: Config, overrides: Iterable[str]) -> Config:
    """cfg with dotted overrides applied (e.g. for benchmarks)."""
    return from_dict(cfg.to_dict(), overrides)


def dump(cfg: Config) -> str:
    def plain(x):
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, tuple):
            return [plain(v) for v in x]
        return x
    return yaml.safe_dump(plain(cfg.to_dict()), sort_keys=False)
