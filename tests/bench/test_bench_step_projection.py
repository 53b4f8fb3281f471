"""bench.step_projection on CPU: its arithmetic on a synthetic emulated file (the schema
bench.train_step --emulate-tp writes) beside the committed one-GPU inputs, the method check
against the committed 2×H200 steps, its refusal without its inputs, and bench.train_step's
emulated rows (transports named per variant, call sites recorded) on a tiny preset."""
from __future__ import annotations

import json
import pathlib
import shutil

import pytest

from bench import fused, projection
from bench import step_projection as sp

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
MIB = 1 << 20
HBM = 4000.0                                   # GB/s, the synthetic roofline


def site(op, calls, shape=(16, 1024, 1024), codec="none", transport=None, p=2):
    n = 1
    for d in shape:
        n *= d
    return {"op": op, "axes": ["tp"], "p": p, "shape": list(shape), "dtype": "bfloat16",
            "bytes": 2 * n, "calls": calls, "compressed": codec != "none", "codec": codec,
            "transport": transport, "reason": "" if codec != "none" else "codec 'none'",
            "vma": True, "allreduces_per_step": calls, "wire_bytes_per_step": 0}


def emu_row(preset, n, variant, step_ms, codec="none", transport="default", error=None,
            shape=(16, 1024, 1024)):
    row = {"preset": preset, "emulate_tp": n, "variant": variant, "transport": transport,
           "codec_tp": codec, "step_ms": step_ms}
    if error:
        return {**row, "step_ms": None, "error": error}
    t = None if codec == "none" else ("xla" if transport == "default" else transport)
    return {**row, "sites": [site("psum", 48, shape, codec, t, n),
                             site("pvary", 49, shape, codec, t, n)]}


def emulated(rows, platform="gpu"):
    return {"device": "NVIDIA H200", "platform": platform, "n_devices": 1, "jax": "0.11.2",
            "commit": "e" * 40, "mode": "emulated", "rows": rows}


ROWS = [emu_row("350m", 2, "none", 150.0), emu_row("350m", 2, "taco:xla", 170.0, "taco", "xla"),
        emu_row("350m", 2, "taco:fused", None, "taco", "fused", error="ValueError: no GPU"),
        emu_row("350m", 8, "none", 160.0),
        emu_row("350m", 8, "echo4:fused", 165.0, "echo4", "fused")]


def results(tmp_path, rows=ROWS, platform="gpu", drop=()):
    """A results dir: the committed one-GPU inputs, a synthetic emulated file, and a
    kernels.json whose roofline is HBM."""
    for name in {*projection.INPUTS.values(), *sp.INPUTS.values()} - {sp.INPUTS["emulated"]}:
        if name not in drop:
            shutil.copy(RESULTS / name, tmp_path / name)
    k = json.loads((RESULTS / "kernels.json").read_text())
    k["roofline"] = {"device_gbs": HBM}
    (tmp_path / "kernels.json").write_text(json.dumps(k))
    if "train_step_emulated.json" not in drop:
        (tmp_path / "train_step_emulated.json").write_text(json.dumps(emulated(rows, platform)))
    return tmp_path


def test_interp():
    pts = {1.0: 10.0, 3.0: 30.0, 5.0: 40.0}
    assert sp.interp(pts, 2.0) == (20.0, False) and sp.interp(pts, 4.0) == (35.0, False)
    assert sp.interp(pts, 0.5) == (5.0, True) and sp.interp(pts, 10.0) == (80.0, True)
    assert sp.interp(pts, 5.0) == (40.0, False)


def test_compute_subtracts_the_emulated_reductions():
    none = emu_row("350m", 8, "none", 160.0)
    b = 32 * MIB                                            # 16 × 1024 × 1024 bf16
    reduce_ms = 97 * 9 * b / HBM / 1e6                      # (N + 1) · bytes per all-reduce
    c = sp.compute_ms(none, HBM)
    assert c["emulated_reduce_ms"] == pytest.approx(reduce_ms, abs=1e-3)
    assert c["compute_ms_per_device"] == pytest.approx((160.0 - reduce_ms) / 8, abs=1e-3)


def test_only_allreduces_are_priced():
    s = {**site("all_gather", 2), "allreduces_per_step": 0}
    with pytest.raises(ValueError, match="all_gather.*only all-reduces"):
        sp.allreduce_sites([s])
    assert sp.allreduce_sites([{**site("psum", 3), "p": 1}]) == []


def test_projection_on_synthetic_emulated_rows(tmp_path, capsys):
    d = results(tmp_path)
    out = tmp_path / "step_projection.json"
    assert sp.main(["--results", str(d), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "PROJECTED" in printed and "method check" in printed
    res = json.loads(out.read_text())
    assert res["projected"] is True and res["device"] == "NVIDIA H200"
    assert res["inputs"]["emulated"]["commit"] == "e" * 40
    assert all(r["projection"] == "projected" for r in res["rows"])
    rows = {(r["p"], r["link_gbps"], r["baseline"], r["variant"]): r for r in res["rows"]}
    priced = {(e["p"], e["link_gbps"], e.get("baseline"), e["variant"]): e
              for e in res["priced"]}
    b = 32 * MIB
    coll = {r["mib_per_device"]: r for r in
            json.loads((RESULTS / "collectives.json").read_text())["rows"]}
    lax32 = coll[16]["lax_psum_us"] + (coll[64]["lax_psum_us"] - coll[16]["lax_psum_us"]) / 3
    c2 = (150.0 - 97 * 3 * b / HBM / 1e6) / 2
    bf16 = rows[2, 350.0, "ring", "bf16"]                     # measured lax.psum at P = 2
    assert bf16["compute_ms"] == pytest.approx(c2, abs=1e-3)
    assert bf16["comm_ms"] == pytest.approx(97 * lax32 / 1e3, abs=1e-3)
    assert bf16["speedup_vs_bf16"] == 1.0
    assert rows[2, 250.0, "ring", "bf16"]["projected_ms"] == bf16["projected_ms"]
    assert rows[2, 350.0, "nvls", "bf16"]["projected_ms"] == bf16["projected_ms"]  # P < 8
    xla = rows[2, 350.0, "ring", "taco:xla"]                  # measured compressed psum
    t32 = coll[16]["compressed_us"] + (coll[64]["compressed_us"] - coll[16]["compressed_us"]) / 3
    assert xla["comm_ms"] == pytest.approx(97 * t32 / 1e3, abs=1e-3)
    assert priced[2, 350.0, None, "taco:xla"]["sites_from"] == "its emulated row"
    # fused taco at P = 2: its row failed, so the none row's sites taken as compressed;
    # fixed + max(the one-shot loopback per device at 32 MiB, wire / link)
    f = rows[2, 350.0, "ring", "taco:fused"]
    assert ("taken as compressed with taco over fused (its row failed)"
            in priced[2, 350.0, None, "taco:fused"]["sites_from"])
    loop = {r["mib"]: r["per_device_us"] for r in
            json.loads((RESULTS / "fused_loopback.json").read_text())["rows"]}
    compute = loop[16] + (loop[64] - loop[16]) / 3
    wire = (b // 2) // 256 * 264 / 350e3
    assert f["comm_ms"] == pytest.approx(97 * (fused.FIXED_US + max(compute, wire)) / 1e3,
                                         abs=1e-3)
    assert f["speedup_vs_bf16"] == round(bf16["projected_ms"] / f["projected_ms"], 3)
    # P = 8: bf16 on the ring model and at NVLS's rate; echo4 fused two-shot from its
    # one-launch loopback
    ring = rows[8, 250.0, "ring", "bf16"]
    assert ring["comm_ms"] == pytest.approx(97 * (15 + 1.75 * b / 250e3) / 1e3, abs=1e-3)
    nvls = rows[8, 250.0, "nvls", "bf16"]
    assert nvls["comm_ms"] == pytest.approx(97 * (15 + 1.75 * b / (250e3 * 480 / 350)) / 1e3,
                                            abs=1e-3)
    e = rows[8, 250.0, "ring", "echo4:fused"]
    sites = priced[8, 250.0, None, "echo4:fused"]["priced"]
    assert sites[0]["priced_by"].startswith("fused: one-launch loopback")
    wire8 = 1.75 * (b // 2) // 128 * 72 / 250e3
    assert all(s["allreduce_us"] >= 15 + wire8 - 0.01 for s in sites)
    assert rows[8, 250.0, "nvls", "echo4:fused"]["projected_ms"] == e["projected_ms"]
    assert rows[8, 250.0, "nvls", "echo4:fused"]["bf16_ms"] == nvls["projected_ms"]
    assert not any(k[2:] == ("ring", "taco:fused") and k[0] == 8 for k in rows)  # no row of it
    for r in res["rows"]:                       # every row against its own baseline's bf16
        base = rows[r["p"], r["link_gbps"], r["baseline"], "bf16"]["projected_ms"]
        assert r["bf16_ms"] == base
        assert r["speedup_vs_bf16"] == round(base / r["projected_ms"], 3)
    assert {r["baseline"] for r in res["rows"]} == set(projection.BASELINES)
    checks = {(c["preset"], c["variant"]): c for c in res["method_check"]}
    measured = {(r["preset"], r["codec_fwd"]): r["step_ms"] for r in
                json.loads((RESULTS / "train_step.json").read_text())["rows"]}
    assert set(checks) == {("350m", "bf16"), ("350m", "taco:xla")}
    assert checks["350m", "bf16"]["measured_2gpu_ms"] == measured["350m", "none"] == 72.69
    assert checks["350m", "taco:xla"]["measured_2gpu_ms"] == measured["350m", "taco"] == 75.58
    c = checks["350m", "bf16"]
    assert c["projected_ms"] == pytest.approx(bf16["projected_ms"], abs=1e-3)
    assert c["error"] == round(c["projected_ms"] / 72.69 - 1, 3)


# 350m's GEMMs per device at TP = 8 (K, N, calls a pass), tokens T = 16 × 1024
T, H = 16 * 1024, 1024
GEMMS = {"qkv": (H, 3 * H, 24), "proj": (H, H, 24), "fc1": (H, 4 * H, 24),
         "fc2": (4 * H, H, 24), "head": (H, 32 * H, 1)}


def test_overlapped_steps_by_hand(tmp_path):
    """P = 8, 350 GB/s: the GEMMs from FLOP counts at the rate that fills C(8) with the
    step's matmul FLOPs; each of the 194 collectives hidden under its GEMM (forward) or
    twice its work (backward), in 8 chunks, slowed beside the collective."""
    d = results(tmp_path)
    out = tmp_path / "p.json"
    sp.main(["--results", str(d), "--out", str(out)])
    res = json.loads(out.read_text())
    rows = {(r["p"], r["link_gbps"], r["baseline"], r["variant"]): r for r in res["rows"]}
    c8 = (160.0 - 97 * 9 * 32 * MIB / HBM / 1e6) / 8
    fwd = {g: 2 * T * k * n / 8 for g, (k, n, _) in GEMMS.items()}
    flops = 3 * (sum(fwd[g] * c for g, (_, _, c) in GEMMS.items()) + 24 * 2 * T * 1024 * H / 8)
    rate = flops / (c8 * 1e-3)
    comm = 15 + 7 / 8 * 32 * MIB / 350e3                    # an all-gather or reduce-scatter
    codes = 15 + 7 / 8 * (T * H // 128 * 72) / 350e3        # of echo4's codes

    def exposed(comm_us, codec_us=None):
        """codec_us None: bf16, every collective hidden, backward under dX and dW; else a
        codec's, backward under dX alone, the LM head's in series (model.tp_overlap leaves
        them plain)."""
        total = 0.0
        for g, (_, _, calls) in GEMMS.items():
            for work in (1, 2 if codec_us is None else 1):  # forward; dX + dW (a codec: dX)
                gemm = work * fwd[g] / rate * 1e6
                o = projection.overlapped(comm_us, gemm, gemm / projection.CHUNK_EFFICIENCY,
                                          projection.SM_SLOWDOWN)["exposed_us"]
                if codec_us is not None and g == "head":
                    o = comm_us
                total += calls * (o + (codec_us or 0.0))
        return total / 1e3

    bf16 = rows[8, 350.0, "overlap", "bf16"]
    assert bf16["comm_ms"] == pytest.approx(exposed(comm), abs=2e-3)
    bound = rows[8, 350.0, "overlap", "echo4:overlap-in-gemm"]
    assert bound["comm_ms"] == pytest.approx(exposed(codes, 0.0), abs=2e-3)
    assert "bound" in bound
    two_shot = {r["mib"]: r["per_device_us"] for r in json.loads(
        (RESULTS / "fused_two_shot_loopback.json").read_text())["rows"]
                if r.get("codec") == "echo4" and r["p"] == 8 and r.get("dtype") == "bf16"
                and r.get("variant", "default") == "default" and r.get("ok")}
    half = (two_shot[16] + (two_shot[64] - two_shot[16]) / 3) / 2   # 32 MiB, half of it
    series = rows[8, 350.0, "overlap", "echo4:overlap"]
    assert series["comm_ms"] == pytest.approx(exposed(codes, half), abs=2e-3)
    assert bound["projected_ms"] < series["projected_ms"]
    c = next(c for c in res["compute"] if c["p"] == 8)
    assert c["matmul_tflops"] == pytest.approx(rate / 1e12, abs=0.1)
    assert "FLOP count" in c["gemm_times"] and c["gemm_share"] == 1.0


def test_a_gemm_table_replaces_the_flop_counts(tmp_path):
    """gemm_table.json's rows of (preset, P) with this model's shapes price the GEMMs:
    1 µs each pass whole and chunked, so every collective exposes comm − 1 µs forward and
    comm − 2 µs backward (dX + dW)."""
    d = results(tmp_path)
    rows = [{"preset": "350m", "p": 8, "gemm": g, "pass": ps, "m": T, "k": k,
             "n": n // 8, "us": 1.0, "chunked_us": 1.0}
            for g, (k, n, _) in GEMMS.items() for ps in ("fwd", "dx", "dw")]
    (d / "gemm_table.json").write_text(json.dumps({"commit": "a" * 40, "rows": rows}))
    out = tmp_path / "p.json"
    sp.main(["--results", str(d), "--out", str(out)])
    res = json.loads(out.read_text())
    c8 = next(c for c in res["compute"] if c["p"] == 8)
    assert c8["gemm_times"] == "measured per shape"
    assert c8["source"] == "gemm_table.json@aaaaaaa"
    assert "FLOP count" in next(c for c in res["compute"] if c["p"] == 2)["gemm_times"]
    comm = 15 + 7 / 8 * 32 * MIB / 350e3
    bf16 = next(r for r in res["rows"] if (r["p"], r["link_gbps"], r["baseline"],
                                          r["variant"]) == (8, 350.0, "overlap", "bf16"))
    assert bf16["comm_ms"] == pytest.approx(97 * ((comm - 1) + (comm - 2)) / 1e3, abs=2e-3)


def row(variant, ms, baseline="ring", **kw):
    return {"preset": "m", "p": 8, "link_gbps": 350.0, "baseline": baseline,
            "variant": variant, "codec": variant.split(":")[0], "projected_ms": ms, **kw}


def test_headline_picks_the_hardest_bf16():
    """The fastest bf16 of the three is the one the best compressed variant is held to; a
    bound (codec inside the GEMM) is reported beside it, not as the best."""
    rows = [row("bf16", 30.0), row("bf16", 25.0, "nvls"), row("bf16", 22.0, "overlap"),
            row("x:fused", 20.0), row("y:overlap", 21.0), row("x:overlap-in-gemm", 16.0,
                                                               bound="no such kernel")]
    (e,) = sp.headline(rows, {"m": {8: 1.1}})
    assert e["bf16_ms"] == {"ring": 30.0, "nvls": 25.0, "overlap": 22.0}
    assert e["hardest"] == "overlap" and e["best"] == "x:fused"
    assert e["speedup"] == {"ring": 1.5, "nvls": 1.25, "overlap": 1.1}
    assert e["speedup_vs_hardest"] == 1.1 and e["meets_goal"] is True
    assert e["bound"] == "x:overlap-in-gemm" and e["bound_speedup_vs_hardest"] == 1.375
    assert e["best_by_codec"]["y"] == {"variant": "y:overlap", "projected_ms": 21.0,
                                       "speedup_vs_hardest": 1.048}
    (e,) = sp.headline([{**r, "projected_ms": 40.0} if r["baseline"] == "overlap" else r
                        for r in rows], {"m": {8: 1.5}})
    assert e["hardest"] == "nvls" and e["speedup_vs_hardest"] == 1.25
    assert e["meets_goal"] is False


def test_the_committed_projection_has_three_baselines():
    res = json.loads((RESULTS / "step_projection.json").read_text())
    assert res["command"].startswith("python -m bench.step_projection")
    for r in res["rows"]:
        assert r["baseline"] in projection.BASELINES
    have = {(r["preset"], r["p"], r["link_gbps"], r["baseline"], r["variant"])
            for r in res["rows"]}
    for p in (4, 8):
        for link in (350.0, 250.0):
            for b in projection.BASELINES:
                for v in ("bf16", "taco:fused", "echo4:fused", "taco:overlap",
                          "echo4:overlap"):
                    assert ("350m", p, link, b, v) in have
    head = {(e["p"], e["link_gbps"]): e for e in res["headline"] if e["preset"] == "350m"}
    assert set(head) == {(p, link) for p in (4, 8) for link in (350.0, 250.0)}
    for e in head.values():
        assert e["bf16_ms"][e["hardest"]] == min(e["bf16_ms"].values())


def test_a_new_fused_row_is_picked_up(tmp_path):
    """An echo4 row in fused_two_shot_loopback.json prices echo4's fused sites at its P."""
    d = results(tmp_path)
    doc = json.loads((d / "fused_two_shot_loopback.json").read_text())
    doc["rows"] = [r for r in doc["rows"] if r.get("codec", "taco") == "taco"]
    (d / "fused_two_shot_loopback.json").write_text(json.dumps(doc))
    out = tmp_path / "p.json"

    def echo4_fused():
        sp.main(["--results", str(d), "--out", str(out)])
        res = json.loads(out.read_text())
        r = next(r for r in res["rows"] if r["p"] == 8 and r["variant"] == "echo4:fused")
        e = next(e for e in res["priced"] if e["p"] == 8 and e["variant"] == "echo4:fused")
        return r, e["priced"]

    before, sites = echo4_fused()
    assert sites[0]["priced_by"].startswith("fused: separate kernels, modelled")
    doc["rows"] += [{**r, "codec": "echo4", "per_device_us": 10 * r["per_device_us"]}
                    for r in doc["rows"] if r["p"] == 8]
    (d / "fused_two_shot_loopback.json").write_text(json.dumps(doc))
    e, sites = echo4_fused()
    assert sites[0]["priced_by"].startswith("fused: one-launch loopback")
    assert e["comm_ms"] > before["comm_ms"]          # 10 × taco's compute, above the wire


def test_refuses_without_the_emulated_file(tmp_path):
    d = results(tmp_path, drop=("train_step_emulated.json",))
    with pytest.raises(SystemExit, match=r"train_step_emulated\.json\) is missing; produce "
                                         r"it with `python -m bench\.train_step .*--emulate-tp"):
        sp.main(["--results", str(d), "--out", str(tmp_path / "x.json")])


def test_refuses_a_cpu_measurement_and_missing_inputs(tmp_path):
    d = results(tmp_path, platform="cpu")
    with pytest.raises(SystemExit, match="measured on 'cpu', not a GPU"):
        sp.main(["--results", str(d), "--out", str(tmp_path / "x.json")])
    (d / "collectives.json").unlink()
    with pytest.raises(SystemExit, match=r"collectives\.json\) is missing"):
        sp.main(["--results", str(d), "--out", str(tmp_path / "x.json"), "--any-platform"])


def test_no_none_row_is_a_gap(tmp_path):
    d = results(tmp_path, rows=[r for r in ROWS if not (r["emulate_tp"] == 8
                                                       and r["variant"] == "none")])
    out = tmp_path / "p.json"
    sp.main(["--results", str(d), "--out", str(out)])
    res = json.loads(out.read_text())
    assert {"preset": "350m", "p": 8, "why": "no emulated none row"} in res["gaps"]
    assert {r["p"] for r in res["rows"]} == {2}


# -- bench.train_step --emulate-tp on CPU ------------------------------------------------------
def test_train_step_emulated_rows(tmp_path):
    """Each preset at each N, variants naming transports side by side: sites with their
    all-reduces per step, added_ms against the none row of the same N, a failing variant
    recorded as a row, and the emulated default output path."""
    from bench import train_step
    out = tmp_path / "emulated.json"
    train_step.main(["--presets", "tiny", "--mesh", "1,1,1", "--emulate-tp", "2", "4",
                     "--variants", "none", "taco:xla", "--steps", "1", "--out", str(out),
                     "--set", "model.n_layer=1", "model.d_model=32", "model.vocab_size=512",
                     "model.seq_len=32", "train.batch_size=4", "parallel.cpu_devices=1"])
    doc = json.loads(out.read_text())
    assert doc["emulate_tp"] == [2, 4]
    rows = {(r["emulate_tp"], r["variant"]): r for r in doc["rows"]}
    assert set(rows) == {(n, v) for n in (2, 4) for v in ("none", "taco:xla")}
    for n in (2, 4):
        none, taco = rows[n, "none"], rows[n, "taco:xla"]
        assert none["mesh"] == f"1x1x{n}" and none["transport"] == "default"
        assert none["added_ms"] == 0.0
        assert taco["added_ms"] == round(taco["step_ms"] - none["step_ms"], 2)
        assert taco["transport"] == "xla"
        assert {s["op"] for s in taco["sites"]} == {"psum", "pvary"}
        assert all(s["compressed"] and s["transport"] == "xla" and s["p"] == n
                   for s in taco["sites"])
        assert not any(s["compressed"] for s in none["sites"])
        assert none["allreduces_per_step"] == taco["allreduces_per_step"] == 5  # 2 + 2 + head
        assert sum(s["allreduces_per_step"] for s in taco["sites"]) == 5
        assert all(s["bytes"] == 4 * 32 * 32 * 4 for s in taco["sites"])      # f32 on CPU


def test_train_step_skips_a_preset_that_cannot_split(tmp_path, capsys):
    """small's 12 heads do not split over 8: that (preset, N) is skipped with a line saying
    why, and --update drops its old rows rather than keeping error rows (nothing compiles)."""
    from bench import train_step
    assert train_step.misfit("tiny", 2, []) is None
    assert "n_head=12" in train_step.misfit("small", 8, [])
    out = tmp_path / "emulated.json"
    old = [{"preset": "small", "emulate_tp": 8, "variant": "none", "error": "ValueError"},
           {"preset": "small", "emulate_tp": 2, "variant": "none", "step_ms": 1.0}]
    out.write_text(json.dumps({"commit": "abc", "rows": old}))
    train_step.main(["--presets", "small", "--mesh", "1,1,1", "--emulate-tp", "8",
                     "--variants", "none", "--update", "--out", str(out)])
    assert "small at emulated tp=8: skipped (model.n_head=12" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [(r["preset"], r["emulate_tp"]) for r in rows] == [("small", 2)]


def test_train_step_transport_names(monkeypatch, tmp_path):
    from bench import train_step
    assert train_step.split_transport("taco:fused@default") == ("taco@default", "fused")
    assert train_step.split_transport("3d+sp@0") == ("3d+sp@0", None)
    with pytest.raises(ValueError, match="variant 'taco:wire'.*transport='wire'"):
        train_step.split_transport("taco:wire")
    # a variant that fails is a row with its error; the run goes on
    calls = []

    def fake(preset, variant, codecs, steps, extra, transport=None, sites_out=None):
        calls.append((variant, transport, extra[-1]))
        if transport == "fused":
            raise ValueError("fused cannot run here")
        return {"preset": preset, "variant": variant, "codec_tp": codecs["tp"],
                "step_ms": 10.0 if codecs["tp"] == "none" else 12.5}
    monkeypatch.setattr(train_step, "measure", fake)
    train_step.main(["--presets", "tiny", "--emulate-tp", "2", "--variants", "none",
                     "taco:fused", "taco", "--out", str(tmp_path / "e.json")])
    rows = json.loads((tmp_path / "e.json").read_text())["rows"]
    assert [(r["variant"], r.get("error"), r.get("added_ms")) for r in rows] == [
        ("none", None, 0.0), ("taco:fused", "ValueError: fused cannot run here", None),
        ("taco", None, 2.5)]
    assert calls[1] == ("taco", "fused", "parallel.emulate_tp=2")
    # --update: the rows of the (preset, N) not measured now are kept, with their commit
    train_step.main(["--presets", "tiny", "--emulate-tp", "4", "--variants", "none",
                     "--update", "--out", str(tmp_path / "e.json")])
    doc = json.loads((tmp_path / "e.json").read_text())
    assert [(r["emulate_tp"], r["variant"]) for r in doc["rows"]] == [
        (2, "none"), (2, "taco:fused"), (2, "taco"), (4, "none")]
    assert all(r["measured_at"] == doc["commit"] for r in doc["rows"][:3])
    assert "measured_at" not in doc["rows"][3]
    assert train_step.EMULATED_OUT == "bench/results/train_step_emulated.json"


def test_train_step_overlap_variants(monkeypatch, tmp_path):
    """`SPEC:overlap` is the model's collective matmul: model.tp_overlap and sequence
    parallelism on, the codec SPEC's on the TP sites, no transport set."""
    from bench import train_step
    from train import config
    assert train_step.split_transport("echo4:overlap@default") == ("echo4@default", "overlap")
    codecs = train_step.variant_codecs("taco", "taco", "tah4", "taco")
    o = train_step.variant_overrides("taco", codecs, overlap=True)
    assert {"model.tp_overlap=true", "model.sequence_parallel=true", "recipe.codec=taco",
            "model.codec_fwd=taco", "model.codec_bwd=taco"} <= set(o)
    assert not any("tp_overlap" in x for x in train_step.variant_overrides("taco", codecs))
    cfg = config.load_config("350m", o)
    assert cfg.model.tp_overlap and cfg.model.sequence_parallel
    seen = []

    def fake(preset, variant, codecs, steps, extra, sites_out, overlap=False):
        seen.append((variant, codecs["tp"], overlap))
        return {"preset": preset, "variant": variant, "codec_tp": codecs["tp"],
                "step_ms": 10.0}
    monkeypatch.setattr(train_step, "_measure", fake)
    train_step.main(["--presets", "tiny", "--emulate-tp", "2", "--variants", "none",
                     "none:overlap", "taco:overlap", "echo4:overlap",
                     "--out", str(tmp_path / "e.json")])
    # the serial SP step, the overlap rows' baseline, runs before the first of them
    assert seen == [("none", "none", False), ("sp", "none", False), ("none", "none", True),
                    ("taco", "taco", True), ("echo4", "echo4", True)]
    rows = json.loads((tmp_path / "e.json").read_text())["rows"]
    assert [r["transport"] for r in rows] == ["default", "default", "overlap", "overlap",
                                              "overlap"]


@pytest.mark.parametrize("label,priced_by", [("fused (loopback)", "fused: "),
                                             ("fused (exchange emulated)", "xla transport")])
def test_sites_are_priced_by_the_transport_telemetry_names(tmp_path, label, priced_by):
    """Under emulation the fused transport's sites say what ran: "fused (loopback)" (its
    one-launch kernel: priced as the fused kernel with its wire) or "fused (exchange
    emulated)" (its separate kernels: priced as the three-launch schedule)."""
    rows = [emu_row("350m", 8, "none", 160.0), emu_row("350m", 8, "taco:fused", 170.0, "taco",
                                                       label)]
    d = results(tmp_path, rows)
    out = tmp_path / "step_projection.json"
    assert sp.main(["--results", str(d), "--out", str(out)]) == 0
    got = [e for e in json.loads(out.read_text())["priced"] if e["variant"] == "taco:fused"]
    assert got and all(s["priced_by"].startswith(priced_by) for e in got for s in e["priced"])
