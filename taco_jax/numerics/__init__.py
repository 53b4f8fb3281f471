"""Numerics shared by the kernels and their references: the block view of a tensor
(`blocks`: float dtypes checked, flattened and zero-padded to whole blocks), the block
Walsh–Hadamard transform (`hadamard`), the per-block scaling and code conversions
(`quant`) and Echo's 4-bit group codes (`int4`)."""
from taco_jax.numerics import blocks, hadamard, int4, quant

__all__ = ["blocks", "hadamard", "int4", "quant"]
