"""taco_jax: compressed tensor-parallel collectives for JAX (TACO, Echo)."""
from taco_jax import codecs, telemetry, tuning
from taco_jax import feedback  # Echo error feedback: psum_with_feedback, FeedbackState
from taco_jax.collectives import all_gather, psum, psum_scatter, pvary
from taco_jax.dispatch import use_backend

__all__ = ["codecs", "telemetry", "tuning", "psum", "pvary", "all_gather", "psum_scatter",
           "use_backend"]
