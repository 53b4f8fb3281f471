"""bench.projection on CPU: the projection's arithmetic on hand-made kernel times, its
P = 2 two-shot equal to bench.fused.method_check's, and the program on the committed JSON."""
from __future__ import annotations

import json

import pytest

from bench import fused
from bench import projection as proj
from taco_jax import codecs

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
    assert res["inputs"]["echo4_kernels_current"]["commit"].startswith("507c72a")
    assert len(res["rows"]) == len(proj.PS) * len(proj.SIZES_MIB) * 4
    for r in res["rows"]:
        e = r["echo4"]
        assert e is not None                   # echo4 has every kernel at every size
        n = r["mib"] * proj.MIB // 2
        wire = (1 if r["p"] == 2 else 2 * (r["p"] - 1) / r["p"]) * n // 128 * 72
        assert e["wire_bytes"] == pytest.approx(wire)
        assert e["one_launch_us"] >= 15 + wire / r["link_gbps"] / 1e3 - 0.01
        assert e["one_launch_us"] <= e["separate_us"]
        assert r["echo4_vs_bf16"] >= 72 / 256  # never below the byte ratio
    gaps = [r for r in res["rows"] if r["taco"] is None]
    assert gaps and all(r["p"] == 2 and r["mib"] == 1024 for r in gaps)


def test_missing_input_names_the_file(tmp_path):
    with pytest.raises(SystemExit, match="kernels.json"):
        proj.kernel_times(str(tmp_path))
