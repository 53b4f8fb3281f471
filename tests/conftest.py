"""Shared pytest setup. Keep small: only what several test files need."""
import os
import sys
import tempfile
from pathlib import Path

import jax

# No calibration cache from this machine's user leaks into the tests: a path that does not
# exist (tests that need a cache write their own).
os.environ["TACO_JAX_CALIBRATION"] = str(Path(tempfile.mkdtemp()) / "calibration.json")

# 8 simulated CPU devices for mesh tests; must happen before any JAX backend starts.
jax.config.update("jax_num_cpu_devices", 8)

# Import models/ and train/ from this checkout even when pytest is run without `python -m`.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
