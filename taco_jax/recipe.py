"""The compression recipe: which codec, from which size, on which backend and transport.

    with taco_jax.config(codec="taco", min_bytes=1 << 20):
        step = jax.jit(train_step)        # every taco_jax op traced here uses the recipe

The recipe is read when a function is traced (as Transformer Engine's `fp8_autocast`
does); arguments given to a call override it. Contexts nest: an inner `config` changes only
the fields it names. A jitted function traced before a `config` change keeps the recipe it
was traced with (jax caches traces by argument types, not by this context)."""
from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Iterator

from taco_jax import codec_registry as registry
from taco_jax._scoped import ScopedStack
from taco_jax.routes import TRANSPORTS

BACKENDS = ("auto", "pallas", "interpret", "reference")


@dataclasses.dataclass(frozen=True)
class Recipe:
    codec: str = "taco"          # codec name (taco_jax.codecs.names()) or a Codec object
    # tensors smaller than this many bytes per device use the exact lax collective;
    # None: the calibrated threshold for this machine, else DEFAULT_MIN_BYTES
    min_bytes: int | None = None
    # kernels: "auto" (Pallas on GPU, jnp references elsewhere), "pallas", "interpret"
    # (Pallas' interpreter, for CPU tests) or "reference" (jnp everywhere)
    backend: str = "auto"
    # how compressed bytes move: "xla" (XLA's all-to-all / all-gather), "fused" (in-kernel
    # stores into the peers' memory; GPUs of one process) or "auto" (the calibration's
    # choice per size, else "xla")
    transport: str = "auto"
    # Under jax.vmap(axis_name=...) (tensor parallelism emulated on one device): False, the
    # collectives follow vmap's own convention (as shard_map's check_vma=False); True, they
    # behave as under shard_map's check_vma=True: psum's result is replicated and its
    # backward passes the cotangent through, pvary's backward is the (compressed)
    # all-reduce. True reproduces a check_vma=True model's compression points exactly.
    vmap_check_vma: bool = False

    def __post_init__(self):
        # every field is checked here, where the recipe is made, rather than at the first
        # call that reads it (which may come much later, or never under this recipe)
        if isinstance(self.codec, str):
            if self.codec not in registry.names():
                raise ValueError(f"taco_jax recipe: codec={self.codec!r} is not a codec name; "
                                 f"taco_jax.codecs.names(): {', '.join(registry.names())}")
        elif not isinstance(self.codec, registry.Codec):
            raise TypeError(f"taco_jax recipe: codec={self.codec!r} must be a codec name "
                            f"({', '.join(registry.names())}) or a taco_jax.codecs.Codec")
        if self.backend not in BACKENDS:
            raise ValueError(f"taco_jax recipe: backend={self.backend!r} is not one of "
                             f"{BACKENDS}")
        if self.transport != "auto" and self.transport not in TRANSPORTS:
            raise ValueError(f"taco_jax recipe: transport={self.transport!r} is not 'auto' or "
                             f"one of {TRANSPORTS}")
        if self.min_bytes is not None and (isinstance(self.min_bytes, bool)
                                           or not isinstance(self.min_bytes, int)
                                           or self.min_bytes < 0):
            raise ValueError(f"taco_jax recipe: min_bytes={self.min_bytes!r} must be None or "
                             f"an int >= 0")
        if not isinstance(self.vmap_check_vma, bool):
            raise TypeError(f"taco_jax recipe: vmap_check_vma={self.vmap_check_vma!r} must be "
                            f"True or False")


_recipes = ScopedStack()


def _base() -> Recipe:
    env = os.environ.get("TACO_JAX_BACKEND")
    return Recipe(backend=env) if env else Recipe()


def current() -> Recipe:
    """The recipe in effect here (innermost `config`, else defaults; the environment
    variable TACO_JAX_BACKEND sets the default backend)."""
    return _recipes.top() or _base()


def config(**fields) -> contextlib.AbstractContextManager[Recipe]:
    """Set recipe fields for the taco_jax collectives traced inside the block.

        with taco_jax.config(codec="taco", min_bytes=1 << 20):
            step = jax.jit(train_step)

    Every field is checked when `config(...)` is called, before the block is entered.

    Args:
      **fields: any of `Recipe`'s fields; the others keep their value in the enclosing
        recipe (the defaults outside any `config`).
        codec: a name from `taco_jax.codecs.names()` or a `taco_jax.codecs.Codec` object.
          Default "taco".
        min_bytes: an int >= 0: tensors with fewer bytes per device go through the exact
          lax collective; None (default): this machine's calibration, else
          `taco_jax.DEFAULT_MIN_BYTES`.
        backend: "auto" (default), "pallas", "interpret" or "reference".
        transport: "auto" (default), "xla" or "fused".
        vmap_check_vma: bool, default False (see `Recipe`).

    Returns:
      A context manager; entering it yields the `Recipe` in effect inside the block.

    Raises:
      TypeError: a field that `Recipe` does not have (the message lists them), a codec that
        is neither a name nor a Codec, or a vmap_check_vma that is not a bool.
      ValueError: a codec name that is not registered, or a backend, transport or min_bytes
        outside the values above; each message names the value and the valid ones.
    """
    unknown = set(fields) - {f.name for f in dataclasses.fields(Recipe)}
    if unknown:
        raise TypeError(f"taco_jax.config: unknown field(s) {sorted(unknown)}; fields: "
                        f"{[f.name for f in dataclasses.fields(Recipe)]}")
    dataclasses.replace(current(), **fields)        # checks every field now
    return _entered(fields)


@contextlib.contextmanager
def _entered(fields) -> Iterator[Recipe]:
    recipe = dataclasses.replace(current(), **fields)   # relative to the recipe at entry
    with _recipes.pushed(recipe):
        yield recipe
