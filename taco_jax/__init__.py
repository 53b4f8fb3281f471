"""taco_jax: compressed tensor-parallel collectives for JAX.

    y = taco_jax.psum(x, "tp")                 # inside jax.shard_map: was lax.psum
    with taco_jax.config(codec="taco", min_bytes=1 << 20):
        ...                                    # the recipe for everything traced here
"""
import importlib
import importlib.metadata

from taco_jax import codecs, telemetry
from taco_jax.collectives import (DEFAULT_MIN_BYTES, UnboundAxisError, all_gather,
                                  all_gather_matmul, feedback, matmul_psum,
                                  matmul_reduce_scatter, ppermute,
                                  psum, psum_scatter, psum_two_level, pvary)
from taco_jax.collectives.feedback import (FeedbackState, psum_with_feedback,
                                           pvary_with_feedback)
from taco_jax.recipe import Recipe, config

try:     # one source: pyproject.toml's version, as the installed distribution records it
    __version__ = importlib.metadata.version("taco_jax")
except importlib.metadata.PackageNotFoundError:    # imported from a checkout not installed
    __version__ = "0+unknown"

__all__ = ["psum", "pvary", "all_gather", "psum_scatter", "ppermute", "psum_two_level", "psum_with_feedback",
           "pvary_with_feedback", "FeedbackState", "feedback", "config", "Recipe", "codecs",
           "telemetry", "calibrate", "UnboundAxisError", "DEFAULT_MIN_BYTES",
           "all_gather_matmul", "matmul_reduce_scatter", "matmul_psum"]


def __getattr__(name):
    # `taco_jax.calibrate` on first use: imported eagerly, `python -m taco_jax.calibrate`
    # would find its own module already loaded (runpy's RuntimeWarning).
    if name == "calibrate":
        return importlib.import_module("taco_jax.calibrate")
    raise AttributeError(f"module 'taco_jax' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), "calibrate"])
