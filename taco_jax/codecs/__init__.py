"""Codecs: the compression schemes, behind one `Codec` protocol and a registry.

    codec = taco_jax.codecs.get("taco")          # or "taco-int8", "echo4", "none", ...
    enc = codec.encode(x); y = codec.decode(enc)  # or codec.roundtrip(x)

Families: `taco` (TACO and its variants), `echo` (4-bit group codes), `baselines` (no
compression, plain FP8). `register(name, factory)` adds a codec of your own."""
from taco_jax.codecs.base import (FLOAT_DTYPES, Codec, Encoded, WireCodec, check_float,
                                  from_blocks, get, n_blocks, names, register, to_blocks)
from taco_jax.codecs.taco import BlockCodec
from taco_jax.codecs.baselines import Identity
from taco_jax.codecs.echo import Echo

__all__ = ["Codec", "Encoded", "WireCodec", "BlockCodec", "Identity", "Echo", "get",
           "names", "register", "check_float", "to_blocks", "from_blocks", "n_blocks",
           "FLOAT_DTYPES"]
