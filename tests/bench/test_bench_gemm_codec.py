"""bench.gemm_codec on CPU: its plumbing with the jnp reference standing in for the kernels
(the kernels' own checks run on a GPU: tests/kernels/test_gpu_gemm_codec.py, or the bench
there); its checks fail, with a non-zero exit and a one-line reason, on a deliberately wrong
exchange, and the NaN-row check on a result whose NaN went elsewhere; its shapes come from
the presets; the kernels refuse to run off the GPU."""
from __future__ import annotations

import json

import pytest

from bench import gemm_codec

SMALL = ["--impl", "emulated", "--isolate", "none", "--p", "2", "--shapes", "128x64x512",
         "--calls", "1", "--codecs", "echo4"]


def run(tmp_path, capsys, *extra):
    out = tmp_path / "checks.json"
    rc = gemm_codec.main([*SMALL, *extra, "--checks-out", str(out)])
    return rc, json.loads(out.read_text()), capsys.readouterr().out


def test_plumbing_with_the_reference_standing_in_for_the_kernels(tmp_path, capsys):
    """The bench's plumbing, not the kernels: --impl emulated runs the jnp reference, so its
    error equals the reference's by construction; what is checked is that both exchanges
    run, and the rows carry their fields and verdicts."""
    rc, res, _ = run(tmp_path, capsys)
    assert rc == 0 and {"device", "jax", "commit", "sources", "rows"} <= set(res)
    rows = {r["exchange"]: r for r in res["rows"]}
    assert set(rows) == {"all", "owner"}
    for row in rows.values():
        assert {"codec", "p", "dtype", "shape", "ok", "sources"} <= set(row)
        assert row["ok"] and row["nan_rows_ok"]
        assert 0 < row["rel_err"] == row["reference_rel_err"] < 0.2
    assert rows["all"]["same_on_every_device"] and rows["owner"]["shards_are_the_all_reduce"]


@pytest.mark.parametrize("wrong,exchange,reason", [
    ("slot", "all", "results differ between virtual devices"),
    ("slot", "owner", "the owners' rows are not the all-reduce's"),
    ("stale", "all", "rel_err .* > its reference's")])
def test_checks_fail_on_a_wrong_exchange(tmp_path, capsys, wrong, exchange, reason):
    import re
    rc, res, out = run(tmp_path, capsys, "--wrong-exchange", wrong, "--exchanges", exchange)
    assert rc == 1 and not res["rows"][0]["ok"]
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"bench.gemm_codec: FAILED echo4 P=2 {exchange}")
    assert re.search(reason, last)


@pytest.mark.parametrize("fault", ["lost", "spread", "partial"])
def test_the_nan_row_check_fails_where_the_nan_goes_elsewhere(fault):
    """check_call on a result whose NaN row is wrong: the NaN lost (an encoder that sends a
    NaN block as zeros), spread to another row, or only part of its row NaN."""
    import jax
    import jax.numpy as jnp
    from taco_jax import codecs
    from taco_jax.kernels import gemm
    echo4 = codecs.get("echo4")
    xs, ws, res, row = gemm_codec.make_inputs(jax.random.key(0), 2, 128, 64, 256)

    def reference(xs, ws, r):
        return gemm.gemm_allreduce_reference(xs, ws, r, echo4)

    def wrong(xs, ws, r):
        y = reference(xs, ws, r)
        y = {"lost": jnp.nan_to_num(y),
             "spread": y.at[row + 1, 0].set(jnp.nan),
             "partial": jnp.where(jnp.isnan(y), 0.0, y).at[row, 0].set(jnp.nan)}[fault]
        return jnp.stack([y, y])                    # the same on both virtual devices
    figures, why = gemm_codec.check_call(wrong, reference, xs, ws, res, row)
    assert figures["same_on_every_device"] and not figures["nan_rows_ok"]
    assert why.startswith("NaN outside the row")
    right = lambda xs, ws, r: jnp.stack([reference(xs, ws, r)] * 2)     # noqa: E731
    assert gemm_codec.check_call(right, reference, xs, ws, res, row)[1] is None


def test_shapes_are_the_presets_row_parallel_gemms():
    dims = gemm_codec.preset_dims("350m")
    assert gemm_codec.gemm_shape("350m.attn_out", 8) == (dims["tokens"], dims["d_model"] // 8,
                                                         dims["d_model"])
    assert gemm_codec.gemm_shape("350m.mlp_out", 2) == (dims["tokens"], dims["d_ff"] // 2,
                                                        dims["d_model"])
    assert gemm_codec.gemm_shape("odd", 4) == gemm_codec.ODD
    assert gemm_codec.gemm_shape("odd", 8, "owner") == gemm_codec.ODD_OWNER
    assert gemm_codec.gemm_shape("192x320x768", 2) == (192, 320, 768)
    with pytest.raises(SystemExit, match="nope"):
        gemm_codec.gemm_shape("350m.nope", 2)


def test_the_kernels_refuse_to_run_off_the_gpu(tmp_path):
    with pytest.raises(SystemExit, match="Hopper GPU"):
        gemm_codec.main(["--impl", "kernel", "--checks-out", str(tmp_path / "c.json")])


def test_gemm_config_pairs_apply_over_the_default():
    from taco_jax.kernels.gemm import GemmConfig
    assert gemm_codec.gemm_config(None, 256) is None
    assert gemm_codec.gemm_config(["pingpong=true", "steps=2"], 256) == GemmConfig(
        pingpong=True, steps=2)
    assert gemm_codec.gemm_config(["tile_k=32"], 192) == GemmConfig(wgs=1, tile_k=32)
    with pytest.raises(SystemExit, match="not a GemmConfig field"):
        gemm_codec.gemm_config(["nope=1"], 256)
    with pytest.raises(SystemExit, match="wgs=1"):            # M = 192: one warpgroup
        gemm_codec.gemm_config(["pingpong=true"], 192)


def test_a_group_that_does_not_finish_fails_at_its_fingerprint(monkeypatch):
    """A crashed or timed-out child's rows fail against the modules they stand for, so the
    checked table (which counts the rows at the fingerprints emitted now) cannot admit the
    kernel past them; without a fingerprint they would not count at all."""
    import argparse
    monkeypatch.setattr(gemm_codec, "child_rows", lambda cmd, limit, root: ([], "timed out"))
    monkeypatch.setattr(gemm_codec, "row_fingerprint",
                        lambda impl, codec, p, exchange, config=None: f"fp-{exchange}-{p}")
    a = argparse.Namespace(impl="kernel", gemm_config=None, exchanges=["all", "owner"],
                           shapes=["odd"], timeout=1.0, isolate="group", calls=1, time=False,
                           wrong_exchange=None)
    rows = gemm_codec.run_children(a, [("taco", 2)])
    assert [(r["exchange"], r["ok"], r["reason"], r["fingerprint"]) for r in rows] == [
        ("all", False, "timed out", "fp-all-2"), ("owner", False, "timed out", "fp-owner-2")]
