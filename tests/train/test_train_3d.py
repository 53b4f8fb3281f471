"""train/ on a (data, pipe, tp) mesh: the parallel.* options and the per-axis codecs parse
and fail clearly, `codec=X` sets every axis, a compressed run on data x pipe x tp = 2 x 2 x 2
reports its pipeline and resumes from a checkpoint bit for bit, and bench.train_step
compares compression per axis on that mesh."""
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

import taco_jax
import train
from train import config as config_lib
from train.checkpoint import Checkpointer
from train.metrics import read_jsonl

from run_cases import _overrides, cache  # noqa: F401 (cache: the shared corpus fixture)

AXES = ("fwd", "bwd", "head", "pp", "dp")


def test_codec_shorthand_sets_every_axis():
    assert config_lib.load_config("tiny", ["codec=none"]).codecs() == dict.fromkeys(AXES, "none")
    cfg = config_lib.load_config("tiny", ["codec=tah4", "recipe.codec_dp=taco-int8"])
    assert cfg.codecs() == {**dict.fromkeys(AXES, "tah4"), "dp": "taco-int8"}
    # the tiny preset: TP sites follow recipe.codec, pipeline too (null), gradients exact
    assert config_lib.load_config("tiny").codecs() == {**dict.fromkeys(AXES, "taco"),
                                                        "dp": "none"}
    cfg = config_lib.load_config("tiny", ["recipe.codec_pp=tah4", "recipe.codec_dp=null"])
    assert cfg.codecs()["pp"] == "tah4" and cfg.codecs()["dp"] == "taco"  # null = recipe.codec
    assert config_lib.RecipeConfig().codec_dp == "none"


@pytest.mark.parametrize("overrides,match", [
    (["parallel.pipe=3"], r"model.n_layer=4 is not divisible by parallel.pipe=3"),
    (["parallel.pipe=0"], r"parallel.pipe=0 must be >= 1"),
    (["parallel.microbatches=2"], r"parallel.microbatches=2 splits the batch for the "
                                  r"pipeline, but parallel.pipe=1"),
    (["parallel.pipe=2", "parallel.microbatches=0"], r"parallel.microbatches=0 must be >= 1"),
    (["parallel.pipe=2", "parallel.emulate_tp=2"],
     r"parallel.emulate_tp=2 emulates TP on a data-only mesh; it cannot be combined with "
     r"parallel.pipe=2"),
    (["parallel.pipe=2", "codec=echo4", "model.feedback=true"],
     r"model.feedback=True is not supported with parallel.pipe=2"),
    (["recipe.codec_pp=tah5"], r"recipe.codec_pp='tah5'"),
    (["recipe.codec_dp=int3"], r"recipe.codec_dp='int3'"),
    (["parallel.data=-1"], r"parallel.data=-1 must be >= 0"),
    (["parallel.schedule=zb"], r"parallel.schedule='zb' must be one of \('gpipe', '1f1b'\)"),
])
def test_bad_3d_configs_fail_clearly(overrides, match):
    with pytest.raises(ValueError, match=match):
        config_lib.load_config("tiny", overrides)


def test_3d_config_too_big_or_uneven():
    cfg = config_lib.load_config("tiny", ["parallel.data=2", "parallel.pipe=4", "parallel.tp=2"])
    with pytest.raises(ValueError, match="mesh data=2 x pipe=4 x tp=2 needs 16 devices but "
                                         "only 8"):
        train.loop.build_mesh(cfg)
    cfg = config_lib.load_config("tiny", ["parallel.data=2", "parallel.pipe=2", "parallel.tp=2",
                                          "parallel.microbatches=3"])
    with pytest.raises(ValueError, match=r"train.batch_size=8 gives 4 sequences per data shard "
                                         r"\(data=2\), which parallel.microbatches=3 does not"):
        train.build(cfg, train.loop.build_mesh(cfg))
    mesh = train.loop.build_mesh(config_lib.load_config("tiny", ["parallel.data=0",
                                                                 "parallel.pipe=2",
                                                                 "parallel.tp=2"]))
    assert dict(mesh.shape) == {"data": 2, "pipe": 2, "tp": 2}


def test_3d_run_resumes_bit_exactly(cache, tmp_path):  # noqa: F811
    """4 steps on 2 x 2 x 2 with the stage hand-offs compressed (tah4), checkpoints at 2
    and 4. The run resumed from step 2 repeats steps 3 and 4 and ends with the same
    parameters and optimizer state, bit for bit."""
    run_dir = tmp_path / "full"
    extra = ["model.n_layer=2", "parallel.pipe=2", "parallel.microbatches=2", "codec=none",
             "recipe.codec_pp=tah4", "train.steps=4", "train.ckpt_every=2",
             "train.eval_every=0", "train.codec_error=false", "parallel.cpu_devices=8"]
    cfg = config_lib.load_config("tiny", _overrides(cache, run_dir, *extra))
    full = train.run(cfg)
    assert full["mesh"] == {"data": 2, "pipe": 2, "tp": 2, "emulated_tp": False}
    assert full["microbatches"] == 2 and full["bubble_fraction"] == pytest.approx(1 / 3)
    assert full["step_memory"]["temp"] > 0 and full["sequence_parallel"] is False
    assert (full["codec_fwd"], full["codec_pp"], full["codec_dp"]) == ("none", "tah4", "none")
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert all(np.isfinite(r["loss"]) for r in rows) and rows[-1]["loss"] < rows[0]["loss"]
    # the one compressed site: the hand-off of a (1, 32, 32) fp32 micro-batch, once per
    # tick (3 ticks), forward and back
    assert full["sites"]["compressed"] == 3
    assert full["wire_bytes_per_step"] > 2 * 3 * taco_jax.codecs.get("tah4").wire_bytes(1024)

    resumed_dir = tmp_path / "resumed"
    shutil.copytree(run_dir, resumed_dir)
    shutil.rmtree(resumed_dir / "ckpt" / "4")
    cfg = config_lib.load_config("tiny", _overrides(cache, resumed_dir, *extra))
    out = train.run(cfg, resume=True)
    assert out["resumed_from"] == 2 and out["step"] == 4 and not out["interrupted"]
    got = read_jsonl(resumed_dir / "metrics.jsonl")
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert [(r["loss"], r["grad_norm"]) for r in got] == [(r["loss"], r["grad_norm"])
                                                          for r in rows]
    like = train.build(cfg, train.loop.build_mesh(cfg)).abstract_state()
    finals = []
    for d in (run_dir, resumed_dir):
        ck = Checkpointer(d / "ckpt")
        finals.append(ck.restore(4, like)[0])
        ck.close()
    assert jax.tree.structure(finals[0]) == jax.tree.structure(like)
    jax.tree.map(np.testing.assert_array_equal, *finals)


def test_bench_compares_axes_on_a_3d_mesh(tmp_path):
    """python -m bench.train_step --mesh 2,2,2: no compression and the pipeline compressed,
    side by side, each row with its tokens/s, bubble fraction and step memory; the other
    variants' codecs per axis (set as config overrides, nothing compiled)."""
    from bench import train_step
    out = tmp_path / "train_step.json"
    train_step.main(["--presets", "tiny", "--mesh", "2,2,2", "--microbatches", "2",
                     "--variants", "none", "pp", "--steps", "1", "--out", str(out),
                     "--set", "model.n_layer=2", "model.d_model=32", "model.vocab_size=512",
                     "model.seq_len=32", "train.batch_size=4", "parallel.cpu_devices=8"])
    rows = {r["variant"]: r for r in json.loads(Path(out).read_text())["rows"]}
    none, pp = rows["none"], rows["pp"]
    for r in (none, pp):
        assert r["mesh"] == "2x2x2" and r["microbatches"] == 2
        assert r["bubble_fraction"] == pytest.approx(1 / 3, abs=1e-4) and r["tokens_per_s"] > 0
        assert r["temp_mib"] > 0 and r["sequence_parallel"] is False
    assert none["compressed_sites"] == 0 and none["speedup_vs_none"] == 1.0
    assert (pp["codec_tp"], pp["codec_pp"], pp["codec_dp"]) == ("none", "tah4", "none")
    assert pp["compressed_sites"] == 3            # the hand-off, once per tick
    assert 0 < pp["wire_mib_per_step"] < none["wire_mib_per_step"]

    def codecs(variant):
        spec, sp, _ = train_step.split_variant(variant)
        plan = train_step.variant_codecs(spec, "taco", "tah4", "taco-int8")
        cfg = config_lib.load_config("tiny", train_step.variant_overrides(variant, plan))
        return cfg.codecs(), cfg.model.sequence_parallel, cfg.recipe.min_bytes

    assert codecs("3d") == ({**dict.fromkeys(("fwd", "bwd", "head"), "taco"), "pp": "tah4",
                             "dp": "taco-int8"}, False, 0)
    assert codecs("dp+pp+sp@default") == ({**dict.fromkeys(("fwd", "bwd", "head"), "none"),
                                           "pp": "tah4", "dp": "taco-int8"}, True, None)
    assert codecs("fp8")[0] == dict.fromkeys(AXES, "fp8")
    assert codecs("sp") == (dict.fromkeys(AXES, "none"), True, 0)
