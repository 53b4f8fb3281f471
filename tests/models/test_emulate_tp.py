"""Emulated tensor parallelism (parallel.emulate_tp): the GPT on a ("data",) mesh with its TP
shards under jax.vmap computes what it computes on a real TP mesh, losses and gradients,
exact (to fp32 rounding) and compressed (within the codec's error); and a short training run
matches step by step."""
import dataclasses

import jax
import numpy as np
import pytest

import train
from models import parallel
from models.gpt import GPTConfig
from train import config as config_lib

from codec_bounds import FACTOR
from model_cases import CFG, _max_rel_err, _tokens, _within_codec_error
from run_cases import _overrides


def _run(cfg, data, tp, emulate, logits=True):
    if emulate:
        mesh = parallel.make_emulation_mesh(data)
        model = parallel.shard_gpt(cfg, mesh, emulate_tp=tp)
    else:
        mesh = parallel.make_mesh(data, tp)
        model = parallel.shard_gpt(cfg, mesh)
    params = model.init(0)
    x, y = (parallel.put_batch(a, mesh) for a in _tokens(cfg))
    loss, grads = jax.jit(model.loss_and_grad_fn())(params, x, y)
    if not logits:
        return float(loss), jax.device_get(grads)
    return float(loss), jax.device_get(grads), np.asarray(jax.jit(model.logits_fn())(params, x))


@pytest.mark.parametrize("codec,data,tp", [("none", 2, 2), ("taco", 1, 4)])
def test_emulated_tp_equals_the_mesh(codec, data, tp):
    cfg = dataclasses.replace(CFG, codec_fwd=codec, codec_bwd=codec, min_bytes=0)
    loss0, grads0, logits0 = _run(cfg, data, tp, emulate=False)
    loss1, grads1, logits1 = _run(cfg, data, tp, emulate=True)
    if codec == "none":
        assert abs(loss1 - loss0) <= 1e-5 * loss0, (loss1, loss0)
        assert _max_rel_err(grads1, grads0) < 1e-4
        np.testing.assert_allclose(logits1, logits0, rtol=1e-5, atol=1e-5)
        return
    loss_e, grads_e, logits_e = _run(dataclasses.replace(cfg, codec_fwd="none",
                                                         codec_bwd="none"), data, tp,
                                     emulate=True)
    _within_codec_error((loss1, grads1, logits1), (loss0, grads0, logits0),
                        (loss_e, grads_e, logits_e))
    assert _max_rel_err(grads1, grads_e) > 1e-3   # compressed, really: differs from exact


def test_emulated_sequence_parallel_equals_the_mesh():
    """model.sequence_parallel emulated: each member embeds its part of the sequence and the
    all-gathers and reduce-scatters run over the vmapped members, fused with their matmuls
    too (model.tp_overlap); loss and gradients equal the mesh's (codec none: fp32
    rounding)."""
    cfg = dataclasses.replace(CFG, n_layer=1, sequence_parallel=True)
    loss0, grads0 = _run(cfg, 2, 2, emulate=False, logits=False)
    for emulated in (cfg, dataclasses.replace(cfg, tp_overlap=True, min_bytes=0)):
        loss1, grads1 = _run(emulated, 2, 2, emulate=True, logits=False)
        assert abs(loss1 - loss0) <= 1e-5 * loss0, (loss1, loss0)
        assert _max_rel_err(grads1, grads0) < 1e-4


def test_emulated_error_feedback_equals_the_mesh():
    """Echo's error feedback, forward and backward sites, emulated: the per-member states
    and the compressed backward sums are the mesh's, and feedback really acts (the
    gradients differ from echo4's without it)."""
    cfg = dataclasses.replace(CFG, codec_fwd="echo4", codec_bwd="echo4", min_bytes=0,
                              feedback=True, feedback_bwd=True)
    loss0, grads0 = _run(cfg, 2, 2, emulate=False, logits=False)
    loss1, grads1 = _run(cfg, 2, 2, emulate=True, logits=False)
    exact = _run(dataclasses.replace(cfg, codec_fwd="none", codec_bwd="none", feedback=False,
                                     feedback_bwd=False), 2, 2, emulate=True, logits=False)
    _within_codec_error((loss1, grads1), (loss0, grads0), exact)
    _, plain = _run(dataclasses.replace(cfg, feedback=False, feedback_bwd=False), 2, 2,
                    emulate=True, logits=False)
    assert _max_rel_err(grads1, plain) > 1e-2


def test_emulated_training_matches_the_mesh_step_by_step(tmp_path):
    """4 steps of the tiny GPT with taco: losses at every step as on a 2-device TP mesh,
    within the codec's error."""
    cache = tmp_path / "cache"
    rows = {}
    for name, extra in (("mesh", ["parallel.data=1", "parallel.tp=2"]),
                        ("emulated", ["parallel.data=1", "parallel.tp=0",
                                      "parallel.emulate_tp=2"]),
                        ("exact", ["parallel.data=1", "parallel.tp=2", "codec=none"])):
        cfg = config_lib.load_config("tiny", _overrides(cache, tmp_path / name, *extra,
                                                        "train.steps=4", "train.codec_error=false"))
        summary = train.run(cfg)
        assert summary["mesh"]["tp"] == 2
        rows[name] = [r["loss"] for r in
                      train.metrics.read_jsonl(tmp_path / name / "metrics.jsonl")]
    # two programs: within the codec's error (a few times what compression changes), not
    # bit for bit
    emulated, mesh, exact = (np.asarray(rows[k]) for k in ("emulated", "mesh", "exact"))
    assert len(emulated) == len(mesh) == 4
    effect = np.abs(mesh - exact).max()
    assert effect > 0                               # taco compresses in this preset
    np.testing.assert_allclose(emulated, mesh, rtol=2e-5, atol=FACTOR * effect)


def test_emulation_config_errors():
    with pytest.raises(ValueError, match="parallel.tp=2"):
        config_lib.load_config("tiny", ["parallel.emulate_tp=4", "parallel.tp=2"])
    with pytest.raises(ValueError, match="emulate_tp=-1"):
        config_lib.load_config("tiny", ["parallel.emulate_tp=-1"])
    with pytest.raises(ValueError, match="must be"):
        parallel.shard_gpt(CFG, parallel.make_mesh(1, 2), emulate_tp=2)
