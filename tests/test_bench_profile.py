"""bench/profile.py's trace analysis on synthetic perfetto traces (the GPU run is the real use)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import profile  # noqa: E402


def _trace(kernels, device=0, extra_threads=()):
    """kernels: (name, ts, dur, stream) on /device:GPU:<device>; plus a host thread and an
    'XLA Ops' thread that repeats every kernel (must not be counted twice)."""
    ev = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
          {"ph": "M", "pid": 7, "name": "process_name",
           "args": {"name": f"/device:GPU:{device} NVIDIA H200"}},
          {"ph": "M", "pid": 8, "name": "process_name",
           "args": {"name": f"/device:GPU:{device + 10} other"}},
          {"ph": "M", "pid": 7, "tid": 99, "name": "thread_name", "args": {"name": "XLA Ops"}}]
    streams = sorted({k[3] for k in kernels})
    for s in streams:
        ev.append({"ph": "M", "pid": 7, "tid": s, "name": "thread_name",
                   "args": {"name": f"Stream #{s}(Compute)"}})
    for name, ts, dur, s in kernels:
        ev.append({"ph": "X", "pid": 7, "tid": s, "ts": ts, "dur": dur, "name": name})
        ev.append({"ph": "X", "pid": 7, "tid": 99, "ts": ts, "dur": dur, "name": name})
        ev.append({"ph": "X", "pid": 8, "tid": s, "ts": ts, "dur": 1000, "name": name})
    ev.append({"ph": "X", "pid": 1, "tid": 5, "ts": 0, "dur": 10_000, "name": "PjitFunction"})
    return ev


def test_classify():
    assert profile.classify("ncclDevKernel_AllGather_RING_LL") == "comm"
    assert profile.classify("taco_compress") == "compression"
    assert profile.classify("taco_reduce_kernel_0d1d") == "compression"
    assert profile.classify("loop_fusion_3") == "compute"
    assert profile.classify("sm90_xmma_gemm_bf16bf16") == "compute"


def test_breakdown_overlap_and_idle():
    # two iterations; stream 1: compute + compression, stream 2: NCCL partly under them
    ks = []
    for base in (0, 100):
        ks += [("gemm", base + 0, 30, 1), ("taco_compress", base + 30, 20, 1),
               ("ncclDevKernel_AllToAll", base + 40, 40, 2), ("taco_decompress", base + 85, 10, 1)]
    row = profile.breakdown(profile.device_kernels(_trace(ks)), iters=2)
    assert row["wall_us"] == 97.5            # (195 - 0) / 2
    assert row["compute_us"] == 30
    assert row["compression_us"] == 30
    assert row["comm_us"] == 40
    assert row["comm_overlap_us"] == 10      # [40, 50) under taco_compress
    assert row["comm_exposed_us"] == 30
    assert row["idle_us"] == 7.5             # gaps [80,85), [95,100), [180,185): 15 / 2
    assert row["n_kernels"] == 8
    assert row["top_kernels"][0]["name"] == "ncclDevKernel_AllToAll"


def test_device_kernels_picks_the_device_and_skips_op_threads():
    ks = [("gemm", 0, 5, 1)]
    assert len(profile.device_kernels(_trace(ks), device=0)) == 1
    with pytest.raises(ValueError, match="GPU:3"):
        profile.device_kernels(_trace(ks), device=3)


def test_breakdown_of_nothing_is_an_error():
    with pytest.raises(ValueError, match="no device kernels"):
        profile.breakdown([], iters=1)


def test_plot_writes_png(tmp_path):
    rows = [{"workload": "psum", "mib_per_device": 256, "codec": c, "transport": "xla",
             "compute_us": 1.0, "compression_us": 2.0, "comm_exposed_us": 3.0, "idle_us": 0.5,
             "comm_overlap_us": 1.0} for c in ("none", "taco")]
    out = profile.plot(rows, str(tmp_path / "b.png"))
    assert Path(out).stat().st_size > 1000


def test_kernels_stage_copy_kernel():
    """bench/kernels.py --stages' plumbing ceiling: a Pallas copy with compress's tiling and
    wire layout writes the fp8 cast of each row and zero scale bytes (interpret mode)."""
    import jax.numpy as jnp
    import numpy as np
    from bench import kernels
    from taco_jax.kernels import tiling as common
    x = (jnp.arange(37 * 256, dtype=jnp.float32).reshape(37, 256) / 1000).astype(jnp.bfloat16)
    want = np.asarray(jnp.asarray(x).astype(jnp.float8_e4m3fn)).view(np.uint8)
    for row in (264, 272):     # the wire row, and padded to 16-byte alignment
        w = np.asarray(kernels.copy_kernel(x, row, common.KernelConfig(16)))
        np.testing.assert_array_equal(w[:, :256], want)
        assert w.shape == (37, row) and not w[:, 256:].any()


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
