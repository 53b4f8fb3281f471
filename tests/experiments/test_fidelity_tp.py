"""experiments.fidelity_tp: the protocol's validation windows and standard errors, the
paired statistics against bf16 of the same seed, and the driver's rows (emulated TP,
resumable, worker processes), on a very small GPT."""
import json
import math
import statistics
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import scipy.stats

from experiments import fidelity_tp as ft

CORPUS = Path(sysconfig.get_paths()["stdlib"]) / "json"


def test_val_windows_cover_the_split_once_in_a_fixed_order():
    starts = ft.val_windows(10_000, 4, 64)
    n_windows = (10_000 - 1) // 64
    assert starts.shape == (n_windows // 4, 4)
    flat = starts.ravel()
    assert len(set(flat.tolist())) == flat.size               # no window twice
    assert np.all(flat % 64 == 0) and flat.max() + 64 + 1 <= 10_000   # inside, aligned
    np.testing.assert_array_equal(starts, ft.val_windows(10_000, 4, 64))   # fixed order
    assert not np.all(np.diff(flat) > 0)                      # dealt in a shuffled order
    np.testing.assert_array_equal(ft.val_windows(10_000, 4, 64, max_batches=3), starts[:3])
    x, y = ft.val_batch(np.arange(10_000), starts[0], 64)
    assert x.shape == y.shape == (4, 64) and x.dtype == np.int32
    np.testing.assert_array_equal(y[:, :-1], x[:, 1:])
    with pytest.raises(ValueError, match="fewer than one batch"):
        ft.val_windows(100, 4, 64)


def test_standard_errors_and_spread():
    losses = [3.0, 3.1, 2.9, 3.2, 2.8]
    want = 100 * statistics.stdev(losses) / math.sqrt(5) / 3.0
    assert ft.se_pct(losses) == pytest.approx(want)
    assert ft.se_pct([3.0]) is None
    # the same batches scored by a slightly worse model: the paired SE sees only the
    # differences, far below either model's own SE
    other = [v + 0.01 + d for v, d in zip(losses, [0.001, -0.001, 0.002, 0.0, -0.002])]
    d = [a - b for a, b in zip(other, losses)]
    assert ft.paired_se_pct(other, losses) == pytest.approx(
        100 * statistics.stdev(d) / math.sqrt(5) / 3.0)
    assert ft.paired_se_pct(other, losses) < ft.se_pct(losses) / 50
    assert ft.paired_se_pct(other, losses[:3]) is None
    assert ft.seed_spread_pct([3.0, 3.03, float("nan"), None]) == pytest.approx(
        100 * 0.03 / 3.015)
    assert ft.seed_spread_pct([3.0]) is None
    assert ft.seed_sd_pct([3.0, 3.03]) == pytest.approx(100 * statistics.stdev([3.0, 3.03])
                                                        / 3.015)


def _row(codec, seed, loss, batches=None):
    return {"variant": f"{codec}@seed{seed}", "codec": codec, "feedback": False,
            "seed": seed, "final_val_loss": loss, "val_batch_losses": batches}


def test_paired_rows_against_bf16_of_the_same_seed():
    base = {0: [2.0, 2.2], 1: [2.1, 2.3], 2: [1.9, 2.1]}
    rows = [_row("none", s, statistics.fmean(b), b) for s, b in base.items()]
    shift = {0: 0.010, 1: 0.004, 2: 0.007}
    rows += [_row("taco", s, statistics.fmean(b) + shift[s],
                  [v + shift[s] + (0.001 if i else -0.001) for i, v in enumerate(b)])
             for s, b in base.items()]
    rows += [_row("fp8", 0, float("nan")), _row("fp8", 1, 99.0),      # NaN, and > 2x none
             _row("taco-e5m2", 0, 2.2), _row("taco-e5m2", 1, float("nan"))]
    out = {e["config"]: e for e in ft.paired_rows(rows)}
    assert "none" not in out
    t = out["taco"]
    pct = [100 * shift[s] / statistics.fmean(base[s]) for s in (0, 1, 2)]
    assert t["n"] == 3 and t["seeds"] == [0, 1, 2] and t["diverged_seeds"] == []
    assert t["mean_pct"] == pytest.approx(statistics.fmean(pct))
    half = scipy.stats.t.ppf(0.95, 2) * statistics.stdev(pct) / math.sqrt(3)
    assert t["ci90_pct"] == pytest.approx([t["mean_pct"] - half, t["mean_pct"] + half])
    se = [ft.paired_se_pct(r["val_batch_losses"], base[r["seed"]]) for r in rows
          if r["codec"] == "taco"]
    assert t["eval_se_pct"] == pytest.approx(statistics.fmean(se))
    assert out["fp8"]["n"] == 0 and out["fp8"]["mean_pct"] is None
    assert out["fp8"]["diverged_seeds"] == [0, 1]
    e5 = out["taco-e5m2"]
    assert e5["n"] == 1 and e5["ci90_pct"] is None and e5["diverged_seeds"] == [1]


def test_run_order_pairs_first():
    names = [v["name"] for v in ft.run_order(["taco", "none", "fp8"], [0, 1])]
    assert names == ["none@seed0", "taco@seed0", "fp8@seed0",
                     "none@seed1", "taco@seed1", "fp8@seed1"]


def test_deal_in_contiguous_groups_of_near_equal_length():
    runs = ft.run_order(["none", "taco"], [0, 1, 2])
    groups = [[v["name"] for v in g] for g in ft.deal(runs, 3)]
    assert groups == [["none@seed0", "taco@seed0"], ["none@seed1", "taco@seed1"],
                      ["none@seed2", "taco@seed2"]]
    five = [[v["name"] for v in g] for g in ft.deal(runs[:5], 2)]
    assert five == [["none@seed0", "taco@seed0", "none@seed1"], ["taco@seed1", "none@seed2"]]
    assert [len(g) for g in ft.deal(runs, 8)] == [1] * 6


def _tiny(cache):
    return ["model.vocab_size=512", "model.seq_len=32", "model.n_layer=1", "model.n_head=4",
            "model.d_model=32", f"data.paths=[{CORPUS}]", f"data.cache_dir={cache}",
            "data.val_fraction=0.1", "train.batch_size=4", "train.eval_every=0",
            "train.ckpt_every=0", "train.eval_batches=1", "optim.warmup_steps=1",
            "train.async_ckpt=false", "train.codec_error=false", "train.log_every=1"]


KEYS = {"device", "jax", "commit", "tp", "emulated", "preset", "steps", "tokens_seen",
        "corpus_tokens", "bf16_seed_spread_pct", "rows", "paired"}


def test_driver_rows_and_resume(tmp_path, capsys):
    """none and taco at emulated TP2 for 2 steps in two worker processes (their rows
    merged): the JSON has the protocol's fields, each row its score over the validation
    windows (scored from the final checkpoint, equal to train's own evaluation of the same
    batches); a second call trains and scores nothing; a row whose run dir is gone (made
    elsewhere) is kept."""
    js = tmp_path / "f.json"
    args = ["--tp", "2", "--preset", "tiny", "--steps", "2", "--codecs", "none", "taco",
            "--seeds", "0", "--eval-batches", "3", "--out-dir",
            str(tmp_path / "runs"), "--json", str(js), "--plot", str(tmp_path / "f.png"),
            "--set", *_tiny(tmp_path / "cache")]
    out = ft.main([*args, "--workers", "2"])
    saved = json.loads(js.read_text())
    assert KEYS <= set(saved)
    assert saved["tp"] == 2 and saved["emulated"] is True and saved["steps"] == 2
    assert saved["tokens_seen"] == 2 * 4 * 32 and saved["corpus_tokens"] > saved["tokens_seen"]
    assert saved["val_batches"] == 3 and saved["val_tokens"] == 3 * 4 * 32
    rows = {r["variant"]: r for r in saved["rows"]}
    assert set(rows) == {"none@seed0", "taco@seed0"}
    for r in rows.values():
        assert {"codec", "seed", "final_val_loss"} <= set(r)
        assert len(r["val_batch_losses"]) == 3 and r["val_se_pct"] > 0
        assert r["final_val_loss"] == pytest.approx(statistics.fmean(r["val_batch_losses"]),
                                                    rel=1e-5)
        assert r["wall_s"] > 0
    assert rows["taco@seed0"]["codec"] == "taco" and rows["taco@seed0"]["seed"] == 0
    assert [e["config"] for e in saved["paired"]] == ["taco"]
    p = saved["paired"][0]
    assert {"config", "seeds", "n", "mean_pct", "ci90_pct"} <= set(p)
    assert p["n"] == 1 and p["seeds"] == [0] and p["ci90_pct"] is None
    cfg = (tmp_path / "runs" / "taco@seed0" / "config.yaml").read_text()
    assert "emulate_tp: 2" in cfg and "min_bytes: 0" in cfg
    assert (tmp_path / "f.png").stat().st_size > 0
    assert (tmp_path / "f_paired.png").stat().st_size > 0
    # resumable: nothing trained or scored again
    capsys.readouterr()
    again = ft.main(args)
    assert "training in" not in capsys.readouterr().out
    assert [r["final_val_loss"] for r in again["rows"]] == [r["final_val_loss"]
                                                            for r in out["rows"]]
    # a row made on another machine (no run dir here) stays
    import shutil
    shutil.rmtree(tmp_path / "runs" / "taco@seed0")
    kept = ft.main(args)
    assert "training in" not in capsys.readouterr().out
    assert [r["variant"] for r in kept["rows"]] == ["none@seed0", "taco@seed0"]


def test_driver_budget_stops_before_a_run_it_cannot_finish(tmp_path, capsys):
    """A finished row (made elsewhere) took an hour; with 30 s left the next run of that
    codec is not started: the JSON keeps the row and `unfinished` names the rest."""
    from train import config as config_lib
    over = _tiny(tmp_path / "cache")
    cfg = config_lib.load_config("tiny", [*over, "parallel.tp=0", "parallel.data=1",
                                          "parallel.emulate_tp=2"])
    js = tmp_path / "f.json"
    row = {**_row("none", 0, 6.0, [6.1, 5.9]), "wall_s": 3600.0}
    js.write_text(json.dumps({"preset": "tiny", "steps": 2, "tp": 2, "emulated": True,
                              "corpus": ft.corpus_facts(cfg)["corpus"], "rows": [row]}))
    capsys.readouterr()
    out = ft.main(["--tp", "2", "--preset", "tiny", "--steps", "2", "--codecs", "none",
                   "--seeds", "0", "1", "--budget-s", "30", "--out-dir",
                   str(tmp_path / "runs"), "--json", str(js), "--plot", "",
                   "--eval-batches", "2", "--set", *over])
    log = capsys.readouterr().out
    assert "not started" in log and "training in" not in log
    assert out["unfinished"] == ["none@seed1"]
    assert [r["variant"] for r in json.loads(js.read_text())["rows"]] == ["none@seed0"]


def test_fidelity_preset_decays_to_its_end_and_fits_tp8():
    """The protocol's preset: its last update runs at min_lr (= lr / 100, the cosine spans
    train.steps), it splits over TP 2, 4 and 8, and every all-reduce is compressed."""
    from train import config as config_lib
    from train.loop import make_optimizer
    cfg = config_lib.load_config("fidelity", ["parallel.emulate_tp=8"])
    _, schedule = make_optimizer(cfg)
    steps, o = cfg.train.steps, cfg.optim
    assert o.min_lr == pytest.approx(o.lr / 100)
    assert float(schedule(steps - 1)) == pytest.approx(o.min_lr, rel=1e-3)   # last update
    assert float(schedule(o.warmup_steps)) == pytest.approx(o.lr)
    for tp in (2, 4, 8):
        cfg.model.validate(tp=tp)
    assert cfg.recipe.min_bytes == 0 and cfg.train.codec_error is False
    assert cfg.data.shuffle_files and cfg.data.max_mb > 0
