"""GEMMs whose epilogue keeps the codec on chip (Pallas Mosaic GPU, Hopper): the
warp-specialized GEMM's pipeline and the plain GEMM on it (`pipeline`), the GEMM whose
epilogue encodes its output tiles and stores the wire into its destinations' receive
buffers (`encode_epilogue`), the decode, sum and residual add that consumes them
(`decode_residual`), and the two as the row-parallel GEMM's compressed all-reduce or
reduce-scatter (`row_parallel`), and the column-parallel GEMM whose producer decodes the
all-gathered codes into its operand tiles (`gather_gemm`), each with its jnp reference.
The row-parallel GEMMs are selected by the library (`collectives.gemm_fused`) only where
their GPU checks passed (`kernels.fused.checked`, from `bench/gemm_codec.py`'s rows); the
column-parallel one only by explicit calls until its checks pass (`bench/gather_gemm.py`)."""
from taco_jax.kernels.gemm.config import GemmConfig
from taco_jax.kernels.gemm.decode_residual import (DecodeConfig, decode_sum_residual,
                                                   decode_sum_residual_reference)
from taco_jax.kernels.gemm.encode_epilogue import (gemm_encode, gemm_encode_exchange,
                                                   gemm_encode_reference,
                                                   loopback_gemm_encode, tile_blocks,
                                                   untile_blocks)
from taco_jax.kernels.gemm.gather_gemm import (GatherConfig, all_gather_gemm,
                                                gather_gemm_reference, loopback_gather_gemm)
from taco_jax.kernels.gemm.pipeline import matmul, matmul_reference
from taco_jax.kernels.gemm.row_parallel import (gemm_allreduce, gemm_allreduce_reference,
                                                gemm_reduce_scatter, loopback_gemm_allreduce,
                                                unsupported)

__all__ = ["GemmConfig", "DecodeConfig", "decode_sum_residual",
           "decode_sum_residual_reference", "gemm_encode", "gemm_encode_exchange",
           "gemm_encode_reference", "loopback_gemm_encode", "tile_blocks", "untile_blocks",
           "matmul", "matmul_reference", "gemm_allreduce", "gemm_allreduce_reference",
           "gemm_reduce_scatter", "loopback_gemm_allreduce", "unsupported", "GatherConfig",
           "all_gather_gemm", "gather_gemm_reference", "loopback_gather_gemm"]
