"""The tile codec: what a Pallas Mosaic GPU kernel body needs of a codec to send its data
compressed, on tiles of 64 rows of 256 values (one warpgroup, Lane lowering semantics).

A kernel that moves wire tiles itself — the fused all-reduce kernels (`kernels.fused`), a
GEMM whose epilogue encodes its output — is codec-blind: it asks `for_codec(codec)` for the
codec's tile codec and calls the `TileCodec` methods below, never a codec family's class.
A codec names its tile codec through its kernel provider (`Codec.kernels`, whose `tiles`
loads its family's tile-codec class: `mosaic.taco_tiles.TacoTiles` for the Hadamard FP8
codecs, `mosaic.echo4.Echo4Tiles` for echo4); a family without one has no tile codec.

A tile's wire is 64 wire rows of `row_bytes` bytes each (the codec's rows for the tile's
blocks, byte for byte), 64·row_bytes bytes in all, a multiple of 256 (whole TMA lines).
Its register form between `encode` and `store`, `load` and `decode_add`, is the tile
codec's own ("wire" below): pass it on as it is.

The epilogue of a kernel whose program holds a (64, 256) output tile, sent compressed:

    why = tile_codec.unsupported(codec, dtype)      # None: covered (check in the wrapper)
    tiles = tile_codec.for_codec(codec)
    # scratch: tiles.operands(dtype) copied to SMEM once (consts), the tile in SMEM
    # (`x_transforms(dtype)`; `staging(dtype)` where a staged copy is encoded instead)
    wire = tiles.encode(x_smem, consts)
    tiles.store(dst.reshape(ROWS, tiles.row_bytes), wire)   # SMEM staging, GMEM, a peer's
    # …and where the wire arrives (a (64, row_bytes) view), decoded and added in f32:
    total = tiles.decode_add(tiles.load(view, part, parts), consts, vec, part, parts, total)
    values = tiles.finish(total, vec, parts)  # (64, 256/parts) f32, registers.value_layout

`kernels.fused.body` has what the fused kernels build on these (`sum_tiles`: the P-way
decode and sum; `stage_f32`)."""
from __future__ import annotations

from typing import Any, Protocol

# a tile: ROWS rows of BLOCK values
from taco_jax.kernels.mosaic.registers import BLOCK, ROWS  # noqa: F401

LINE = 256             # bytes per TMA line of a wire tile


class TileCodec(Protocol):
    """A codec's math on one tile of 64 rows of 256 values, for a kernel body.

    Names used below. `in_dtype`: the kernel's input (bf16, f16 or f32). `consts`: the
    shared-memory copies of `operands(in_dtype)`, in order. `view`: a (64, row_bytes) uint8
    ref of 64 wire rows (SMEM, e.g. a (64·row_bytes/256, 256) buffer reshaped, or GMEM,
    a peer's included); rows 8-byte aligned. `parts`: 1 or 2, the decode's column passes
    (part p covers columns [p·256/parts, (p+1)·256/parts)). `vec`: the value layout's
    vector length (`registers.value_vec(dtype)` of the dtype the values end in)."""

    codec: Any

    # FusedConfig options that act on this tile math (the fused kernels refuse them for a
    # tile codec without them): "sum_first" (its decode_add keeps a sum before the inverse
    # transform, `finish` completes it), "encode_parts" (its encode in column passes),
    # "warp_specialized" (the warp-specialized one-shot body is built and measured for it).
    options: frozenset

    @property
    def row_bytes(self) -> int:
        """Wire bytes of one tile row (the codec's rows for its 256 values)."""

    def unsupported(self, dtype) -> str | None:
        """Why this tile math does not cover the codec with `dtype` input (None: it does);
        a message naming the codec and what it lacks."""

    # -- the input tile ----------------------------------------------------------------------
    def x_transforms(self, in_dtype) -> tuple:
        """SMEM transforms of a (64, 256) in_dtype input tile, as TMA copies it in."""

    def x_slots(self, in_dtype) -> int:
        """Input tiles to keep in flight by default (2: double-buffered)."""

    def staging(self, in_dtype):
        """`plgpu.SMEM` of the tile that `encode` reads in place of an in_dtype input tile
        (its copy converted, `body.stage_f32`), or None where it reads the input tile."""

    def operands(self, in_dtype) -> tuple:
        """The constant operands `encode` and `decode` read from SMEM: ((array, SMEM
        transforms), …), copied in once per program."""

    # -- encode --------------------------------------------------------------------------
    def encode(self, x_smem, consts):
        """A (64, 256) tile (the input tile, or its `staging`) → its wire, in registers."""

    def store(self, view, wire) -> None:
        """The wire of `encode` or `sum_encode` → a view of 64 wire rows."""

    # -- decode ----------------------------------------------------------------------------
    def load(self, view, part: int, parts: int):
        """A view of 64 wire rows → what `decode_add` takes for column part `part`."""

    def decode_add(self, wire, consts, vec: int, part: int, parts: int, total=None):
        """Column part `part` of a loaded wire tile, decoded in f32, plus `total` (a
        previous result of decode_add for the same part; None: the first). The running
        sum of P tiles stays one register array; `finish` makes values of it."""

    def finish(self, total, vec: int, parts: int):
        """decode_add's running sum → (64, 256/parts) f32 values (value layout of vec)."""

    def decode(self, view, consts, out_dtype, parts: int) -> list:
        """A view of 64 wire rows → `parts` (64, 256/parts) out_dtype arrays (value
        layout), for `registers.store_values`."""

    # -- the owner's sum (the two-shot all-reduce: an exact tile plus decoded wire tiles in
    # f32, encoded once) ---------------------------------------------------------------
    def own_scratch(self, in_dtype) -> tuple:
        """`plgpu.SMEM`s the owner's exact tile needs: the first receives it (TMA)."""

    def sum_init(self, own, consts):
        """The owner's exact tile (refs of `own_scratch`) → the sum's first term."""

    def sum_load(self, view):
        """A view of 64 wire rows → what `sum_add` takes."""

    def sum_add(self, total, wire, consts):
        """total + a loaded wire tile, decoded, in f32 (in the sum's own form)."""

    def sum_encode(self, total):
        """The sum → its wire, as `store` takes it (one quantization)."""

    # -- references (plain jnp) ----------------------------------------------------------
    def encoded(self, v):
        """What the kernels encode of input v (e.g. f32 input as bf16)."""

    def code_step(self, wire):
        """(rows, row_bytes) wire rows → (rows, 1) f32: the most that one step of one code
        of a row moves a decoded value (for checks against the references)."""


def _tiles_of(codec):
    """The tile-codec class of `codec`'s family, or None where it has none."""
    provider = codec.kernels
    return None if provider is None or provider.tiles is None else provider.tiles()


def unsupported(codec, dtype) -> str | None:
    """Why no tile codec covers `codec` with `dtype` input (None: `for_codec` gives one
    that does)."""
    cls = _tiles_of(codec)
    if cls is None:
        family = "no GPU kernels" if codec.kernels is None else \
            f"its {codec.kernels.name} kernels have none"
        return f"{codec.name}: no tile codec ({family})"
    return cls(codec).unsupported(dtype)


def for_codec(codec, **options) -> TileCodec:
    """The tile codec of `codec`.

    Args:
      codec: a codec (`taco_jax.codecs.Codec`).
      **options: fields of the tile codec among its `options` (TacoTiles: sum_first=True,
        encode_parts=2); none: its defaults.
    Returns:
      its tile codec; whether that covers an input dtype: `unsupported(codec, dtype)`.
    Raises:
      ValueError: the codec's family has no tile codec, or an option it does not take."""
    cls = _tiles_of(codec)
    if cls is None:
        raise ValueError(unsupported(codec, None))
    bad = sorted(set(options) - cls.options)
    if bad:
        raise ValueError(f"{codec.name}'s tile codec takes no {', '.join(bad)} (its "
                         f"options: {', '.join(sorted(cls.options)) or 'none'})")
    return cls(codec, **options)
