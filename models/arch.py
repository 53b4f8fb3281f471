"""`model.arch` -> the decoder family's classes: the whole model and one block (what
models/parallel.py builds, stacks for a pipeline and initializes on the host).

Both families run on the same tensor-parallel layers (models/gpt.py's sub-layers, block
and LM head); models/qwen.py only changes what is inside them.
"""
from __future__ import annotations

from models.gpt import GPT, Block, GPTConfig
from models.qwen import Qwen, QwenBlock

# the names are gpt.ARCHS, which GPTConfig.validate checks
FAMILIES: dict[str, tuple[type[GPT], type[Block]]] = {"gpt": (GPT, Block),
                                                      "qwen": (Qwen, QwenBlock)}


def decoder(cfg: GPTConfig) -> type[GPT]:
    """The model class of `cfg.arch`: called as cls(cfg, rngs, layers=None).

    Raises ValueError naming the value for an unknown arch."""
    return _family(cfg)[0]


def block(cfg: GPTConfig) -> type[Block]:
    """The block class of `cfg.arch`: called as cls(cfg, rngs)."""
    return _family(cfg)[1]


def _family(cfg: GPTConfig):
    if cfg.arch not in FAMILIES:
        raise ValueError(f"model.arch={cfg.arch!r} must be one of {list(FAMILIES)}")
    return FAMILIES[cfg.arch]
