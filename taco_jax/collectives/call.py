"""One collective call's validated static arguments and its compress-or-not decision."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from taco_jax import codecs, recipe, telemetry
from taco_jax.collectives import axes as axes_lib

# Below this many bytes per device, lax's collective is used: the conservative threshold
# when no calibration is given. On 2×H200 NVLink the compressed two-shot only breaks even
# from ~1 GiB per device (docs/results.md); slower links break even far lower, see
# `taco_jax.calibrate`.
DEFAULT_MIN_BYTES = 512 << 20


@dataclasses.dataclass(frozen=True)
class Call:
    op: str
    codec: Any
    axes: tuple
    p: int
    min_bytes: int
    vma: bool

    @property
    def axis(self):
        """The axis argument lax collectives take (one name, or the tuple)."""
        return axes_lib.name(self.axes)

    @staticmethod
    def make(op: str, axis_name, codec, min_bytes) -> "Call":
        r = recipe.current()
        axes = axes_lib.resolve(axis_name, op)
        p = axes_lib.size(axes, op)
        codec = codecs.get(r.codec if codec is None else codec)
        if min_bytes is None:
            min_bytes = DEFAULT_MIN_BYTES if r.min_bytes is None else r.min_bytes
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"taco_jax.{op}: min_bytes={min_bytes!r} must be an int >= 0")
        return Call(op, codec, axes, p, min_bytes, axes_lib.check_vma(axes))

    def taps(self, v) -> bool:
        """Does telemetry.capture see this leaf? Every float all-reduce over > 1 device."""
        return self.p > 1 and jnp.issubdtype(v.dtype, jnp.floating)

    def plain_reason(self, v, invariant: bool = False) -> str | None:
        """Why this leaf goes through lax's exact collective; None if it is compressed."""
        if self.p == 1:
            return "axis of size 1"
        if self.codec.is_identity:
            return f"codec {self.codec.name!r}"
        if v.dtype not in codecs.FLOAT_DTYPES:
            return f"dtype {v.dtype}"
        if axes_lib.reduced_or_unreduced(v):
            return "reduced/unreduced sharding type"
        if invariant:
            return "input invariant over the axis"
        nbytes = v.size * v.dtype.itemsize
        if nbytes < self.min_bytes:
            return f"{nbytes} B < min_bytes={self.min_bytes}"
        return None

    def decide(self, v, op: str | None = None, invariant: bool = False) -> bool:
        """Compress this leaf? Records the site and the reason (telemetry.sites)."""
        why = self.plain_reason(v, invariant)
        telemetry.note_site(op or self.op, v.shape, v.dtype, self.axes, self.codec.name, why,
                            self.p)
        return why is None
