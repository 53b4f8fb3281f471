"""experiments.convergence_3d on a very small GPT: 2 steps of `none` on a data x pipe x tp
= 2 x 2 x 2 mesh, a finished `3d` run read back from its run dir (not trained again): the
JSON's fields, each row's codecs per axis, the paired row against none of the same seed."""
import json
import sysconfig
from pathlib import Path

from experiments import convergence_3d as c3
from train import config as config_lib

CORPUS = Path(sysconfig.get_paths()["stdlib"]) / "json"


def _tiny(cache):
    return ["model.vocab_size=512", "model.seq_len=32", "model.n_layer=2", "model.n_head=4",
            "model.d_model=32", f"data.paths=[{CORPUS}]", f"data.cache_dir={cache}",
            "data.val_fraction=0.1", "train.batch_size=4", "train.eval_every=0",
            "train.ckpt_every=0", "train.eval_batches=1", "optim.warmup_steps=1",
            "train.async_ckpt=false", "train.codec_error=false"]


def test_driver_json_pairs_and_read_back(tmp_path):
    runs, js = tmp_path / "runs", tmp_path / "c.json"
    done = runs / "3d@seed0"          # a finished run: read back, not trained
    done.mkdir(parents=True)
    (done / "summary.json").write_text(json.dumps({
        "interrupted": False, "step": 2, "final_val_loss": 6.5, "final_train_loss": 6.4,
        "step_time_s": 0.1, "platform": "cpu"}))
    (done / "metrics.jsonl").write_text('{"step": 1, "loss": 6.6}\n'
                                        '{"step": 2, "loss": 6.4, "val_loss": 6.5}\n')
    saved = c3.main(["--steps", "2", "--variants", "none", "3d", "--seeds", "0", "--out-dir",
                     str(runs), "--json", str(js), "--plot", "",
                     "--set", *_tiny(tmp_path / "cache")])
    assert saved == json.loads(js.read_text())
    assert {"device", "jax", "commit", "preset", "mesh", "microbatches", "steps", "codecs",
            "rows", "paired"} <= set(saved) and "unfinished" not in saved
    assert saved["mesh"] == "2x2x2" and saved["steps"] == 2
    rows = {r["variant"]: r for r in saved["rows"]}
    assert set(rows) == {"none", "3d"} and all(r["seed"] == 0 for r in rows.values())
    assert [rows["none"][f"codec_{a}"] for a in ("tp", "pp", "dp")] == ["none"] * 3
    assert [rows["3d"][f"codec_{a}"] for a in ("tp", "pp", "dp")] == ["taco", "tah4", "taco"]
    assert rows["3d"]["curve"]["val_loss"] == [6.5] and not (done / "config.yaml").exists()
    cfg = config_lib.read_yaml((runs / "none@seed0" / "config.yaml").read_text())
    assert (cfg["parallel"]["data"], cfg["parallel"]["pipe"], cfg["parallel"]["tp"]) == (2, 2, 2)
    assert cfg["recipe"]["codec_pp"] == "none" and cfg["train"]["steps"] == 2
    (p,) = saved["paired"]
    b = rows["none"]["final_val_loss"]
    assert p["config"] == "3d" and p["seeds"] == [0]
    assert abs(p["mean_pct"] - 100 * (6.5 - b) / b) < 1e-9
    # the overrides give each variant its codecs on the mesh
    cfg3d = config_lib.load_config("tiny", c3.overrides(
        "3d", {"tp": "taco", "pp": "tah4", "dp": "taco"}, 1,
        c3.build_parser().parse_args(["--mesh", "2,2,2"]), tmp_path))
    assert cfg3d.codecs() == {"fwd": "taco", "bwd": "taco", "head": "taco", "pp": "tah4",
                              "dp": "taco"} and cfg3d.train.seed == 1
