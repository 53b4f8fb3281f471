"""The kernel benchmark's pieces that need no GPU: device time from a profiler trace
(bench/common.py), the Triton stage copy kernel (bench/kernels.py --stages), a CPU smoke
run of bench.kernels, and the Nsight Compute summaries (bench/ncu_time.py,
bench/ncu_source.py) on synthetic inputs."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from bench import common


def _trace(kernels, device=0):
    """kernels: (name, dur, stream) on /device:GPU:<device>; an 'XLA Ops' thread repeats
    every kernel and another GPU runs its own (neither may be counted)."""
    ev = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
          {"ph": "M", "pid": 7, "name": "process_name",
           "args": {"name": f"/device:GPU:{device} NVIDIA H200"}},
          {"ph": "M", "pid": 8, "name": "process_name",
           "args": {"name": f"/device:GPU:{device + 10} other"}},
          {"ph": "M", "pid": 7, "tid": 99, "name": "thread_name", "args": {"name": "XLA Ops"}}]
    for s in sorted({k[2] for k in kernels}):
        ev.append({"ph": "M", "pid": 7, "tid": s, "name": "thread_name",
                   "args": {"name": f"Stream #{s}(Compute)"}})
    t = 0.0
    for name, dur, s in kernels:
        ev += [{"ph": "X", "pid": 7, "tid": s, "ts": t, "dur": dur, "name": name},
               {"ph": "X", "pid": 7, "tid": 99, "ts": t, "dur": dur, "name": name},
               {"ph": "X", "pid": 8, "tid": s, "ts": t, "dur": 1000.0, "name": name}]
        t += dur + 3
    ev.append({"ph": "X", "pid": 1, "tid": 5, "ts": 0, "dur": 10_000, "name": "PjitFunction"})
    return ev


def test_kernel_time_sums_device_kernels_per_call():
    ks = [("taco_compress_mosaic_mosaic_gpu_kernel", 100.0, 1), ("loop_broadcast_fusion", 1.0, 1)]
    out = common.kernel_time(_trace(ks * 4), calls=4)
    assert out["us"] == pytest.approx(101.0)
    assert out["kernels"] == {"taco_compress_mosaic_mosaic_gpu_kernel": 100.0,
                              "loop_broadcast_fusion": 1.0}
    assert len(common.gpu_kernel_events(_trace(ks), device=0)) == 2
    with pytest.raises(ValueError, match="GPU:3"):
        common.gpu_kernel_events(_trace(ks), device=3)
    with pytest.raises(ValueError, match="no GPU kernels"):
        common.kernel_time(_trace([]), calls=1)


def test_read_trace_prefers_the_perfetto_file(tmp_path):
    run = tmp_path / "plugins" / "profile" / "2026_12_01"
    run.mkdir(parents=True)
    with gzip.open(run / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": [{"ph": "X", "name": "viewer"}]}, f)
    assert common.read_trace(str(tmp_path))[0]["name"] == "viewer"
    with gzip.open(run / "perfetto_trace.json.gz", "wt") as f:
        json.dump([{"ph": "X", "name": "perfetto"}], f)
    assert common.read_trace(str(tmp_path))[0]["name"] == "perfetto"
    with pytest.raises(FileNotFoundError):
        common.read_trace(str(tmp_path / "none"))


def test_device_time_on_cpu_reports_why():
    """On CPU the trace has no GPU: the host timer still runs, device time is None; by
    default no trace is taken there, and one asked for is read back and found empty."""
    import jax.numpy as jnp
    for trace in (None, True):
        out = common.device_time(lambda v: v + 1, jnp.ones(128), iters=2, batches=1,
                                 repeats=1, trace=trace)
        assert out["host_us"] > 0 and out["us"] is None and "GPU" in out["error"], trace
    assert "in the trace" in out["error"] and "/host:CPU" in out["error"]


def test_kernels_stage_copy_kernel():
    """bench.kernels --stages' plumbing ceiling: a Pallas copy with compress's tiling and
    wire layout writes the fp8 cast of each row and zero scale bytes (interpret mode)."""
    import jax.numpy as jnp
    import numpy as np
    from bench import kernels
    from taco_jax.kernels.triton import tiling as common_tiling
    x = (jnp.arange(37 * 256, dtype=jnp.float32).reshape(37, 256) / 1000).astype(jnp.bfloat16)
    want = np.asarray(jnp.asarray(x).astype(jnp.float8_e4m3fn)).view(np.uint8)
    for row in (264, 272):     # the wire row, and padded to 16-byte alignment
        w = np.asarray(kernels.copy_kernel(x, row, common_tiling.KernelConfig(16)))
        np.testing.assert_array_equal(w[:, :256], want)
        assert w.shape == (37, row) and not w[:, 256:].any()


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
def test_kernels_cpu_smoke(tmp_path):
    """python -m bench.kernels on CPU: interpreted Triton rows with host times (no device
    time, no Mosaic rows), the JSON written with the environment facts."""
    from bench import kernels
    out = tmp_path / "k.json"
    res = kernels.main(["--out", str(out), "--impls", "triton", "mosaic"])
    got = json.loads(out.read_text())
    assert {r["kernel"] for r in got["rows"]} == {"compress", "decompress", "reduce"}
    assert all(r["impl"] == "triton" and r["host_us"] > 0 and "device_us" not in r
               for r in got["rows"])
    assert got["jax"] and "roofline" in got and res["rows"] == got["rows"]


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
def test_kernels_cpu_smoke_echo4(tmp_path):
    """python -m bench.kernels --codecs echo4 --check --tune on CPU: a row per 4-bit kernel
    with the codec named, and the bit-for-bit checks (interpreted) all passing; the tuning
    of one kernel (--tune-kernels: each runs the same search)."""
    from bench import kernels
    out = tmp_path / "k.json"
    res = kernels.main(["--out", str(out), "--codecs", "echo4", "--check", "--tune",
                        "--tune-kernels", "reduce"])
    got = json.loads(out.read_text())
    assert {r["kernel"] for r in got["rows"]} == set(kernels.ECHO_KINDS)
    assert all(r["codec"] == "echo4" and r["impl"] == "triton" for r in got["rows"])
    assert {c["codec"] for c in got["check_echo"]} == {"echo4", "int4-sym"}
    assert all(c["ok"] for c in got["check_echo"]), got["check_echo"]
    assert "check" not in got                     # no TACO codec asked for
    assert len(got["tune_echo"]) == 2 and {r["kernel"] for r in got["tune_echo"]} == {"reduce"}
    assert not any("error" in r for r in got["tune_echo"])
    assert res["rows"] == got["rows"]


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
def test_kernels_no_timings_runs_the_checks_alone(tmp_path):
    """--no-timings --check: the checks and no timing rows (the GPU batch runs them as a
    step of their own); without anything else to run it is refused."""
    from bench import kernels
    out = tmp_path / "k.json"
    kernels.main(["--out", str(out), "--codecs", "echo4", "--check", "--no-timings"])
    got = json.loads(out.read_text())
    assert got["rows"] == [] and got["check_echo"]
    assert all(c["ok"] for c in got["check_echo"]), got["check_echo"]
    with pytest.raises(SystemExit):
        kernels.main(["--out", str(out), "--no-timings"])


def _old_results(facts, **extra):
    return {**facts, "commit": "abc1234", "custom_calls": {}, "roofline": {},
            "command": "an earlier run",
            "rows": [{"codec": "taco", "impl": "triton", "kernel": "compress", "mib": 16,
                      "device_us": 9.5},
                     {"codec": "echo4", "impl": "triton", "kernel": "compress", "mib": 16,
                      "device_us": 8.5}],
            "check": [{"codec": "taco", "ok": True}], "check_commit": "0000000",
            "check_note": "from a run before", "check_echo": [{"codec": "echo4", "ok": True}],
            **extra}


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
def test_update_retimes_one_codec_and_keeps_the_rest_labelled(tmp_path):
    """--update --codecs echo4: echo4's rows new; taco's kept, tagged with the commit they
    were measured at; the sections not re-run kept with their commits (their own where they
    had one); a section the run writes replaces the old one and its label."""
    from bench import kernels
    out = tmp_path / "k.json"
    out.write_text(json.dumps(_old_results(common.env_facts())))
    kernels.main(["--out", str(out), "--codecs", "echo4", "--update"])
    got = json.loads(out.read_text())
    taco = [r for r in got["rows"] if r["codec"] == "taco"]
    echo = [r for r in got["rows"] if r["codec"] == "echo4"]
    assert taco == [{"codec": "taco", "impl": "triton", "kernel": "compress", "mib": 16,
                     "device_us": 9.5, "measured_at": "abc1234"}]
    assert {r["kernel"] for r in echo} == set(kernels.ECHO_KINDS)
    assert not any("measured_at" in r or r.get("device_us") == 8.5 for r in echo)
    assert got["commit"] != "abc1234" and got.get("command") != "an earlier run"
    assert (got["check_commit"], got["check_note"]) == ("0000000", "from a run before")
    assert got["check_echo_commit"] == "abc1234"
    kernels.main(["--out", str(out), "--codecs", "echo4", "--update", "--check",
                  "--no-timings"])
    again = json.loads(out.read_text())
    assert "check_echo_commit" not in again and all(c["ok"] for c in again["check_echo"])
    # nothing re-timed: every row kept, echo4's tagged with the run that timed them
    assert [r for r in again["rows"] if r["codec"] == "taco"] == taco
    assert [r.get("measured_at") for r in again["rows"] if r["codec"] == "echo4"] == (
        [got["commit"]] * len(echo))
    assert again["check_commit"] == "0000000"          # taco's checks, not re-run


@pytest.mark.parametrize("field,bad", [("device", "NVIDIA A100"), ("jax", "0.4.1")])
def test_update_refuses_another_machines_file(tmp_path, field, bad):
    from bench import kernels
    out = tmp_path / "k.json"
    out.write_text(json.dumps(_old_results({**common.env_facts(), field: bad})))
    with pytest.raises(SystemExit, match=f"{field}='{bad}'"):
        kernels.main(["--out", str(out), "--codecs", "echo4", "--update"])
    out.write_text("{")
    with pytest.raises(SystemExit, match="not a kernels results file"):
        kernels.main(["--out", str(out), "--codecs", "echo4", "--update"])


def test_covers():
    from bench import kernels
    from taco_jax import codecs
    import jax.numpy as jnp
    taco = codecs.get("taco")
    assert kernels.covers("triton", "reduce", taco, (64, 256), jnp.bfloat16)
    assert not kernels.covers("mosaic", "reduce", taco, (64, 256), jnp.bfloat16)
    echo = codecs.get("echo4")
    assert kernels.covers("triton", "decode_sum", echo, (64, 128), jnp.bfloat16)
    assert not kernels.covers("mosaic", "compress", echo, (64, 128), jnp.bfloat16)
    assert kernels.kinds_for(echo) == kernels.ECHO_KINDS and kernels.kinds_for(taco) == \
        kernels.KINDS


def test_ncu_source_summary(tmp_path):
    """bench/ncu_source.py on a three-line SASS table: shares per opcode and stall reason,
    warps from the execution count, memory instructions with their sectors, gzip input."""
    import gzip
    from bench import ncu_source
    hdr = ["Address", "Source", ncu_source.SAMPLES, ncu_source.EXECUTED, "Access Size",
           "L2 Theoretical Sectors Global", "L2 Theoretical Sectors Global Ideal",
           "stall_math", "stall_long_sb", "stall_math (Not Issued)"]
    rows = [["0x0", "  LDG.E.128 R4, desc[UR4][R2.64]", "30", "100", "128", "400", "400",
             "0", "30", "0"],
            ["0x10", "  @!P0 FMUL R1, R2, R3", "60", "100", "-", "0", "0", "60", "0", "9"],
            ["0x20", "  STG.E.64 desc[UR4][R6.64], R8", "10", "100", "64", "110", "100",
             "10", "0", "0"]]
    csv_text = '"Kernel Name","taco_compress",\n' + "\n".join(
        ",".join(f'"{v}"' for v in r) for r in [hdr, *rows]) + "\n"
    path = tmp_path / "src.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write(csv_text)
    out = ncu_source.main([str(path), "--label", "k", "--out", str(tmp_path / "s.json")])
    s = out["kernels"][0]
    assert s["label"] == "k" and s["warps"] == 100 and s["warp_instructions_per_warp"] == 3
    ops = {o["opcode"]: o for o in s["opcodes"]}
    assert ops["FMUL"]["stall_share"] == 0.6 and ops["LDG"]["instruction_share"] == 0.3333
    assert s["stall_reasons"] == {"math": 0.7, "long_sb": 0.3}
    stg = next(m for m in s["memory_instructions"] if m["sass"].startswith("STG"))
    assert (stg["l2_sectors"], stg["l2_sectors_ideal"], stg["access_bits"]) == (110, 100, "64")
    assert s["top_lines"][0]["sass"].startswith("@!P0 FMUL")
    assert (tmp_path / "s.json").exists()
    with pytest.raises(ValueError, match="no SASS table"):
        bad = tmp_path / "bad.csv"
        bad.write_text("a,b\n1,2\n")
        ncu_source.read_sass(str(bad))


def test_ncu_time_reads_durations_and_fractions(tmp_path):
    """bench/ncu_time.py: kernel durations from ncu's CSV (thousands separators, other
    kernels and metrics ignored), fractions against the x + 1 in the same log."""
    from bench import ncu_time
    head = ('"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"\n')
    rows = [("0", "wrapped_broadcast", "gpu__time_duration.sum", "81,760"),
            ("1", "loop_add_fusion", "gpu__time_duration.sum", "124,480"),
            ("1", "loop_add_fusion", "dram__bytes_read.sum", "268,449,792"),
            ("2", "taco_compress", "gpu__time_duration.sum", "122,144")]
    log = tmp_path / "ncu.log"
    log.write_text("==PROF== noise\n" + head + "".join(
        f'"{i}","{k}","{m}","ns","{v}"\n' for i, k, m, v in rows))
    assert ncu_time.durations_ns(str(log)) == {"loop_add_fusion": 124480.0,
                                               "taco_compress": 122144.0}
    out = ncu_time.main([str(log), "--label", "a", "--commit", "c", "--device", "d",
                         "--jax", "j", "--out", str(tmp_path / "o.json")])
    comp = [r for r in out["rows"] if r["kernel"] == "taco_compress"][0]
    assert comp["fraction_of_roofline"] == pytest.approx(
        ncu_time.BYTES["taco_compress"] / 122144 / (2 * 256 * 2**20 / 124480), abs=1e-3)


def test_ncu_time_knows_mosaic_kernel_names():
    from bench import ncu_time
    assert ncu_time.kernel_bytes("taco_compress_mosaic_mosaic_gpu_kernel") == \
        ncu_time.BYTES["taco_compress"]
    assert ncu_time.kernel_bytes("taco_decompress_mosaic_mosaic_gpu_kernel") == \
        ncu_time.BYTES["taco_decompress"]
    assert ncu_time.kernel_bytes("taco_reduce") is None


def test_write_json_keeps_gpu_results(tmp_path):
    """A CPU smoke run of a benchmark never replaces the committed GPU figures."""
    from bench.common import write_json
    out = tmp_path / "r.json"
    assert write_json(out, {"platform": "gpu", "x": 1}) == str(out)
    side = write_json(out, {"platform": "cpu", "x": 2})
    assert side == str(tmp_path / "r.cpu.json")
    assert json.loads(out.read_text())["x"] == 1 and json.loads(Path(side).read_text())["x"] == 2
    assert write_json(out, {"platform": "gpu", "x": 3}) == str(out)


def test_one_kernel_refuses_mosaic_for_the_4bit_codecs():
    """bench.one_kernel (the Nsight Compute driver) runs echo4's Triton kernels; asked for a
    Mosaic one it says so by name instead of running TACO's."""
    from bench import one_kernel
    with pytest.raises(SystemExit):
        one_kernel.main(["compress", "echo4", "--impl", "mosaic", "--mib", "1"])
