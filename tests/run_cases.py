"""What the training-program tests share: a small corpus on every machine, the overrides of a
tiny two-way-TP run, and a module-scoped tokenizer cache (imported as a fixture)."""
import sysconfig
from pathlib import Path

import pytest

CORPUS = Path(sysconfig.get_paths()["stdlib"]) / "json"  # ~50 KB of Python, on every machine


def _overrides(cache, run_dir, *extra):
    return ["model.vocab_size=512", "model.seq_len=32", "model.n_layer=1", "model.n_head=4",
            "model.d_model=32", "parallel.tp=2", "parallel.data=2",
            f"data.paths=[{CORPUS}]", f"data.cache_dir={cache}", "train.batch_size=4",
            "train.steps=6", "train.eval_every=3", "train.ckpt_every=3", "train.eval_batches=2",
            "train.progress=false", "optim.warmup_steps=2", f"train.run_dir={run_dir}", *extra]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")
