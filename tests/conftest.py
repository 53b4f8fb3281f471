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


# An H200 as jax's public API describes a device that is not attached. Pallas' Triton
# lowering reads its target (fp8 casts need sm >= 8.9) from the context mesh's abstract
# device, so kernels lower for the GPU on this CPU machine (test_triton_taco,
# test_triton_echo4).
H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")


def _h200_mesh(axis_sizes: tuple[int, ...], axis_names: tuple[str, ...]):
    return jax.sharding.AbstractMesh(axis_sizes, axis_names, abstract_device=H200)


@pytest.fixture
def h200():
    """Lowerings in the test target an H200: a one-device mesh of H200s is the context mesh."""
    with jax.sharding.use_abstract_mesh(_h200_mesh((1,), ("_h200",))):
        yield


@pytest.fixture
def h200_mesh():
    """`h200_mesh(axis_sizes, axis_names)`: an abstract mesh of H200s, for a test that lowers
    a shard_map over it (as the context mesh, `jax.sharding.use_abstract_mesh`, while it
    traces and lowers; a context mesh cannot change size, hence no `h200` with it)."""
    return _h200_mesh


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
