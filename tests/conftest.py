"""Shared pytest setup. Keep small: only what several test files need."""
import sys
from pathlib import Path

import jax

# 8 simulated CPU devices for mesh tests; must happen before any JAX backend starts.
jax.config.update("jax_num_cpu_devices", 8)

# Import models/ and train/ from this checkout even when pytest is run without `python -m`.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
