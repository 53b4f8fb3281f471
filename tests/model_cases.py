"""What the model tests share: a tiny fp32 GPT config with odd sizes, its token batches, and the
relative errors the tests compare with."""
import jax
import numpy as np

from models.gpt import GPTConfig

CFG = GPTConfig(vocab_size=68, seq_len=12, n_layer=2, n_head=4, d_model=24, d_ff=40,
                dtype="float32", codec_fwd="none", codec_bwd="none", attention="xla")
BATCH = 4


def _tokens(cfg, batch=BATCH, seed=0):
    rng = np.random.default_rng(seed)
    t = rng.integers(0, cfg.vocab_size, (batch, cfg.seq_len + 1)).astype(np.int32)
    return t[:, :-1], t[:, 1:]


def _max_rel_err(a, b):
    errs = jax.tree.map(lambda u, v: np.max(np.abs(u - v)) / (np.max(np.abs(v)) + 1e-12), a, b)
    return max(jax.tree.leaves(errs))


def _rel(a, b):
    u, v = (np.concatenate([x.ravel() for x in jax.tree.leaves(t)]) for t in (a, b))
    return np.linalg.norm(u - v) / np.linalg.norm(v)
