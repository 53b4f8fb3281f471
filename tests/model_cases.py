"""What the model tests share: a tiny fp32 GPT config with odd sizes, its token batches, the
relative errors the tests compare with, and the comparison of two programs' lossy results."""
import jax
import numpy as np

import taco_jax
from models import parallel
from models.gpt import GPTConfig

from codec_bounds import FACTOR

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


def _within_codec_error(got, ref, exact):
    """got and ref are one lossy computation run by two programs (emulation and mesh, a fused
    op and its parts): a value on a rounding boundary (or a block's near-tie scale choice)
    may go either way in one of them, so they agree within the codec's error: a few times
    what compression itself changes (ref against exact). Each: (loss, grads, *logits)."""
    (l1, g1, *o1), (l0, g0, *o0), (le, ge, *oe) = got, ref, exact
    assert abs(l1 - l0) <= FACTOR * abs(l0 - le) + 1e-5 * l0, (l1, l0, le)
    assert _max_rel_err(g1, g0) <= FACTOR * _max_rel_err(g0, ge), (
        _max_rel_err(g1, g0), _max_rel_err(g0, ge))
    for a, b, e in zip(o1, o0, oe):       # logits
        assert np.abs(a - b).max() <= FACTOR * np.abs(b - e).max() + 1e-5, (
            np.abs(a - b).max(), np.abs(b - e).max())


def tp_sites_since(before: dict) -> set:
    """{(op, codec, compressed)} of the "tp" sites traced since the `before` counts."""
    return {(s.op, s.codec, s.compressed) for s, n in taco_jax.telemetry.sites()
            if n > before.get(s, 0) and s.axes == ("tp",)}


def traced_tp_sites(cfg, tp: int = 2) -> set:
    """The "tp" sites of one loss-and-gradient step of `cfg` at data x tp = 1 x tp, from an
    abstract trace (nothing compiles), under the recipe in effect."""
    mesh = parallel.make_mesh(1, tp)
    x = jax.ShapeDtypeStruct((BATCH, cfg.seq_len), np.int32,
                             sharding=jax.sharding.NamedSharding(mesh, parallel.BATCH_SPEC))
    model = parallel.shard_gpt(cfg, mesh)
    before = dict(taco_jax.telemetry.sites())
    jax.eval_shape(model.loss_and_grad_fn(), model.abstract_params(), x, x)
    return tp_sites_since(before)
