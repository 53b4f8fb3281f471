"""Pallas-Triton kernels: TACO's compress, decompress, the two-shot owner's reduce and the
one-shot's decode_sum (a file each, on the shared `tiling`), and Echo's 4-bit kernels
(`echo4`). Every module here imports `jax.experimental.pallas.triton` (deprecated from jax
0.11): `providers` imports them only when a Triton kernel is built."""
