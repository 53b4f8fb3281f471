"""Numerics shared by the kernels and their references: the block Walsh–Hadamard transform
(`hadamard`) and the per-block scaling and code conversions (`quant`)."""
from taco_jax.numerics import hadamard, quant

__all__ = ["hadamard", "quant"]
