"""Fused Pallas GPU kernels of the codec (compress, decompress, the two-shot owner's
reduce), each with its plain-jnp reference in the same file, and `dispatch`, which picks
one or the other. `tiling` holds the kernels' shared config and plumbing."""
from taco_jax.kernels import compress, decompress, dispatch, reduce, tiling
from taco_jax.kernels.tiling import KernelConfig

__all__ = ["compress", "decompress", "reduce", "dispatch", "tiling", "KernelConfig"]
