"""Pallas Mosaic GPU (Hopper) tile math and kernels: `registers` (the register layouts and
IR helpers the tile math shares), `taco_tiles` (the Hadamard FP8 codecs' tile math), `taco`
(their compress and decompress kernels), `echo4` (echo4's tile math, its tile codec and the
kernels that check it). The names below are the Hadamard FP8 codecs' kernels and tile API
and the value-tile stores (a kernel takes a codec's tile codec from `kernels.tile_codec`)."""
from taco_jax.kernels.mosaic.registers import (BLOCK, LANE, ROWS, sm_count, store_part,
                                               store_values, swizzled, value_layout)
from taco_jax.kernels.mosaic.taco import MosaicConfig, compress, decompress
from taco_jax.kernels.mosaic.taco_tiles import (CODE_FORMATS, IN_DTYPES, OUT_DTYPES,
                                                SMEM_TRANSFORMS, decode_tile, encode_tile,
                                                hadamard_operand, load_wire_tile,
                                                scale_layout, store_wire_tile, unsupported,
                                                wire_layout)

__all__ = ["BLOCK", "LANE", "ROWS", "sm_count", "value_layout", "MosaicConfig", "compress",
           "decompress", "CODE_FORMATS", "IN_DTYPES", "OUT_DTYPES", "SMEM_TRANSFORMS",
           "decode_tile", "encode_tile", "hadamard_operand", "load_wire_tile", "scale_layout",
           "store_part", "store_values", "store_wire_tile", "swizzled", "unsupported",
           "wire_layout"]
