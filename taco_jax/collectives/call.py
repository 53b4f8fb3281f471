"""One collective call's validated static arguments and its compress-or-not decision."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from taco_jax import codecs, recipe, routes, telemetry
from taco_jax.collectives import axes as axes_lib, fused
from taco_jax.collectives.two_shot import lax_exchange

# Uncalibrated threshold, per device: what `python -m taco_jax.calibrate` answers on 2×H200
# NVLink (bench/results/calibrate.json: taco / lax.psum 0.98 at 256 MiB, inside its margin
# of 0.97; 0.95 at 1 GiB), so min_bytes=None means the same there with or without a cache.
DEFAULT_MIN_BYTES = 1 << 30


def transport_move(transport: str, axis):
    """The exchange function of a transport ("xla" or "fused") over `axis`. Under jax.vmap
    the members' bytes are already on this device: the vmap's own exchange moves them."""
    emulated = axes_lib.emulated(axes_lib.as_tuple(axis))
    return fused.exchange if transport == "fused" and not emulated else lax_exchange


@dataclasses.dataclass(frozen=True)
class Call:
    op: str
    codec: Any
    axes: tuple
    p: int
    min_bytes: int | None        # None: the calibration's routes, else DEFAULT_MIN_BYTES
    vma: bool
    transport: str = "auto"

    @property
    def axis(self):
        """The axis argument lax collectives take (one name, or the tuple)."""
        return axes_lib.name(self.axes)

    @staticmethod
    def make(op: str, axis_name, codec, min_bytes, transport=None, *,
             xla_only: str | None = None) -> "Call":
        """Validate one call's arguments against the recipe. xla_only: why the op moves
        its bytes with XLA's collectives only (ppermute, the feedback sites): "auto" and
        the recipe's "fused" mean "xla" there, and transport="fused" passed to the call is
        an error giving that reason."""
        r = recipe.current()
        axes = axes_lib.resolve(axis_name, op)
        p = axes_lib.size(axes, op)
        try:
            codec = codecs.get(r.codec if codec is None else codec)
        except (TypeError, ValueError) as e:      # which op was given it, too
            raise type(e)(f"taco_jax.{op}: {e}") from None
        if min_bytes is None:
            min_bytes = r.min_bytes
        if min_bytes is not None and (isinstance(min_bytes, bool)
                                      or not isinstance(min_bytes, int) or min_bytes < 0):
            raise ValueError(f"taco_jax.{op}: min_bytes={min_bytes!r} must be an int >= 0")
        if transport not in (None, "auto", *routes.TRANSPORTS):
            raise ValueError(f"taco_jax.{op}: transport={transport!r} is not 'auto' or one "
                             f"of {routes.TRANSPORTS}")
        if xla_only is not None:
            if transport == "fused":
                raise ValueError(f"taco_jax.{op}: transport='fused' cannot run it: "
                                 f"{xla_only}; use transport='xla' or 'auto'")
            transport = "xla"
        transport = r.transport if transport is None else transport
        return Call(op, codec, axes, p, min_bytes, axes_lib.check_vma(axes), transport)

    def taps(self, v) -> bool:
        """Does telemetry.capture see this leaf? Every float all-reduce over > 1 device."""
        return self.p > 1 and jnp.issubdtype(v.dtype, jnp.floating)

    def plain_reason(self, v, invariant: bool = False) -> str | None:
        """Why this leaf goes through lax's exact collective, before sizes are considered;
        None if it may take a transport."""
        if self.p == 1:
            return "axis of size 1"
        if self.codec.is_identity and not (self.transport == "fused" and self.op == "psum"):
            return f"codec {self.codec.name!r}"
        if v.dtype not in codecs.FLOAT_DTYPES:
            return f"dtype {v.dtype}"
        if axes_lib.reduced_or_unreduced(v):
            return "reduced/unreduced sharding type"
        if invariant:
            return "input invariant over the axis"
        return None

    def route(self, v, invariant: bool = False) -> str:
        """"lax", "xla" or "fused" for this leaf; records the site and the reason
        (telemetry.sites)."""
        route, why = self._route(v, invariant)
        telemetry.note_site(self.op, v.shape, v.dtype, self.axes, self.codec.name, why,
                            self.p, self._label(route, v), self.vma)
        return route

    def _label(self, route: str, v) -> str:
        """The transport as telemetry names it: an all-reduce that the fused transport
        cannot run in one launch says so and why (its separate kernels run); under
        jax.vmap the one-launch kernels run as their loopback, and the other kernels with
        the exchange left to the vmap."""
        if route != "fused":
            return route
        emulated = axes_lib.emulated(self.axes)
        why = (fused.one_launch_reason(self.codec, self.p, v.dtype)
               if self.op in ("psum", "pvary") else None)
        if why is not None:
            how = "separate kernels, exchange emulated" if emulated else "separate kernels"
            return f"fused ({how}): {why}"
        if not emulated:
            return route
        return "fused (loopback)" if self.op in ("psum", "pvary") else \
            "fused (exchange emulated)"

    def _route(self, v, invariant: bool) -> tuple[str, str | None]:
        why = self.plain_reason(v, invariant)
        if why is not None:
            return "lax", why
        nbytes = v.size * v.dtype.itemsize
        fused_why = fused.unavailable_reason(self.axes)
        if self.transport == "fused" and fused_why is not None:
            raise ValueError(f"taco_jax.{self.op}: transport='fused' cannot run here: "
                             f"{fused_why}; use transport='auto' or 'xla'")
        if self.transport == "fused":
            candidates = ("fused",)
        elif self.transport == "xla" or fused_why is not None:
            candidates = ("xla",)
        else:
            candidates = ("xla", "fused")
        cal = None
        if self.min_bytes is None and (fused_why is None or not axes_lib.emulated(self.axes)):
            cal = routes.lookup(self.p, self.codec.name)
        if cal is not None:                  # the measured routes of this machine
            route = cal.route(nbytes, candidates)
            return route, (None if route != "lax" else
                           f"{nbytes} B: lax.psum measured faster here ({cal.key})")
        threshold = DEFAULT_MIN_BYTES if self.min_bytes is None else self.min_bytes
        if nbytes < threshold:
            return "lax", f"{nbytes} B < min_bytes={threshold}"
        return ("xla" if self.transport == "auto" else candidates[0]), None

