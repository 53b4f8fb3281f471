"""bench/profile.py's trace analysis on synthetic perfetto traces (the GPU run is the real use)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
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
    for name in ("echo4_compress", "echo4_compress_feedback", "echo4_decode_sum",
                 "taco_decompress_mosaic", "taco_echo4_compress_mosaic"):
        assert profile.classify(name) == "compression", name
    for name in ("taco_fused_allreduce", "taco_fused_two_shot", "taco_fused_exchange"):
        assert profile.classify(name) == "comm", name
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
