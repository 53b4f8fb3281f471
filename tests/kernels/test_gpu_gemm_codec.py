"""The GEMM kernels with the codec in their epilogue (taco_jax/kernels/gemm) on a Hopper GPU:
the real tile codecs (taco's FP8 tiles, echo4's) through the loopback, P virtual devices in
one launch, under bench.gemm_codec's checks: the same bits on every virtual device (the
reduce-scatter's owners' rows the all-reduce's, bit for bit), a NaN reaching exactly its
row, the error against the exact sum within 1.05 × the jnp reference's, and device 0's
wire as device P − 1 received it mostly the reference's bytes.

Skipped without a Hopper GPU (the CPU tests interpret the pipeline and exchange with a
stand-in codec: tests/kernels/test_gemm_codec.py). On one:

    pytest tests/kernels/test_gpu_gemm_codec.py -k gpu
"""
import argparse

import jax
import pytest

from bench import gemm_codec
from taco_jax import codecs


def _hopper() -> bool:
    try:
        dev = jax.devices("gpu")[0]
    except RuntimeError:
        return False
    return any(kind in dev.device_kind for kind in ("H100", "H200", "H800"))


gpu = pytest.mark.skipif(not _hopper(), reason="Mosaic GPU kernels run on a Hopper GPU")


def checks(codec: str, p: int, exchange: str, shape: str = "odd", impl: str = "kernel",
           config=None, calls: int = 2) -> dict:
    """bench.gemm_codec's check row of one configuration (its `run_checks`), fresh inputs
    each call."""
    a = argparse.Namespace(codec_name=codec, impl=impl, gemm_config=config,
                           wrong_exchange=None, calls=calls)
    return gemm_codec.run_checks(a, codecs.get(codec), p, shape, exchange)


@gpu
@pytest.mark.parametrize("exchange", ["all", "owner"])
@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("codec", ["taco", "echo4"])
def test_gpu_loopback_passes_the_bench_checks(codec, p, exchange):
    """The odd shape (37 row tiles of one warpgroup, 5 K steps, 3 column tiles; "owner":
    37 · 8 / P row tiles an owner)."""
    row = checks(codec, p, exchange)
    assert row["ok"], row["reason"]
    assert row["nan_rows_ok"] and 0 < row["rel_err"] <= gemm_codec.SLACK * row[
        "reference_rel_err"]
    assert row["same_on_every_device" if exchange == "all" else "shards_are_the_all_reduce"]
    assert row["wire_rows_equal"] > 0.5, row["wire_rows_equal"]


@gpu
@pytest.mark.parametrize("codec", ["taco", "echo4"])
def test_gpu_ping_pong_launch_passes_the_bench_checks(codec):
    """350m's attention-output GEMM at TP 2 with the ping-pong launch (two compute
    warpgroups taking turns)."""
    row = checks(codec, 2, "all", "350m.attn_out", config=["pingpong=true", "steps=2"])
    assert row["ok"], row["reason"]
