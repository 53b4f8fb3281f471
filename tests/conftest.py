"""Shared pytest setup. Keep small: only what several test files need."""
import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import jax
import pytest

# No calibration cache from this machine's user leaks into the tests: a path that does not
# exist (tests that need a cache write their own).
os.environ["TACO_JAX_CALIBRATION"] = str(Path(tempfile.mkdtemp()) / "calibration.json")

# 8 simulated CPU devices for mesh tests; must happen before any JAX backend starts.
jax.config.update("jax_num_cpu_devices", 8)

# Compile time is most of the suite's time: XLA:CPU's backend optimizations are skipped
# (~20% of the suite; every program a test compares is compiled alike), and identical
# programs compiled by several tests (the same tiny step, rebuilt) come from a compilation
# cache kept for this run, shared by the xdist workers and removed at its end by the process
# that made it. Every program is cached, however quick to compile: the child processes the
# bench and train tests start (a fresh jax each, compiling the same small programs again)
# read them back. Set before the backend starts; child processes inherit the flags.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_backend_optimization_level=0").strip()
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxcc-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
_MIN = os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
jax.config.update("jax_persistent_cache_min_compile_time_secs", float(_MIN))

# Start the backend now, with the 8 devices: a test that asks for fewer through
# train.loop.setup_backend (a preset's parallel.cpu_devices) then leaves them, whatever
# order the tests run in.
jax.devices()

# Import models/ and train/ from this checkout even when pytest is run without `python -m`,
# and the helpers beside this file (codec_bounds, kernel_cases, meshes, ...) from the test
# files in its subfolders.
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@pytest.fixture
def h200(monkeypatch):
    """Make Pallas' Triton lowering believe it targets an H200 (fp8 casts need sm >= 8.9), so
    kernels lower for the GPU on a CPU machine (test_kernels, test_kernels_echo)."""
    from jax._src.pallas.triton import gpu_info, pallas_call_registration as reg
    monkeypatch.setattr(reg.gpu_info_lib, "get_gpu_info",
                        lambda: gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H200))


@pytest.fixture
def all_checked():
    """The fused transport selects its one-launch kernels wherever they cover a call, as if
    every loopback check had passed for the modules emitted now (`fused_lowering`)."""
    from fused_lowering import assumed_checked
    with assumed_checked():
        yield


@pytest.fixture
def gpu_here(monkeypatch):
    """The fused transport's platform check passes (what the fused-kernel tests lower is a
    CUDA program)."""
    from taco_jax.collectives import fused
    monkeypatch.setattr(fused, "_platform_reason", lambda: None)
