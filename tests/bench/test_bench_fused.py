"""bench.fused on CPU: its checks pass on a faithful jnp model of the kernel's exchange and
fail, with a non-zero exit and a one-line reason, on a deliberately wrong one; the kernel
itself refuses to run off the GPU; the projection's arithmetic."""
from __future__ import annotations

import json

import jax.numpy as jnp
import pytest

from bench import fused as bench_fused
from taco_jax import codecs

SMALL = ["--sizes", "1KiB", "3KiB+5", "--dtypes", "bf16", "--calls", "2",
         "--isolate", "group", "--impl", "emulated"]


def run(tmp_path, capsys, *extra, p="2"):
    out = tmp_path / "fused.json"
    rc = bench_fused.main(["--p", p, *SMALL, *extra, "--out", str(out)])
    return rc, json.loads(out.read_text()), capsys.readouterr().out


def test_checks_pass_on_a_faithful_exchange(tmp_path, capsys):
    rc, res, _ = run(tmp_path, capsys, p="3")
    assert rc == 0 and len(res["rows"]) == 2
    assert {"device", "jax", "commit", "rows"} <= set(res)
    for r in res["rows"]:
        assert {"p", "mib", "dtype", "kernel", "same_on_every_device", "rel_err",
                "xla_rel_err"} <= set(r)
        assert r["ok"] and r["same_on_every_device"] and r["nan_blocks_ok"]
        assert 0 < r["rel_err"] <= r["xla_rel_err"] < 0.1


@pytest.mark.parametrize("wrong,reason", [("slot", "results differ between virtual devices"),
                                          ("stale", "NaN where the input was finite|rel_err")])
def test_checks_fail_on_a_wrong_exchange(tmp_path, capsys, wrong, reason):
    import re
    rc, res, out = run(tmp_path, capsys, "--wrong-exchange", wrong)
    assert rc == 1 and not any(r["ok"] for r in res["rows"])
    last = out.strip().splitlines()[-1]
    assert last.startswith("bench.fused: FAILED P=2") and re.search(reason, last)


def test_stale_slot_fails_on_the_error(tmp_path, capsys):
    """A slot holding an earlier call's bytes, on every device alike, on inputs too small
    for non-finite blocks: the error check fires."""
    out = tmp_path / "fused.json"
    rc = bench_fused.main(["--p", "2", "--sizes", "1KiB", "--dtypes", "f32", "--calls", "1",
                           "--impl", "emulated", "--wrong-exchange", "stale", "--out",
                           str(out)])
    assert rc == 1
    assert "rel_err" in capsys.readouterr().out.strip().splitlines()[-1]
    row = json.loads(out.read_text())["rows"][0]
    assert row["worst_tiles"] and row["worst_tiles"][0]["err"] > row["worst_tiles"][0][
        "gate_err"]


def test_worst_tiles_name_the_wrong_tile_and_its_segment():
    """A failed check says where the error is: tile 5 of 8 at P = 4 (segments of 2 tiles)
    is segment 2, its tile 1."""
    import jax.numpy as jnp
    import numpy as np
    rng = np.random.default_rng(0)
    exact = jnp.asarray(rng.standard_normal(8 * bench_fused.TILE - 100).astype(np.float32))
    gold = exact + 0.01 * jnp.asarray(rng.standard_normal(exact.shape).astype(np.float32))
    y = gold.at[5 * bench_fused.TILE + 7].add(3.0)
    finite = jnp.ones(exact.shape, bool)
    got = bench_fused.worst_tiles(y, gold, exact, finite, p=4)
    assert [(t["tile"], t["segment"], t["in_segment"]) for t in got] == [(5, 2, 1)]
    assert bench_fused.worst_tiles(gold, gold, exact, finite, p=4) == []


def test_the_kernel_refuses_to_run_off_the_gpu(tmp_path, all_checked):
    for impl in ("kernel", "mesh"):
        with pytest.raises(SystemExit, match="cannot run here"):
            bench_fused.main(["--impl", impl, "--out", str(tmp_path / "no.json")])


def test_a_timeout_is_a_failure_with_its_reason(tmp_path, capsys):
    rc, res, out = run(tmp_path, capsys, "--timeout", "0.01")
    assert rc == 1 and all("timed out" in r["reason"] for r in res["rows"])


def test_projection_arithmetic():
    row = {"p": 2, "mib": 16.0, "bytes": 16 << 20, "dtype": "bf16", "ok": True,
           "per_device_us": 30.0, "compress_us": 10.0, "decode_sum_us": 15.0}
    got = bench_fused.project(row, 264, link_gbps=350.0, fixed_us=15.0)
    wire_us = (16 << 20) // 2 // 256 * 264 / 350e3
    assert got["wire_us_nvlink"] == pytest.approx(wire_us, abs=0.01)
    assert got["projected_us_nvlink"] == pytest.approx(15 + max(30, wire_us), abs=0.01)
    assert got["projected_three_launch_us_nvlink"] == pytest.approx(15 + 25 + wire_us,
                                                                    abs=0.01)
    assert got["projected_ratio_nvlink"] == pytest.approx(
        got["projected_us_nvlink"] / bench_fused.lax_psum_us(16.0), abs=1e-3)
    assert bench_fused.project({**row, "p": 4}, 264) == {}
    for r in bench_fused.method_check(264):
        assert r["projected_us"] == pytest.approx(30 + r["xla_kernels_us"] + r["link_us"],
                                                  abs=0.02)


@pytest.mark.parametrize("text,n", [("1KiB", 1024), ("1MiB+5", (1 << 20) + 5),
                                    ("4096", 4096), ("0.5GiB", 1 << 29)])
def test_sizes_parse(text, n):
    assert bench_fused.parse_size(text) == n


def test_mesh_mode_checks_and_times_the_transport(monkeypatch):
    """--impl mesh's own logic (sharding, checks, timing against lax.psum) on CPU devices,
    the fused transport's three-launch schedule with lax in place of its exchange kernel."""
    import argparse

    from meshes import lax_exchange_kernel
    from taco_jax.collectives import fused
    monkeypatch.setattr(fused, "_platform_reason", lambda: None)
    monkeypatch.setattr(fused, "one_launch_reason", lambda codec, p, dtype: "emulated")
    monkeypatch.setattr(fused, "exchange_kernel", lax_exchange_kernel)
    a = argparse.Namespace(codec="taco", one_p=2, one_bytes=8 * 1024, one_dtype="bf16",
                           impl="mesh", wrong_exchange=None, calls=2, time=True,
                           config=None)
    row = bench_fused.run_config(a)
    assert row["ok"] and row["same_on_every_device"] and row["kernel"] == "one_launch on GPUs"
    # the three-launch one-shot quantizes once: less error than the xla two-shot
    assert row["rel_err"] < row["xla_rel_err"]
    assert row["fused_us"] > 0 and row["lax_psum_us"] > 0 and row["measured_ratio"] > 0


def test_config_pairs_name_fused_config_fields():
    cfg = bench_fused.fused_config(["decode=sum_first", "programs=8"])
    assert cfg.decode == "sum_first" and cfg.programs == 8 and cfg.parts == 2
    with pytest.raises(SystemExit, match="'steps=2': not a FusedConfig field"):
        bench_fused.fused_config(["steps=2"])
    assert bench_fused.fused_config([]) is None            # the kernel's own default
    assert bench_fused.fused_config(["store_parts=true"]).store_parts is True
    assert bench_fused.fused_config(["store_parts=0"]).store_parts is False
    with pytest.raises(SystemExit, match="store_parts takes true or false"):
        bench_fused.fused_config(["store_parts=yes"])


def test_config_pairs_apply_over_the_kernels_default():
    """Knobs and fields given on the command line change the launch shape the collectives
    would use, not another one; the two-shot's base is FusedConfig()."""
    import dataclasses

    import jax.numpy as jnp
    from taco_jax import codecs
    from taco_jax.kernels import fused as fa
    taco = codecs.get("taco")
    knob = bench_fused.fused_config(["ablate=no_decode"], taco, 4, jnp.bfloat16)
    assert knob == dataclasses.replace(fa.default_config(taco, 4, jnp.bfloat16),
                                          ablate="no_decode")
    assert knob.per_sm == 2 and knob.store_parts and knob.decode == "sum_first"
    assert bench_fused.fused_config(["parts=1"], taco, 2, jnp.bfloat16).warp_specialized
    # the warp-specialized P = 2 default takes no knob: named with it, the reason
    with pytest.raises(SystemExit, match="ablate=no_decode at P=2: .*warp_specialized"):
        bench_fused.fused_config(["ablate=no_decode"], taco, 2, jnp.bfloat16)
    one_wg = bench_fused.fused_config(bench_fused.ONE_WG + ["own_from_smem=false"], taco, 2,
                                      jnp.bfloat16)
    assert not one_wg.own_from_smem and not one_wg.warp_specialized and one_wg.per_sm == 2
    with pytest.raises(SystemExit, match="per_sm=5 at P=2: .*must be 1, 2, 3 or 4"):
        bench_fused.fused_config(["per_sm=5"], taco, 2, jnp.bfloat16)
    assert not bench_fused.fused_config(["parts=1"], taco, 4, jnp.bfloat16).own_from_smem
    assert bench_fused.fused_config(["ablate=no_decode"], taco, 2, jnp.float32).per_sm == 1
    two = bench_fused.fused_config(["programs=8"], taco, 4, jnp.bfloat16, "two_shot")
    assert two == dataclasses.replace(fa.two_shot_config(taco, jnp.bfloat16), programs=8)
    assert two.per_sm == 2


def test_ablation_table_takes_differences_to_the_default():
    rows = [{"p": 2, "dtype": "bf16", "mib": 16.0, "variant": "default", "ok": True,
             "per_device_us": 40.0, "separate_us": 25.0},
            {"p": 2, "dtype": "bf16", "mib": 16.0, "variant": "no_sync", "checked": False,
             "ok": True, "per_device_us": 30.0},
            {"p": 2, "dtype": "bf16", "mib": 16.0, "variant": "encode_twice",
             "checked": False, "ok": True, "per_device_us": 48.0},
            {"p": 2, "dtype": "bf16", "mib": 64.0, "variant": "no_sync", "checked": False,
             "ok": True, "per_device_us": 90.0},           # no default at 64 MiB
            {"p": 2, "dtype": "bf16", "mib": 16.0, "variant": "one_warpgroup", "ok": False,
             "reason": "timed out after 90 s"}]
    got = {(r["mib"], r["variant"]): r for r in bench_fused.ablation_table(rows)}
    assert got[16.0, "default"]["delta_us"] == 0.0
    assert got[16.0, "default"]["vs_separate"] == pytest.approx(1.6)
    assert got[16.0, "no_sync"]["delta_us"] == -10.0
    assert got[16.0, "no_sync"]["delta_frac"] == pytest.approx(-0.25)
    assert got[16.0, "encode_twice"]["delta_us"] == 8.0
    assert "delta_us" not in got[64.0, "no_sync"]
    assert not got[16.0, "one_warpgroup"]["ok"] and "delta_us" not in got[16.0,
                                                                          "one_warpgroup"]
    assert all(r["estimates"] for r in got.values())


def test_every_variant_names_fused_config_fields():
    from taco_jax.kernels import fused as fused_kernels
    taco = codecs.get("taco")
    for name, (pairs, _) in bench_fused.VARIANTS.items():     # as --ablate runs them
        cfg = (bench_fused.fused_config(pairs, taco, 2, jnp.bfloat16)
               or fused_kernels.FusedConfig())
        assert (cfg.ablate != "none") == name.startswith(("no_", "encode_", "decode_"))
    knobs = {(bench_fused.fused_config(pairs, taco, 2, jnp.bfloat16)
              or fused_kernels.FusedConfig()).ablate
             for pairs, _ in bench_fused.VARIANTS.values()}
    assert knobs == set(fused_kernels.ABLATIONS)          # every knob is timed


def test_ablate_times_variants_and_checks_only_the_unablated(tmp_path, capsys):
    """--ablate end to end on CPU (the jnp model in place of the kernel; host timer): one
    child per variant, the knob variants timed unchecked, the table of differences."""
    out = tmp_path / "ablate.json"
    rc = bench_fused.main(["--ablate", "--impl", "emulated", "--sizes", "1KiB",
                           "--variants", "one_warpgroup", "no_sync", "--base", "one_warpgroup",
                           "--out", str(out)])
    res = json.loads(out.read_text())
    assert rc == 0 and res["config"] == "ablation"
    rows = {r["variant"]: r for r in res["rows"]}
    base = rows["one_warpgroup"]
    assert base["checked"] and base["same_on_every_device"]
    assert not rows["no_sync"]["checked"] and "rel_err" not in rows["no_sync"]
    assert rows["no_sync"]["config"] == " ".join(bench_fused.ONE_WG + ["ablate=no_sync"])
    assert "separate_us" in base and "separate_us" not in rows["no_sync"]
    table = {r["variant"]: r for r in res["ablation"]}
    assert table["no_sync"]["delta_us"] == pytest.approx(
        rows["no_sync"]["per_device_us"] - base["per_device_us"], abs=0.02)
    assert "per-device time of each variant" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--variants, not --config"):
        bench_fused.main(["--ablate", "--impl", "emulated", "--config", "parts=1"])
    with pytest.raises(SystemExit, match="--base default is not among --variants"):
        bench_fused.main(["--ablate", "--impl", "emulated", "--variants", "no_sync"])


@pytest.mark.parametrize("wrong,reason", [(None, None),
                                          ("slot", "results differ between virtual devices"),
                                          ("stale", "NaN where the input was finite|rel_err")])
def test_two_shot_checks_pass_on_its_model_and_fail_on_a_wrong_exchange(tmp_path, capsys,
                                                                        wrong, reason):
    import re
    extra = ["--kernel", "two_shot"] + (["--wrong-exchange", wrong] if wrong else [])
    rc, res, out = run(tmp_path, capsys, *extra, p="3")
    assert all(r["kernel"] == "emulated_two_shot" for r in res["rows"])
    if wrong is None:
        assert rc == 0 and all(r["ok"] and "reference_rel_err" in r for r in res["rows"])
        assert all(r["rel_err"] == r["reference_rel_err"] for r in res["rows"])
    else:
        assert rc == 1 and not any(r["ok"] for r in res["rows"])
        assert re.search(reason, out.strip().splitlines()[-1])


def test_two_shot_times_beside_the_three_launch_two_shots_kernels(tmp_path, capsys):
    """--time on the two-shot: its loopback time and, beside it, the xla transport's
    kernels for one device (compress of what it sends, the owner's reduce, decompress)."""
    rc, res, _ = run(tmp_path, capsys, "--kernel", "two_shot", "--time", "--sizes", "96KiB",
                     p="3")
    assert rc == 0
    for r in res["rows"]:
        assert r["per_device_us"] > 0 and "decode_sum_us" not in r
        parts = [r["compress_us"], r["reduce_us"], r["decompress_us"]]
        assert all(v > 0 for v in parts)
        assert r["separate_us"] == pytest.approx(sum(parts), abs=0.02)


def test_two_shot_is_a_loopback_only_and_takes_no_knobs(tmp_path):
    with pytest.raises(SystemExit, match="leave --kernel out|cannot run here"):
        bench_fused.main(["--kernel", "two_shot", "--impl", "mesh", "--out",
                          str(tmp_path / "no.json")])
    with pytest.raises(SystemExit, match="one-shot kernel's variants"):
        bench_fused.main(["--ablate", "--kernel", "two_shot", "--impl", "emulated"])


def test_fail_fast_runs_nothing_after_a_timeout(tmp_path, capsys):
    out = tmp_path / "ff.json"
    rc = bench_fused.main(["--p", "2", "3", "--sizes", "1KiB", "--dtypes", "bf16",
                           "--calls", "1", "--impl", "emulated", "--timeout", "0.01",
                           "--fail-fast", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert rc == 1 and len(rows) == 2
    assert "timed out" in rows[0]["reason"]
    assert rows[1]["reason"].startswith("not run: P=2 bf16 timed out")


# -- --codec echo4 (the one-launch kernel with echo4's tile math) ----------------------------
@pytest.mark.parametrize("p", ["2"])
def test_echo4_checks_pass_on_its_model_against_the_xla_transports_echo4(tmp_path, capsys,
                                                                        p):
    """The model encodes f32 as it is (echo4 has no bf16 operand); the gate is the xla
    transport with echo4 (4-bit: errors of ~0.1, not the FP8 codecs' few percent)."""
    rc, res, _ = run(tmp_path, capsys, "--codec", "echo4", "--dtypes", "bf16", "f32", p=p)
    assert rc == 0 and res["codec"] == "echo4" and len(res["rows"]) == 4
    for r in res["rows"]:
        assert r["ok"] and r["same_on_every_device"] and r["nan_blocks_ok"]
        assert 0.05 < r["rel_err"] <= r["xla_rel_err"] < 0.3
    assert res["method_check"] == []           # the method's check is taco's, B = 256


@pytest.mark.parametrize("wrong", ["slot", "stale"])
def test_echo4_checks_fail_on_a_wrong_exchange(tmp_path, capsys, wrong):
    rc, res, out = run(tmp_path, capsys, "--codec", "echo4", "--wrong-exchange", wrong)
    assert rc == 1 and not any(r["ok"] for r in res["rows"])
    assert out.strip().splitlines()[-1].startswith("bench.fused: FAILED P=2")


def test_unchecked_codecs_not_on_a_mesh(tmp_path):
    """--impl mesh runs the collectives: it refuses a codec, P and dtype for which they do
    not select the one-launch kernel (its checks have not passed for the modules it emits now),
    naming what is missing."""
    from fused_lowering import assumed_checked
    one_shot = [("one_shot", "echo4", "bfloat16"), ("one_shot", "echo4", "float32")]
    with assumed_checked(one_shot):
        with pytest.raises(SystemExit, match="not select the one-launch kernel for echo4.*"
                                             "two_shot bf16, two_shot f32"):
            bench_fused.main(["--codec", "echo4", "--impl", "mesh", "--p", "4", "--out",
                              str(tmp_path / "no.json")])
        with pytest.raises(SystemExit, match="needs a Hopper GPU"):      # past the check
            bench_fused.main(["--codec", "echo4", "--impl", "mesh", "--p", "2", "--out",
                              str(tmp_path / "no.json")])
    with assumed_checked(()), pytest.raises(SystemExit, match="for echo4.*one_shot bf16"):
        bench_fused.main(["--codec", "echo4", "--impl", "mesh", "--out",
                          str(tmp_path / "no.json")])


def check_row(kernel="one_launch", p=2, dtype="bf16", ok=True, fp="f1", **kw):
    return {"kernel": kernel, "p": p, "dtype": dtype, "ok": ok, "calls": 5,
            "fingerprint": fp, "config": "default", "variant": "default", **kw}


def test_checked_table_holds_the_triples_whose_rows_at_the_fingerprints_all_pass(tmp_path):
    """A (kernel, codec, dtype) is checked where its loopback rows at the fingerprints
    emitted now all pass and one ran where the collectives take the kernel; rows of other
    fingerprints or none, of the mesh, of another launch, of a measurement knob or off the
    GPU do not count. The table keeps each P's fingerprint."""
    rows = [check_row(codec="taco"), check_row(codec="taco", p=4, fp="f4"),
            check_row(codec="taco", dtype="f32"),
            check_row(codec="taco", dtype="f32", p=8, ok=False),          # one failure
            check_row(codec="echo4", p=4),                                  # not at P = 2
            check_row("one_launch_two_shot", p=3, codec="echo4"),
            check_row("one_launch_two_shot", p=3, codec="taco", fp="f0"),
            check_row("one_launch_two_shot", p=4, codec="taco", fp=None),   # before prints
            check_row("one_launch on GPUs", codec="taco", dtype="f16"),     # the mesh
            check_row(codec="taco", dtype="f16", config="parts=1"),
            check_row(codec="taco", dtype="f16", variant="no_sync", checked=False)]
    path = tmp_path / "fused_checks.json"
    path.write_text(json.dumps({"platform": "gpu", "codec": "taco", "rows": rows}))
    (tmp_path / "fused_cpu.json").write_text(json.dumps({"platform": "cpu", "rows": rows}))
    got = bench_fused.check_rows([str(path), str(tmp_path / "fused_cpu.json")])
    assert len(got) == 8 and {r["file"] for r in got} == {"fused_checks.json"}
    now = {(r["kernel"], r["codec"], r["dtype"], r["p"]): "f1" for r in got}
    assert bench_fused.checked_table(got, now) == {
        ("one_shot", "taco", "bfloat16"): ((2, "f1"),),
        ("two_shot", "echo4", "bfloat16"): ((3, "f1"),)}
    now[("one_shot", "taco", "bfloat16", 4)] = "f4"          # both of taco's rows current
    now[("two_shot", "taco", "bfloat16", 3)] = "f0"
    assert bench_fused.checked_table(got, now) == {
        ("one_shot", "taco", "bfloat16"): ((2, "f1"), (4, "f4")),
        ("two_shot", "echo4", "bfloat16"): ((3, "f1"),),
        ("two_shot", "taco", "bfloat16"): ((3, "f0"),)}
    now[("one_shot", "taco", "bfloat16", 2)] = "changed"      # its module changed since:
    assert ("one_shot", "taco", "bfloat16") not in bench_fused.checked_table(got, now)


def test_write_checked_rewrites_the_table_only(tmp_path, capsys, monkeypatch):
    """--write-checked keeps checked.py up to its table and writes JAX (the installed jax)
    and CHECKED (the triples whose rows pass at the fingerprints emitted now) after it."""
    import jax
    from taco_jax.kernels.fused import checked
    monkeypatch.setattr(checked, "fingerprint", lambda k, c, d, p: f"{k}-{c.name}-{d}-{p}")
    path = tmp_path / "checked.py"
    path.write_text(open(bench_fused.CHECKED_PY).read())
    rows = [{"kernel": "two_shot", "codec": "echo4", "dtype": "float16", "p": 5, "ok": True,
             "fingerprint": "two_shot-echo4-float16-5", "file": "x"},
            {"kernel": "two_shot", "codec": "taco", "dtype": "float16", "p": 5, "ok": True,
             "fingerprint": "stale", "file": "x"}]
    table = {("two_shot", "echo4", "float16"): ((5, "two_shot-echo4-float16-5"),)}
    assert bench_fused.write_checked(str(path), rows) == table
    text = path.read_text()
    head = open(bench_fused.CHECKED_PY).read().split(bench_fused.TABLE_MARK)[0]
    assert text.startswith(head) and text.endswith(bench_fused.table_text(
        jax.__version__, table))
    scope = {}
    exec(text.split(bench_fused.TABLE_MARK)[1].split("\n", 1)[1], scope)
    assert scope["JAX"] == jax.__version__ and scope["CHECKED"] == table
    assert "1 (kernel, codec, dtype) checked" in capsys.readouterr().out


def test_echo4_two_shot_checks_pass_on_its_model(tmp_path, capsys):
    """echo4 through the two-shot: its jnp reference (segments of whole tiles, the owner's
    f32 sum encoded once) is what the checks gate on."""
    out = tmp_path / "echo4.json"
    rc = bench_fused.main(["--kernel", "two_shot", "--codec", "echo4", "--p", "3", "--sizes",
                           "3KiB+5", "--dtypes", "bf16", "--calls", "2", "--impl", "emulated",
                           "--out", str(out)])
    res = json.loads(out.read_text())
    capsys.readouterr()
    assert rc == 0 and len(res["rows"]) == 1
    for r in res["rows"]:
        assert r["ok"] and r["kernel"] == "emulated_two_shot"
        assert r["rel_err"] == r["reference_rel_err"] and 0.05 < r["rel_err"] < 0.3


def test_echo4_projection_counts_its_wire():
    """72 bytes per 128 values: 16 MiB of bf16 is 65536 groups, 4.5 MiB of wire."""
    row = {"p": 2, "mib": 16.0, "bytes": 16 << 20, "dtype": "bf16", "ok": True,
           "per_device_us": 30.0, "compress_us": 10.0, "decode_sum_us": 15.0}
    got = bench_fused.project(row, 72, link_gbps=350.0, fixed_us=15.0, block=128)
    assert got["wire_us_nvlink"] == pytest.approx((16 << 20) // 2 // 128 * 72 / 350e3,
                                                  abs=0.01)
    assert bench_fused.annotate({"rows": [row]}, 72, 128)["rows"][0]["wire_us_nvlink"] \
        == got["wire_us_nvlink"]


def test_ablation_table_takes_differences_to_the_base_named():
    rows = [{"p": 2, "dtype": "bf16", "mib": 16.0, "variant": v, "ok": True,
             "per_device_us": us} for v, us in [("default", 25.0), ("one_warpgroup", 30.0),
                                                 ("no_sync", 27.0)]]
    got = {r["variant"]: r for r in bench_fused.ablation_table(rows, "one_warpgroup")}
    assert got["no_sync"]["delta_us"] == -3.0 and got["default"]["delta_us"] == -5.0


def measured_rows(monkeypatch, rel_err: float = 0.1):
    """bench.fused's runs without their child processes: each configuration a passing row
    (the --update and --missing bookkeeping does not depend on what a check measured)."""
    def children(a, configs, save=lambda rows: None):
        rows = [{"p": p, "mib": round(n / bench_fused.MIB, 6), "bytes": n, "dtype": d,
                 "config": "default", "variant": "default", "ok": True, "reason": None,
                 "kernel": bench_fused.row_label(a.impl, a.kernel), "calls": a.calls,
                 "rel_err": rel_err} for p, n, d in configs]
        save(rows)
        return rows
    monkeypatch.setattr(bench_fused, "run_children", children)


def test_update_keeps_the_other_codecs_rows_and_replaces_its_own(tmp_path, capsys,
                                                                 monkeypatch):
    """--update: one file holds both codecs' two-shot rows, each with its codec and commit;
    measuring a codec again replaces its rows, never the other's (nor another size's)."""
    measured_rows(monkeypatch)
    out = tmp_path / "two.json"
    base = ["--kernel", "two_shot", "--p", "3", "--dtypes", "bf16", "--calls", "1",
            "--isolate", "group", "--impl", "emulated", "--out", str(out)]
    assert bench_fused.main([*base, "--sizes", "1KiB", "3KiB+5", "--codec", "taco"]) == 0
    doc = json.loads(out.read_text())
    assert all(r["codec"] == "taco" and r["commit"] == doc["commit"] for r in doc["rows"])
    echo = [{**r, "codec": "echo4", "rel_err": 0.5} for r in doc["rows"]]
    out.write_text(json.dumps({**doc, "rows": doc["rows"] + echo}))
    assert bench_fused.main([*base, "--sizes", "1KiB", "--codec", "taco", "--update"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert sorted((r["codec"], r["bytes"]) for r in rows) == [
        ("echo4", 1024), ("echo4", 3077), ("taco", 1024), ("taco", 3077)]
    assert [r["rel_err"] for r in rows if r["codec"] == "echo4"] == [0.5, 0.5]
    capsys.readouterr()


def test_update_runs_side_by_side_keep_each_others_rows(tmp_path, monkeypatch, capsys):
    """Two --update runs into one file at once (another dtype each): every write re-reads
    the file under its lock, so a row the other run wrote after this one began stays."""
    measured_rows(monkeypatch)
    out = tmp_path / "two.json"
    base = ["--kernel", "two_shot", "--p", "3", "--calls", "1", "--isolate", "group",
            "--impl", "emulated", "--sizes", "1KiB", "--codec", "taco", "--out", str(out),
            "--update"]
    children = bench_fused.run_children

    def interleaved(a, configs, save):       # the f32 run writes while bf16's is running
        rows = children(a, configs, save)
        if a.dtypes == ["bf16"]:
            assert bench_fused.main([*base, "--dtypes", "f32"]) == 0
        return rows
    monkeypatch.setattr(bench_fused, "run_children", interleaved)
    assert bench_fused.main([*base, "--dtypes", "bf16"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert sorted(r["dtype"] for r in rows) == ["bf16", "f32"]
    assert (tmp_path / "two.json.lock").exists()
    capsys.readouterr()


def test_update_cut_short_keeps_the_rows_it_did_not_reach():
    """A run stopped by its time limit has written the rows it measured; the earlier rows
    of the configurations it had not reached yet stay in the file."""
    old = {"codec": "taco", "commit": "a" * 40,
           "rows": [{"p": 7, "bytes": b, "dtype": "f32", "rel_err": 0.1} for b in (1, 2)]}
    done = {bench_fused.row_key({"p": 7, "bytes": 1, "dtype": "f32"})}
    kept = bench_fused.kept_rows(old, "taco", done, "default")
    assert [(r["bytes"], r["commit"]) for r in kept] == [(2, "a" * 40)]
    assert len(bench_fused.kept_rows(old, "echo4", done, "default")) == 2
    assert len(bench_fused.kept_rows(old, "taco", done, "ablate=no_gather")) == 2
    assert bench_fused.kept_rows(None, "taco", done, "default") == []


def test_missing_runs_only_what_has_not_passed_at_these_fingerprints(tmp_path, capsys,
                                                                  monkeypatch):
    """--missing resumes a matrix: a configuration whose row of the same kernel passed at
    the same fingerprint (none for the jnp model) and as many calls is skipped; one at
    another fingerprint runs again."""
    measured_rows(monkeypatch)
    out = tmp_path / "two.json"
    base = ["--kernel", "two_shot", "--p", "3", "--dtypes", "bf16", "--calls", "1",
            "--isolate", "group", "--impl", "emulated", "--sizes", "1KiB", "--codec",
            "taco", "--out", str(out), "--update"]
    assert bench_fused.main(base) == 0
    doc = json.loads(out.read_text())
    assert [r["sources"] for r in doc["rows"]] == [doc["sources"]]
    assert "fingerprint" not in doc["rows"][0]           # the jnp model emits no module
    capsys.readouterr()
    assert bench_fused.main([*base, "--missing"]) == 0
    assert "1 configurations already passed" in capsys.readouterr().out
    assert json.loads(out.read_text()) == doc
    assert bench_fused.main([*base, "--missing", "--calls", "2"]) == 0      # more calls
    assert "0 configurations already passed" in capsys.readouterr().out
    assert bench_fused.main([*base[2:], "--missing"]) == 0                   # the one-shot
    assert "0 configurations already passed" in capsys.readouterr().out
    kernels = [r["kernel"] for r in json.loads(out.read_text())["rows"]]
    assert sorted(kernels) == ["emulated", "emulated_two_shot"]             # both kept
    doc = json.loads(out.read_text())
    out.write_text(json.dumps({**doc, "rows": [{**r, "fingerprint": "0" * 12}
                                                for r in doc["rows"]]}))
    assert bench_fused.main([*base, "--missing"]) == 0                  # another module
    assert "0 configurations already passed" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--missing"):
        bench_fused.main([*base[:-1], "--missing"])                          # no --update
