"""Orbax checkpoints of the whole train state (async, keep N), verified on restore.

One checkpoint = `state` (params, optimizer state, step, RNG; sharded arrays, restored into
the same shardings) + `meta` (JSON: data position, config name, wall time, the optimizer
state's layout, and a fingerprint of the state). Orbax reads a flipped byte in an array's
data without complaint (the values just come back wrong), so every checkpoint carries one
checksum per array, computed on the devices when it is saved and compared when it is
restored.
"""
from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax import lax

from train.multihost import agree_any, barrier

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _bits_sum(x: jax.Array) -> jax.Array:
    """Sum of the array's bit patterns as uint32, wrapping: any single changed element
    changes it. Exact integer arithmetic, so the same for every sharding."""
    if x.dtype == jnp.bool_:
        u = x.astype(jnp.uint32)
    else:
        u = lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize]).astype(jnp.uint32)
    return jnp.sum(u, dtype=jnp.uint32)


REPLICATED = {"zero": 0}  # the optimizer layout of checkpoints that do not name one


def describe_layout(layout: dict) -> str:
    """An optimizer layout (meta["optimizer"]) in config terms."""
    if not layout.get("zero"):
        return "parallel.zero=0 (optimizer state replicated over data)"
    return (f"parallel.zero={layout['zero']} (optimizer state sharded over data="
            f"{layout.get('data')}" + (", with the fp32 master shards of a lossy "
                                       "recipe.codec_wd" if layout.get("master") else "")
            + ")")


_fingerprint = jax.jit(lambda leaves: [_bits_sum(x) for x in leaves])


def fingerprint(state: Any) -> list[int]:
    """One uint32 checksum per array of `state` (a collective with several processes: every
    process gets the same list)."""
    sums = _fingerprint(jax.tree.leaves(state))
    return [int(np.asarray(s if s.is_fully_addressable else s.addressable_data(0)))
            for s in sums]


def saved_steps(directory: str | Path) -> list[int]:
    """The steps of the finished checkpoints in `directory` (none if it does not exist),
    read without opening a CheckpointManager (which would create the directory)."""
    return sorted(ocp.utils.checkpoint_steps(Path(directory).absolute()))


class Checkpointer:
    def __init__(self, directory: str | Path, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Starts the save; with async saving it returns once arrays are copied off device,
        so the next train step may reuse (donate) the state's buffers."""
        meta = {**meta, "fingerprint": fingerprint(state)}
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)

    def restore(self, step: int, like: Any) -> tuple[Any, dict]:
        """Restore into the structure, dtypes and shardings of `like` (arrays or abstract),
        without verifying it (see `restore_latest`)."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        return out.state, out.meta

    def restore_meta(self, step: int) -> Any:
        """One step's metadata alone (no arrays read)."""
        return self.manager.restore(step, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore())).meta

    def _layout_mismatch(self, step: int, optimizer: dict) -> str | None:
        """Why step's optimizer state cannot restore into the `optimizer` layout, or None
        (also when its metadata cannot be read: the restore will say why)."""
        try:
            meta = self.restore_meta(step)
        except Exception:  # noqa: BLE001
            return None
        saved = meta.get("optimizer", REPLICATED) if isinstance(meta, dict) else None
        if saved is None or saved == optimizer:
            return None
        return (f"its optimizer state was saved with {describe_layout(saved)}, but this run "
                f"has {describe_layout(optimizer)}: resume with the setting it was saved "
                f"with")

    def _check(self, step: int, like: Any, name: str | None, optimizer: dict | None = None
               ) -> tuple[Any, dict, str | None]:
        """Restore and verify one step -> (state, meta, None) or (None, None, why not)."""
        state = meta = None
        why = None if optimizer is None else self._layout_mismatch(step, optimizer)
        if why is None:
            try:
                state, meta = self.restore(step, like)
            except Exception as e:  # noqa: BLE001 - any failure to read makes it unusable
                why = f"restore failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        if agree_any(why is not None):  # every process skips it, or none does
            return None, None, why or "restore failed on another process"
        if not isinstance(meta, dict):
            return None, None, f"metadata {meta!r} is not a mapping"
        if meta.get("data_pos") != step:
            return None, None, f"metadata data_pos={meta.get('data_pos')!r} is not the step"
        if name is not None and meta.get("name") != name:
            return None, None, f"metadata name={meta.get('name')!r}, expected {name!r}"
        if meta.get("fingerprint") != fingerprint(state):
            return None, None, ("no fingerprint in its metadata" if "fingerprint" not in meta
                                else "array data does not match its fingerprint")
        return state, meta, None

    def restore_latest(self, like: Any, name: str | None = None, set_aside: bool = True,
                       optimizer: dict | None = None) -> tuple[Any, dict, int] | None:
        """The newest checkpoint that restores and verifies -> (state, meta, step); None if
        there is no checkpoint at all.

        Steps are tried newest to oldest; one that raises, or whose metadata (data position,
        config `name`, the `optimizer` layout when given, fingerprint of the arrays) does
        not match, is reported with a warning naming it. With `set_aside` (for a run that
        goes on training and will write those steps again) the unusable ones newer than the
        restored step are moved to `<directory>_unverified/`: nothing that could not be
        verified is deleted. If no step restores, RuntimeError lists why, and every
        checkpoint is left where it is."""
        bad = []
        for step in reversed(self.all_steps()):
            state, meta, why = self._check(step, like, name, optimizer)
            if why is None:
                for s, reason in bad:
                    moved = f"moved it to {self._set_aside(s)}; " if set_aside else ""
                    warnings.warn(f"checkpoint step {s} in {self.directory} is unusable "
                                  f"({reason}); {moved}using step {step}", stacklevel=2)
                if bad and set_aside:
                    self.manager.reload()
                return state, meta, step
            bad.append((step, why))
        if not bad:
            return None
        raise RuntimeError(f"no checkpoint in {self.directory} can be restored: "
                           + "; ".join(f"step {s}: {why}" for s, why in bad)
                           + ". They are left in place; remove the directory (or the bad "
                             "steps) to start over.")

    def _set_aside(self, step: int) -> Path:
        """Move step's directory out of the manager's reach (process 0 moves it; every
        process waits for that)."""
        aside = self.directory.with_name(f"{self.directory.name}_unverified")
        dest = aside / str(step)
        if dest.exists():
            dest = aside / f"{step}-{int(time.time())}"
        if jax.process_index() == 0:
            aside.mkdir(parents=True, exist_ok=True)
            (self.directory / str(step)).rename(dest)
        barrier(f"checkpoint step {step} set aside")
        return dest

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
