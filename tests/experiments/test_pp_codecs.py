"""experiments.pp_codecs on a minuscule GPT (2 blocks of width 32, 2 stages): the captured
hand-offs are the stream between the blocks and its cotangent, and the rows and the
adaptive bit-width measurement hold together."""
import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from experiments import pp_codecs as pc
from taco_jax import codecs

CORPUS = Path(sysconfig.get_paths()["stdlib"]) / "json"


def test_driver_on_a_minuscule_pipeline(tmp_path):
    js = tmp_path / "pp.json"
    out = pc.main(["--steps", "0", "--microbatches", "2", "--codecs", "tah4",
                   "--json", str(js), "--set", "parallel.cpu_devices=8", "model.vocab_size=512", "model.seq_len=32",
                   "model.n_layer=2", "model.n_head=4", "model.d_model=32",
                   f"data.paths=[{CORPUS}]", f"data.cache_dir={tmp_path}",
                   "data.val_fraction=0.1", "train.batch_size=4", "optim.warmup_steps=1"])
    saved = json.loads(js.read_text())
    assert {"device", "jax", "commit", "config", "rows", "adaptive"} <= set(saved)
    cfg = saved["config"]
    assert cfg["stages"] == 2 and cfg["handoff_shape"] == [2, 32, 32]
    # one boundary, 2 micro-batches: 2 sends each way (bubble ticks and the last stage's
    # output left out)
    assert out["handoffs"] == {"fwd": 2, "bwd": 2}
    rows = {(r["codec"], r["kind"]): r for r in saved["rows"]}
    assert set(rows) == {("tah4", "fwd"), ("tah4", "bwd")}
    n = 2 * 32 * 32
    assert rows["tah4", "fwd"]["bits_per_value"] == 8 * codecs.get("tah4").wire_bytes(n) / n
    for r in rows.values():
        assert 1e-3 < r["rel_l2"] <= r["rel_l2_worst_tensor"] < 0.5
        assert 0 < r["max_abs_err_over_max"] < 1
    ad = [r for r in saved["adaptive"] if r["kind"] == "fwd" and r["criterion"] == "error"]
    assert [r["fraction"] for r in ad] == list(pc.FRACTIONS)
    summ = saved["adaptive_summary"]["fwd"]
    assert summ["unit_values"] == 128                     # d = 32: a group of 4 tokens
    assert ad[0]["rel_l2"] == pytest.approx(summ["tah4_rel_l2"])
    assert ad[0]["rel_l2"] == pytest.approx(rows["tah4", "fwd"]["rel_l2"], rel=1e-5)
    assert ad[-1]["rel_l2"] == pytest.approx(summ["high_rel_l2"])
    errs = [r["rel_l2"] for r in ad]
    assert errs == sorted(errs, reverse=True)             # more 8-bit units, less error
    assert all(r["rel_l2"] <= r["random_rel_l2"] + 1e-12 for r in ad)   # ranked vs random
    assert ad[0]["bits_per_value"] == pytest.approx(4.5 + 1 / 128)


def test_units_follow_the_channels():
    """d a multiple of 128: one token per unit; d below 128: one group of 128 / d tokens."""
    v = np.arange(2 * 3 * 256, dtype=np.float32).reshape(2, 3, 256)
    assert pc.units(v).shape == (6, 256)
    np.testing.assert_array_equal(pc.units(v)[4], v[1, 1])
    assert pc.units(v.reshape(2, 24, 32)).shape == (12, 128)
    with pytest.raises(ValueError, match="d_model=48"):
        pc.units(np.zeros((2, 48), np.float32))
