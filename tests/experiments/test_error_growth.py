"""experiments.error_growth: partial sums of a coarser TP size from a finer capture, the
compressed sums against their definition, and the error metrics, on synthetic tensors; and
the grouping on a real capture (emulated TP4 grouped in pairs = emulated TP2)."""
import math
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from codec_bounds import FACTOR, assert_blockwise_close, roundtrip_error
from experiments import error_growth as eg
from taco_jax import codecs

CORPUS = Path(sysconfig.get_paths()["stdlib"]) / "json"


def test_group_partials_sums_adjacent_members():
    x = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    g = eg.group_partials(x, 2)
    np.testing.assert_array_equal(g, np.stack([x[:4].sum(0), x[4:].sum(0)]))
    np.testing.assert_array_equal(eg.group_partials(x, 8), x)
    np.testing.assert_array_equal(eg.group_partials(x, 1)[0], x.sum(0))
    assert eg.group_partials(x.astype(np.float16), 4).dtype == np.float16
    with pytest.raises(ValueError, match="must divide"):
        eg.group_partials(x, 3)


@pytest.mark.parametrize("codec", ["block-fp8", "taco"])
def test_two_shot_matches_its_definition(codec):
    """The library's two-shot under vmap = own segment exact + the peers' decoded segments,
    quantized again (sizes that leave padding in the last segment). The reference rounds
    in another program, where a value on a rounding boundary (or taco's near-tie choice of
    scale) may go the other way: equal within the codec's error per block, relative to the
    magnitudes of the addends."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 700)).astype(np.float32)
    got = eg.compressed_sum(x, codec, "two_shot")
    want = eg.two_shot_reference(x, codec)
    exact = x.astype(np.float64).sum(0)
    assert np.linalg.norm(want - exact) > 1e-4 * np.linalg.norm(exact)     # lossy, really
    assert_blockwise_close(got, want, np.abs(x).sum(0), FACTOR * roundtrip_error(codec, x),
                           codecs.get(codec).block_size, lead=0, what=f"{codec} two-shot")
    one = eg.compressed_sum(x, codec, "one_shot")
    assert 0 < eg.rel_l2([(one, exact)])[0] < eg.rel_l2([(got, exact)])[0]   # one rounding


def test_exact_codec_and_metrics():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 512)).astype(np.float32)
    exact = x.astype(np.float64).sum(0)
    assert eg.rel_l2([(eg.compressed_sum(x, "none", "two_shot"), exact)])[0] < 1e-6
    err, worst = eg.rel_l2([(exact + 0.1 * exact, exact), (exact, exact)])
    assert err == pytest.approx(0.1 / math.sqrt(2)) and worst == pytest.approx(0.1)
    same = np.stack([x[0]] * 4)
    assert eg.spread([same]) == pytest.approx(0.5)                     # 1 / sqrt(P)
    orth = np.zeros((4, 4), np.float32)
    orth[np.arange(4), np.arange(4)] = 1.0
    assert eg.spread([orth]) == pytest.approx(1.0)
    cancel = np.stack([x[0], -x[0] + 1e-3 * x[1]])
    assert eg.spread([cancel]) > 100


def test_growth_rows_on_synthetic_sites():
    """Independent partials of fixed total size: a block codec's two-shot error stays near
    sqrt(2)·ε at every P; the per-tensor-scale codec's does not improve with P."""
    rng = np.random.default_rng(2)
    sites = {("fwd", 0): rng.standard_normal((8, 4, 256)).astype(np.float32),
             ("bwd", 0): rng.standard_normal((8, 4, 256)).astype(np.float32)}
    rows, spreads = eg.growth_rows(sites, [2, 4, 8], ["block-fp8"])
    assert {(r["kind"], r["p"], r["schedule"]) for r in rows} == {
        (k, p, s) for k in ("fwd", "bwd") for p in (2, 4, 8) for s in ("two_shot", "one_shot")}
    assert all(0.9 < s["spread"] < 1.1 for s in spreads)
    two = [r["rel_l2"] for r in rows if r["schedule"] == "two_shot"]
    assert max(two) / min(two) < 1.3


def test_grouped_capture_equals_the_coarser_capture(tmp_path):
    """A 1-layer GPT's TP4 partials (4 CPU devices), summed in adjacent pairs, are its TP2
    partials at every site, fwd and bwd: coarser TP sizes need no capture of their own.
    Emulated TP4 gives the mesh's fwd partials; its bwd taps hold the total on every
    member, which partials_are_distinct tells apart."""
    import jax
    from train import config as config_lib
    from train.data import Batches, load_corpus
    from train.loop import build, build_mesh
    cfg = config_lib.load_config("tiny", [
        "model.vocab_size=512", "model.seq_len=32", "model.n_layer=1", "model.n_head=4",
        "model.d_model=32", f"data.paths=[{CORPUS}]", f"data.cache_dir={tmp_path}",
        "train.batch_size=2", "parallel.tp=1", "parallel.data=1", "codec=none"])
    prog = build(cfg, build_mesh(cfg, jax.devices()[:1]))
    params = prog.init(0)["params"]
    corpus = load_corpus(cfg.data, cfg.model.vocab_size)
    x, y = Batches(corpus.train, 2, 32, 0)[0]
    four = eg.capture_partials(cfg, params, x, y, 4)
    two = eg.capture_partials(cfg, params, x, y, 2)
    assert set(four) == set(two) and {k for k, _ in four} == {"fwd", "bwd"}
    for key in four:
        assert four[key].shape[0] == 4 and two[key].shape[0] == 2
        assert eg.partials_are_distinct(four[key])
        np.testing.assert_allclose(eg.group_partials(four[key], 2), two[key], rtol=1e-4,
                                   atol=1e-5 * np.abs(two[key]).max())
    emulated = eg.capture_partials(cfg, params, x, y, 4, emulate=True)
    for key, v in emulated.items():
        if key[0] == "fwd":
            np.testing.assert_allclose(v, four[key], rtol=1e-4,
                                       atol=1e-5 * np.abs(v).max())
        else:
            assert not eg.partials_are_distinct(v)
            np.testing.assert_allclose(v[0], four[key].sum(0), rtol=1e-4,
                                       atol=1e-5 * np.abs(v[0]).max())
