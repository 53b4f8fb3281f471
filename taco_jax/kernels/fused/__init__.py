"""One-launch compressed all-reduce kernels (Pallas Mosaic GPU, Hopper) that move wire
tiles between devices themselves, through the codec's tile codec (`kernels.tile_codec`), and
the fused transport's exchange kernel: `config` (FusedConfig, the measured presets), `peers`
(Remote, Loopback), `body` (the decode-and-sum and staging the bodies share), `launch`,
one file per kernel body (`one_shot`, `one_shot_ws`, `two_shot`, `exchange`), and
`checked` (what the fused transport selects: the kernels, codecs and dtypes whose GPU
checks passed for the modules they emit now). The names below are their public face."""
from taco_jax.kernels.fused.config import (ABLATIONS, FP8_DECODE, SLIM_2_PER_SM, SMEM_PER_SM,
                                           SMEM_RESERVED, TWO_SHOT_ABLATIONS, WARP_SPECIALIZED,
                                           FusedConfig)
from taco_jax.kernels.fused.exchange import exchange_kernel
from taco_jax.kernels.fused.one_shot import (default_config, one_shot_allreduce,
                                             one_shot_reference, one_shot_loopback,
                                             reference_mismatch, reference_steps, smem_bytes,
                                             unsupported)
from taco_jax.kernels.fused.one_shot_ws import ws_unsupported
from taco_jax.kernels.fused.peers import Loopback, Remote, signal_released
from taco_jax.kernels.fused.two_shot import (two_shot_loopback, two_shot_allreduce,
                                             two_shot_config, two_shot_layout,
                                             two_shot_reference)

__all__ = ["ABLATIONS", "TWO_SHOT_ABLATIONS", "FP8_DECODE", "SLIM_2_PER_SM", "SMEM_PER_SM",
           "SMEM_RESERVED", "WARP_SPECIALIZED", "FusedConfig", "exchange_kernel",
           "default_config", "one_shot_allreduce", "one_shot_reference",
           "one_shot_loopback", "reference_mismatch", "reference_steps", "smem_bytes",
           "unsupported", "ws_unsupported", "Loopback", "Remote", "signal_released",
           "two_shot_loopback", "two_shot_allreduce",
           "two_shot_config", "two_shot_layout", "two_shot_reference"]
