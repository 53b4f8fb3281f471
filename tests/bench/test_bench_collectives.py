"""bench.collectives on CPU: the network link's two processes (jax.distributed) run, time
and write the row schema; a link's child processes keep NVLink multicast off. (bench.fused:
tests/bench/test_bench_fused.py.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import collectives

ROOT = Path(__file__).resolve().parents[2]
ROW_KEYS = {"mib_per_device", "codec", "transport", "link", "n_devices", "lax_psum_us",
            "taco_psum_us", "ratio", "fresh_ratio"}


def test_network_link_runs_two_processes(tmp_path):
    out = tmp_path / "net.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu",        # the suite's quicker XLA:CPU compile
           "XLA_FLAGS": "--xla_force_host_platform_device_count=1 "
                        "--xla_backend_optimization_level=0"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    subprocess.run([sys.executable, "-m", "bench.collectives", "--sizes-mib", "0.0625",
                    "--link", "network", "--transports", "xla", "--out", str(out)],
                   cwd=ROOT, env=env, check=True, timeout=240, capture_output=True)
    res = json.loads(out.read_text())
    assert res["n_devices"] == 2 and len(res["rows"]) == 1
    row = res["rows"][0]
    assert ROW_KEYS <= set(row) and row["transport"] == "xla" and row["n_devices"] == 2
    assert row["taco_psum_us"] > 0 and row["lax_psum_us"] > 0


def test_child_environment_keeps_multicast_off(monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    env = collectives.child_env(collectives.LINK_ENV["network"])
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["NVSHMEM_DISABLE_NVLS"] == "1"
    assert env["NCCL_P2P_DISABLE"] == "1" and env["NCCL_SHM_DISABLE"] == "1"
