"""Fused GPU kernels of the codec (compress, decompress, the two-shot owner's reduce), each
with its plain-jnp reference, in two implementations: Pallas-Triton (`compress`,
`decompress`, `reduce`: every codec with kernels, block size and dtype) and Pallas Mosaic GPU
(`mosaic`: compress and decompress of the B = 256 Hadamard FP8 codecs, plus tile functions
for kernels that move wire rows themselves). `dispatch` picks the reference or a kernel
implementation per call; `tiling` holds the Triton kernels' shared config and plumbing."""
from taco_jax.kernels import compress, decompress, dispatch, mosaic, reduce, tiling
from taco_jax.kernels.mosaic import MosaicConfig
from taco_jax.kernels.tiling import KernelConfig

__all__ = ["compress", "decompress", "reduce", "mosaic", "dispatch", "tiling", "KernelConfig",
           "MosaicConfig"]
