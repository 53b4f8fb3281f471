"""bench.projection on CPU: the projection's arithmetic on hand-made kernel times, its
P = 2 two-shot equal to bench.fused.method_check's, the program on the committed JSON, and
its inputs read from a small results dir of hand-made files (each missing or corrupt one
named)."""
from __future__ import annotations

import json
import pathlib
import re

import pytest

from bench import fused
from bench import projection as proj
from taco_jax import codecs

ROOT = pathlib.Path(__file__).resolve().parents[2]

ECHO4 = codecs.get("echo4")
N16 = 16 * proj.MIB // 2                      # bf16 values in 16 MiB
W16 = N16 // 128 * 72                         # echo4: 72-byte rows per 128 values
HAND = {"echo4": {16: {"compress": 10.0, "decode_sum": 20.0, "reduce": 40.0,
                       "decompress": 5.0, "source": "hand"}}}


def rows(link_gbps, ps=(2, 4)):
    return {r["p"]: r for r in proj.project_rows(HAND, {"echo4": ECHO4}, {"l": link_gbps},
                                                 sizes=(16,), ps=ps, fixed_us=15.0,
                                                 lax_psum=lambda mib: None)}


def test_wire_bound_by_hand():
    r = rows(100.0)                            # 100 GB/s = 1e5 bytes per µs
    one, two = r[2]["echo4"], r[4]["echo4"]
    assert one["wire_bytes"] == W16 == 4718592
    assert one["compute_us"] == 30.0 and one["bound"] == "wire"
    assert one["one_launch_us"] == pytest.approx(15 + W16 / 1e5, abs=0.01)
    assert one["separate_us"] == pytest.approx(15 + 30 + W16 / 1e5, abs=0.01)
    assert r[2]["bf16"]["us"] == pytest.approx(15 + 2 * N16 / 1e5, abs=0.01)
    # two-shot at P = 4: 3/4 compress + reduce / 2 + decompress; 2 · 3/4 of the wire, twice
    assert two["compute_us"] == pytest.approx(0.75 * 10 + 20 + 5)
    assert two["wire_bytes"] == 1.5 * W16
    assert two["one_launch_us"] == pytest.approx(15 + 1.5 * W16 / 1e5, abs=0.01)
    assert two["separate_us"] == pytest.approx(30 + 32.5 + 1.5 * W16 / 1e5, abs=0.01)
    assert r[4]["bf16"]["us"] == pytest.approx(15 + 1.5 * 2 * N16 / 1e5, abs=0.01)
    assert r[2]["echo4_vs_bf16"] == round(one["one_launch_us"] / r[2]["bf16"]["us"], 3)


def test_compute_bound_by_hand():
    one = rows(1000.0, ps=(2,))[2]["echo4"]    # wire 4.7 µs < 30 µs of kernels
    assert one["bound"] == "compute" and one["one_launch_us"] == pytest.approx(45.0)


def test_missing_kernel_is_a_gap_not_a_number():
    r = proj.project_rows({"echo4": {16: {"compress": 1.0}}}, {"echo4": ECHO4}, {"l": 50.0},
                          sizes=(16,), ps=(2,), lax_psum=lambda mib: None)[0]
    assert r["echo4"] is None and "decode_sum" in r["echo4_missing"]


def test_owner_reduce_takes_the_larger_model():
    assert proj.owner_reduce_us(40.0, 2, 72, 128) == 20.0
    by_bytes = (8 * 72 / 128 + 2) / (8 * (2 * 72 / 128 + 2))
    assert by_bytes < 0.5 and proj.owner_reduce_us(40.0, 8, 72, 128) == 20.0


def test_two_shot_at_p2_is_the_checked_method():
    """The serial two-shot at P = 2, 350 GB/s, is what bench.fused.method_check projects
    for the xla transport (and checks against two H200s)."""
    times, _ = proj.kernel_times()
    taco = codecs.get("taco")
    checks = fused.method_check(taco.row_bytes)
    assert checks
    for c in checks:
        t = proj.two_shot(taco, times["taco"][c["mib"]], c["mib"], 2, fused.LINK_GBPS,
                          fused.FIXED_US)
        assert t["separate_us"] == pytest.approx(c["projected_us"], abs=0.02)


def test_program_on_the_committed_results(tmp_path, capsys):
    out = tmp_path / "projection.json"
    assert proj.main(["--out", str(out)]) == 0
    assert "PROJECTED" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["projected"] is True and res["device"] == "NVIDIA H200"
    assert all(f["commit"] and f["jax"] for f in res["inputs"].values())
    committed = json.loads((ROOT / "bench/results/kernels.json").read_text())
    assert res["inputs"]["kernels"]["commit"] == committed["commit"]
    assert len(res["rows"]) == len(proj.PS) * len(proj.SIZES_MIB) * 4
    echo4 = res["kernel_times_us"]["echo4"]
    assert sorted(echo4, key=float) == [f"{m:g}" for m in proj.SIZES_MIB]
    for t in echo4.values():                   # kernels.json's echo4 rows at every size
        assert t == {**{k: t[k] for k in proj.ECHO4_KERNELS},
                     "source": f"kernels.json@{committed['commit'][:7]}"}
    device_us = {(r["kernel"], f"{r['mib']:g}"): r["device_us"] for r in committed["rows"]
                 if r.get("codec") == "echo4" and r.get("impl") == "triton"}
    for (kernel, mib), us in device_us.items():
        if kernel in proj.ECHO4_KERNELS:
            assert echo4[mib][kernel] == pytest.approx(us, abs=0.006), (kernel, mib)
    fk = res["fused_kernel_per_device_us"]
    loop = json.loads((pathlib.Path(proj.RESULTS) / "fused_loopback.json").read_text())
    assert [fk["taco"][f"{r['mib']:g}"] for r in loop["rows"]] == [
        r["per_device_us"] for r in loop["rows"]]
    assert fk["taco"]["source"].startswith("fused_loopback.json")
    assert fk["echo4"]["source"].startswith("fused_echo4_loopback.json")
    for r in res["rows"]:
        e = r["echo4"]
        assert e is not None                   # echo4 has every kernel at every size
        n = r["mib"] * proj.MIB // 2
        wire = (1 if r["p"] == 2 else 2 * (r["p"] - 1) / r["p"]) * n // 128 * 72
        assert e["wire_bytes"] == pytest.approx(wire)
        assert e["one_launch_us"] >= 15 + wire / r["link_gbps"] / 1e3 - 0.01
        assert e["one_launch_us"] <= e["separate_us"]
        assert r["echo4_vs_bf16"] >= 72 / 256  # never below the byte ratio
        nvls = r["bf16_nvls"]["us"]                # NVLS at P = 8 only
        assert (nvls < r["bf16"]["us"]) is (r["p"] == 8)
        assert r["echo4_vs_nvls"] == round(e["one_launch_us"] / nvls, 3)
        fused_here = r["p"] == 2 and r["mib"] != 1024
        for c in ("taco", "echo4"):
            assert (f"{c}_fused_kernel" in r) == fused_here
        if fused_here:
            f = r["echo4_fused_kernel"]
            assert f["one_launch_us"] == pytest.approx(
                15 + max(fk["echo4"][f"{r['mib']:g}"], wire / r["link_gbps"] / 1e3), abs=0.01)
    gaps = [r for r in res["rows"] if r["taco"] is None]
    assert gaps and all(r["p"] == 2 and r["mib"] == 1024 for r in gaps)


# -- the inputs: a small results dir of hand-made files ------------------------------------
def facts(**kw):
    return {"device": "NVIDIA H200", "n_devices": 1, "jax": "0.11.2", "commit": "f" * 40, **kw}


def kernel_row(codec, kernel, mib, us, impl="triton"):
    return {"impl": impl, "codec": codec, "kernel": kernel, "mib": float(mib),
            "device_us": us}


def loop_row(mib, us, variant=None, **kw):
    return {"p": 2, "mib": mib, "bytes": mib * proj.MIB, "dtype": "bf16", "ok": True,
            "checked": True, "per_device_us": us, "compress_us": 1.0, "decode_sum_us": 2.0,
            **({"variant": variant} if variant else {}), **kw}


# echo4's time of kernel i at m MiB: m + i / 10 (each kernel and size told apart)
ECHO4_US = {m: {k: m + i / 10 for i, k in enumerate(proj.ECHO4_KERNELS)}
            for m in proj.SIZES_MIB}
ECHO4_ROWS = [kernel_row("echo4", k, m, us) for m, t in ECHO4_US.items() for k, us in t.items()]
FAKE = {
    "kernels.json": {**facts(), "rows": [
        *(kernel_row("taco", k, 16, 5.0) for k in ("compress", "reduce", "decompress")),
        *ECHO4_ROWS,
        kernel_row("echo4", "compress_feedback", 16, 900.0),     # not in the projection
        kernel_row("echo4", "compress", 16, 800.0, impl="mosaic")]},   # not the Triton row
    "fused_loopback.json": {**facts(), "rows": [
        {**loop_row(16, 30.0, "default"), "decode_sum_us": 7.0},
        loop_row(16, 20.0, "encode_twice", checked=False)]},
    "fused_echo4_loopback.json": {**facts(), "rows": [loop_row(16, 25.0, "default")]},
    "collectives.json": {**facts(n_devices=2), "rows": []},
    "fused_two_shot_loopback.json": {**facts(), "codec": "taco", "rows": [
        {**loop_row(16, 40.0, "default"), "p": 4, "separate_us": 25.0},
        {**loop_row(16, 10.0, "encode_twice"), "p": 4},                 # not the default
        {**loop_row(16, 60.0, "default"), "p": 8, "ok": False},          # failed its check
        {**loop_row(16, 30.0, "default"), "p": 8, "codec": "echo4"}]},   # a row's own codec
}


def fake_results(tmp_path, **override):
    assert set(FAKE) == set(proj.INPUTS.values())
    for name, doc in {**FAKE, **override}.items():
        (tmp_path / name).write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(tmp_path)


def test_inputs_from_a_small_results_dir(tmp_path):
    d = fake_results(tmp_path)
    times, fx = proj.kernel_times(d)
    # echo4: each kernel's Triton row at every size, nothing else from kernels.json
    assert times["echo4"] == {m: {**t, "source": "kernels.json@fffffff"}
                              for m, t in ECHO4_US.items()}
    assert times["taco"][16] == {"compress": 5.0, "reduce": 5.0, "decompress": 5.0,
                                 "decode_sum": 7.0, "source": "kernels.json@fffffff; "
                                 "decode_sum fused_loopback.json@fffffff"}
    assert set(fx) == set(proj.INPUTS)
    fk = proj.fused_kernels(d)
    assert [r["per_device_us"] for r in fk["taco"]["rows"]] == [30.0]
    assert [r["per_device_us"] for r in fk["echo4"]["rows"]] == [25.0]
    assert fk["taco"]["source"] == "fused_loopback.json@fffffff variant default"
    row = proj.project_rows(times, {"echo4": ECHO4, "taco": codecs.get("taco")},
                            {"l": 100.0}, sizes=(16,), ps=(2,), fixed_us=15.0,
                            fused_kernels=fk, lax_psum=lambda mib: None)[0]
    assert row["echo4_fused_kernel"]["one_launch_us"] == pytest.approx(15 + W16 / 1e5,
                                                                       abs=0.01)
    assert row["taco_fused_kernel"]["one_launch_us"] == pytest.approx(
        15 + N16 // 256 * codecs.get("taco").row_bytes / 1e5, abs=0.01)
    assert row["echo4_fused_kernel_vs_bf16"] == round(
        row["echo4_fused_kernel"]["one_launch_us"] / row["bf16"]["us"], 3)


def test_kept_rows_name_their_own_commit(tmp_path):
    """Rows kept from an earlier run (`bench.kernels --update`, "measured_at") are sourced
    at that run's commit, not the file's."""
    doc = json.loads(json.dumps(FAKE["kernels.json"]))
    for r in doc["rows"]:
        if r["codec"] == "taco":
            r["measured_at"] = "a" * 40
    times, _ = proj.kernel_times(fake_results(tmp_path, **{"kernels.json": doc}))
    assert times["taco"][16]["source"].startswith("kernels.json@aaaaaaa; ")
    assert all(t["source"] == "kernels.json@fffffff" for t in times["echo4"].values())


def test_echo4_needs_every_size(tmp_path):
    """A size asked for without echo4 rows is an error naming it, not a gap."""
    d = fake_results(tmp_path)
    assert set(proj.kernel_times(d, sizes=(16, 256))[0]["echo4"]) == {16, 256}
    with pytest.raises(SystemExit, match=r"kernels\.json.* 0 echo4 Triton rows of compress "
                                         r"at 32 MiB"):
        proj.kernel_times(d, sizes=(16, 32))


@pytest.mark.parametrize("name", sorted(FAKE))
def test_missing_input_names_the_file(tmp_path, name):
    d = fake_results(tmp_path)
    (tmp_path / name).unlink()
    with pytest.raises(SystemExit, match=name.replace(".", r"\.")):
        proj.kernel_times(d)
        proj.fused_kernels(d)


def kernels_json(rows):
    return {**facts(), "rows": rows}


@pytest.mark.parametrize("name, doc, why", [
    ("kernels.json", "{", "unreadable"),                                # not JSON
    ("kernels.json", facts(), "no list of rows"),
    ("kernels.json", kernels_json([r for r in FAKE["kernels.json"]["rows"]   # a row missing
                                   if (r["kernel"], r["mib"]) != ("decode_sum", 64)]),
     "0 echo4 Triton rows of decode_sum at 64 MiB"),
    ("kernels.json", kernels_json(FAKE["kernels.json"]["rows"] + ECHO4_ROWS[-1:]),
     "2 echo4 Triton rows of decode_sum at 1024 MiB"),                  # two of one kernel
    ("kernels.json", kernels_json([{**r, "device_us": "fast"} if r is ECHO4_ROWS[1] else r
                                   for r in FAKE["kernels.json"]["rows"]]),
     "decompress 16.0 MiB: device_us='fast' is not a positive time"),
    ("fused_loopback.json", {**facts(), "rows": [loop_row(16, 50.0, "neither")]},
     "0 checked P = 2 bf16 rows of variant 'default'"),
    ("fused_echo4_loopback.json", [1, 2], "no list of rows"),
    ("fused_echo4_loopback.json", {**facts(), "rows": [
        loop_row(16, 25.0), loop_row(16, 26.0)]}, r"sizes \[16, 16\]"),  # two at one size
])
def test_corrupt_input_names_the_file(tmp_path, name, doc, why):
    d = fake_results(tmp_path, **{name: doc})
    with pytest.raises(SystemExit, match=re.escape(name) + ".*" + why):
        proj.kernel_times(d)
        proj.fused_kernels(d)


# -- the fused two-shot at P >= 3 ------------------------------------------------------------
TACO = codecs.get("taco")


def test_two_shot_rows_by_hand():
    """fixed + max(compute, 2 (P-1)/P codes / link) against the bf16 ring at the same link;
    the goal only at P = 8, 64 and 256 MiB."""
    compute = [{"codec": "taco", "p": 8, "mib": 64, "compute": proj.LOOPBACK,
                "compute_us": 100.0, "source": "hand"},
               {"codec": "echo4", "p": 4, "mib": 16, "compute": proj.MODEL,
                "compute_us": 500.0, "source": "hand"}]
    rows = proj.fused_two_shot_rows(compute, {"taco": TACO, "echo4": ECHO4},
                                    {"nvlink": 100.0, "nvlink_measured": 50.0}, fixed_us=15.0)
    assert len(rows) == 4 and all("projected" in r["projection"] for r in rows)
    by = {(r["codec"], r["link_gbps"]): r for r in rows}
    n64 = 64 * proj.MIB // 2
    t = by["taco", 100.0]
    assert t["wire_bytes"] == round(1.75 * n64 // 256 * 264)       # 1 + 8/256 bytes a value
    assert t["wire_us"] == pytest.approx(1.75 * n64 * 264 / 256 / 1e5, abs=0.01)
    assert t["projected_us"] == pytest.approx(15 + t["wire_us"], abs=0.01)
    assert t["bound"] == "wire"
    assert t["ring_bf16_us"] == pytest.approx(15 + 1.75 * 2 * n64 / 1e5, abs=0.01)
    assert t["ratio"] == round(t["projected_us"] / t["ring_bf16_us"], 3)
    assert t["goal"] == 0.55 and t["meets_goal"] is (t["ratio"] <= 0.55)
    e = by["echo4", 50.0]                                            # compute-bound
    assert e["projected_us"] == 515.0 and e["bound"] == "compute" and "goal" not in e
    assert e["wire_bytes"] == round(1.5 * W16)
    assert e["ring_bf16_us"] == pytest.approx(15 + 1.5 * 2 * N16 / 5e4, abs=0.01)


def test_two_shot_compute_from_a_small_results_dir(tmp_path):
    """taco at P = 4 from its loopback row (and the separate kernels beside it); echo4 at
    P = 8 from the row naming echo4; echo4 at P = 4, and taco at P = 8 (its only row
    failed), from kernels.json's separate kernels."""
    d = fake_results(tmp_path)
    loop = proj.two_shot_loopback(d)
    assert [(r["codec"], r["p"], r["per_device_us"]) for r in loop] == [
        ("taco", 4, 40.0), ("echo4", 8, 30.0)]
    times, _ = proj.kernel_times(d)
    got = proj.two_shot_compute(times, loop, {"taco": TACO, "echo4": ECHO4})
    kinds = {(e["codec"], e["p"], e["mib"], e["compute"]): e["compute_us"] for e in got}
    assert kinds["taco", 4, 16, proj.LOOPBACK] == 40.0
    assert kinds["taco", 4, 16, proj.SEPARATE] == 25.0
    assert kinds["echo4", 8, 16, proj.LOOPBACK] == 30.0
    assert not any(k[:2] == ("echo4", 8) and k[3] == proj.MODEL for k in kinds)
    t = ECHO4_US[16]
    assert kinds["echo4", 4, 16, proj.MODEL] == pytest.approx(
        0.75 * t["compress"] + t["reduce"] / 2 + t["decompress"], abs=0.01)
    assert kinds["taco", 8, 16, proj.MODEL] == pytest.approx(7 / 8 * 5 + 2.5 + 5, abs=0.01)
    table = proj.fused_compute(d, {"taco": TACO, "echo4": ECHO4})
    assert table["taco"][2]["mib_us"] == {16: 30.0}
    assert table["taco"][4] == {"mib_us": {16: 40.0}, "compute": proj.LOOPBACK,
                                "source": "fused_two_shot_loopback.json@fffffff"}
    assert table["echo4"][8]["compute"] == proj.LOOPBACK
    assert table["echo4"][4]["compute"] == proj.MODEL
    assert set(table["echo4"][4]["mib_us"]) == set(proj.SIZES_MIB)


def test_two_shot_loopback_refuses_two_rows_of_one_size(tmp_path):
    doc = json.loads(json.dumps(FAKE["fused_two_shot_loopback.json"]))
    doc["rows"].append(doc["rows"][0])
    d = fake_results(tmp_path, **{"fused_two_shot_loopback.json": doc})
    with pytest.raises(SystemExit, match=r"fused_two_shot_loopback\.json.*two checked bf16 "
                                         r"rows of taco at P = 4, 16 MiB"):
        proj.two_shot_loopback(d)


def test_fused_two_shot_on_the_committed_results(tmp_path):
    out = tmp_path / "projection.json"
    assert proj.main(["--out", str(out)]) == 0
    res = json.loads(out.read_text())["fused_two_shot"]
    loop = json.loads((pathlib.Path(proj.RESULTS) / "fused_two_shot_loopback.json").read_text())
    assert {r["codec"] for r in loop["rows"]} == {"taco", "echo4"}
    for r in loop["rows"]:
        mine = [x for x in res["rows"] if (x["codec"], x["p"], x["mib"], x["compute"]) ==
                (r["codec"], r["p"], r["mib"], proj.LOOPBACK)]
        assert [x["compute_us"] for x in mine] == [r["per_device_us"]] * 2
        assert {x["link_gbps"] for x in mine} == {350.0, 250.0}
    assert all((x["nvls_bf16_us"] < x["ring_bf16_us"]) is (x["p"] == 8) for x in res["rows"])
    goals = [x for x in res["rows"] if "goal" in x]
    assert {(x["codec"], x["mib"]) for x in goals} == {
        (c, m) for c in ("taco", "echo4") for m in (64, 256)}
    assert all(x["p"] == 8 for x in goals)


# -- the bf16 baselines --------------------------------------------------------------------------
@pytest.mark.parametrize("p", [2, 4])
def test_nvls_is_the_ring_below_eight_gpus(p):
    assert proj.bf16_bus_gbps(p, 350.0, "nvls") == proj.bf16_bus_gbps(p, 350.0) == 350.0
    assert proj.bf16_allreduce(32, p, 250.0, 15.0, "nvls")["us"] == \
        proj.bf16_allreduce(32, p, 250.0, 15.0)["us"]


def test_nvls_at_eight_gpus_by_hand():
    """NCCL's published 480 GB/s bus at the 350 GB/s link, scaled with the link."""
    assert proj.bf16_bus_gbps(8, 350.0, "nvls") == pytest.approx(480.0)
    assert proj.bf16_bus_gbps(8, 250.0, "nvls") == pytest.approx(250 * 480 / 350)
    r = proj.bf16_allreduce(32, 8, 350.0, 15.0, "nvls")
    assert r["us"] == pytest.approx(15 + 1.75 * 32 * proj.MIB / 480e3, abs=0.01)
    with pytest.raises(ValueError, match="baseline='nccl'"):
        proj.bf16_bus_gbps(8, 350.0, "nccl")


@pytest.mark.parametrize("comm,gemm", [(100.0, 30.0), (30.0, 100.0), (50.0, 50.0)])
def test_overlap_exposes_what_the_gemm_does_not_hide(comm, gemm):
    """No chunking loss, no slowdown: exposed = max(0, comm − gemm)."""
    o = proj.overlapped(comm, gemm, chunked_us=gemm, sm_slowdown=0.0)
    assert o["exposed_us"] == max(0.0, comm - gemm) and o["pair_us"] == max(comm, gemm)
    assert o["hidden"] is (comm <= gemm)


def test_overlap_losses_by_hand():
    """The GEMM in chunks (100 → 125 µs) at 1/1.1 of its rate while 55 µs of comm run:
    125 + 55 · 0.1 / 1.1 = 130; a collective longer than the slowed GEMM is the pair."""
    o = proj.overlapped(55.0, 100.0, chunked_us=125.0, sm_slowdown=0.1)
    assert o["pair_us"] == pytest.approx(130.0) and o["exposed_us"] == pytest.approx(30.0)
    assert proj.overlapped(200.0, 100.0, 125.0, 0.1)["exposed_us"] == pytest.approx(100.0)
    d = proj.overlapped(10.0, 90.0)                       # the module's stated losses
    assert d["pair_us"] == pytest.approx(90 / proj.CHUNK_EFFICIENCY
                                         + 10 * proj.SM_SLOWDOWN / (1 + proj.SM_SLOWDOWN))
    assert proj.half_collective_us(32 * proj.MIB, 8, 350.0, 15.0) == pytest.approx(
        15 + 7 / 8 * 32 * proj.MIB / 350e3)
