"""Fused compress / decompress / reduce kernels (Pallas-Triton) and their jnp references.

Nothing outside `taco_jax.dispatch` calls these directly."""
