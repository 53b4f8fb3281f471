"""taco_jax: compressed tensor-parallel collectives for JAX."""
from taco_jax import codecs
from taco_jax.collectives import psum, pvary

__all__ = ["codecs", "psum", "pvary"]
