"""bench.gather_gemm on CPU: its plumbing with the jnp reference standing in for the kernel
(the kernel's own checks run on a GPU, the bench there); its checks fail, with a non-zero
exit and a one-line reason, on a deliberately wrong exchange, and the NaN-row check on a
result whose NaN went elsewhere; a shape the kernel does not cover is reported, not
failed; its shapes come from the presets; the kernel refuses to run off the GPU."""
from __future__ import annotations

import json
import re

import pytest

from bench import gather_gemm

SMALL = ["--impl", "emulated", "--isolate", "none", "--p", "2", "--shapes", "128x256x256",
         "--calls", "1", "--codecs", "echo4"]


def run(tmp_path, capsys, *extra):
    out = tmp_path / "checks.json"
    rc = gather_gemm.main([*SMALL, *extra, "--checks-out", str(out)])
    return rc, json.loads(out.read_text()), capsys.readouterr().out


def test_plumbing_with_the_reference_standing_in_for_the_kernel(tmp_path, capsys):
    """The bench's plumbing, not the kernel: --impl emulated runs the jnp reference, so its
    error equals the reference's by construction; what is checked is that the rows carry
    their fields and verdicts, and an uncovered shape (N = 384) is reported with its reason
    without failing the run."""
    rc, res, _ = run(tmp_path, capsys, "--shapes", "128x256x256", "128x256x384")
    assert rc == 0 and {"device", "jax", "commit", "sources", "rows"} <= set(res)
    ok, uncovered = res["rows"]
    assert {"codec", "p", "dtype", "shape", "ok", "sources", "fingerprint"} <= set(ok)
    assert ok["ok"] and ok["nan_rows_ok"] and ok["same_on_every_device"]
    assert 0 < ok["rel_err"] == ok["reference_rel_err"] < 0.2
    assert uncovered["ok"] is None and "N=384" in uncovered["reason"]


@pytest.mark.parametrize("wrong,reason", [
    ("slot", "results differ between virtual devices"),
    ("stale", "rel_err .* > its reference's")])
def test_checks_fail_on_a_wrong_exchange(tmp_path, capsys, wrong, reason):
    rc, res, out = run(tmp_path, capsys, "--wrong-exchange", wrong)
    assert rc == 1 and res["rows"][0]["ok"] is False
    last = out.strip().splitlines()[-1]
    assert last.startswith("bench.gather_gemm: FAILED echo4 P=2 128x256x256")
    assert re.search(reason, last)


@pytest.mark.parametrize("fault", ["lost", "spread", "partial"])
def test_the_nan_row_check_fails_where_the_nan_goes_elsewhere(fault):
    """check_call on a result whose NaN row is wrong: the NaN lost (a NaN block sent as
    zeros), spread to another row, or only part of its row NaN."""
    import jax
    import jax.numpy as jnp
    from taco_jax import codecs
    from taco_jax.kernels.gemm import gather_gemm as gg
    echo4 = codecs.get("echo4")
    xs, w, row = gather_gemm.make_inputs(jax.random.key(0), 2, 128, 256, 256)

    def reference(xs, w):
        return gg.gather_gemm_reference(xs, w, echo4)

    def wrong(xs, w):
        y = reference(xs, w)
        y = {"lost": jnp.nan_to_num(y),
             "spread": y.at[row + 1, 0].set(jnp.nan),
             "partial": jnp.where(jnp.isnan(y), 0.0, y).at[row, 0].set(jnp.nan)}[fault]
        return jnp.stack([y, y])                    # the same on both virtual devices
    figures, why = gather_gemm.check_call(wrong, reference, xs, w, row)
    assert figures["same_on_every_device"] and not figures["nan_rows_ok"]
    assert why.startswith("NaN outside the row")
    right = lambda xs, w: jnp.stack([reference(xs, w)] * 2)     # noqa: E731
    assert gather_gemm.check_call(right, reference, xs, w, row)[1] is None


def test_shapes_are_the_presets_column_parallel_gemms():
    from bench.gemm_codec import preset_dims
    d = preset_dims("350m")
    assert gather_gemm.gemm_shape("350m.qkv", 4) == (d["tokens"], d["d_model"],
                                                     3 * d["d_model"] // 4)
    assert gather_gemm.gemm_shape("350m.fc1", 8) == (d["tokens"], d["d_model"], d["d_ff"] // 8)
    assert gather_gemm.gemm_shape("odd", 3) == (64 * 37 * 3, 768, 768)
    with pytest.raises(SystemExit, match="nope"):
        gather_gemm.gemm_shape("350m.nope", 2)


def test_the_kernel_refuses_to_run_off_the_gpu(tmp_path):
    with pytest.raises(SystemExit, match="Hopper GPU"):
        gather_gemm.main(["--impl", "kernel", "--checks-out", str(tmp_path / "c.json")])


def test_fingerprint_names_the_lowered_module():
    """The rows' fingerprint: the kernel's module at the row's shape, lowered for CUDA here;
    another codec or shape, another module."""
    from taco_jax import codecs
    taco, echo4 = codecs.get("taco"), codecs.get("echo4")
    a = gather_gemm.fingerprint(taco, 2, 256, 256, 256)
    assert re.fullmatch(r"[0-9a-f]{12}", a) and a == gather_gemm.fingerprint(taco, 2, 256, 256,
                                                                              256)
    assert a != gather_gemm.fingerprint(echo4, 2, 256, 256, 256)
