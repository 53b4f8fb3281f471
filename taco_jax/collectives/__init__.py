"""Compressed collectives for use inside `jax.shard_map`: drop-ins for lax's.

`psum` ↔ `pvary` (Megatron's g and f) and `all_gather` ↔ `psum_scatter` are `custom_vjp`
pairs whose backward passes are themselves compressed collectives; all four rest on the
one two-shot implementation in `two_shot`; `ppermute` (pipeline stages) is
its own inverse's transpose. `all_gather_matmul` ↔ `matmul_reduce_scatter` (Megatron-SP's
GEMMs with their collectives overlapped, `matmul`) are another such pair; `matmul_psum`
is tensor parallelism's row-parallel GEMM with its all-reduce and residual add, which the
fused transport runs (as it runs matmul_reduce_scatter) as one GEMM launch whose epilogue
encodes and one decode launch (`gemm_fused`). `feedback` adds
error feedback along a residual stream."""
from taco_jax.collectives import feedback
from taco_jax.collectives.allreduce import psum, pvary
from taco_jax.collectives.axes import UnboundAxisError
from taco_jax.collectives.call import DEFAULT_MIN_BYTES
from taco_jax.collectives.gather import all_gather, psum_scatter
from taco_jax.collectives.gemm_fused import matmul_psum
from taco_jax.collectives.hierarchical import psum_two_level
from taco_jax.collectives.matmul import all_gather_matmul, matmul_reduce_scatter
from taco_jax.collectives.permute import ppermute

__all__ = ["psum", "pvary", "all_gather", "psum_scatter", "ppermute", "psum_two_level", "feedback", "UnboundAxisError",
           "DEFAULT_MIN_BYTES", "all_gather_matmul", "matmul_reduce_scatter", "matmul_psum"]
