"""Orbax checkpoints of the whole train state (async, keep N), verified on restore.

One checkpoint = `state` (params, optimizer state, step, RNG; sharded arrays, restored into
the same shardings) + `meta` (JSON: data position, config name, wall time, the optimizer
state's layout, and a fingerprint of the state). Orbax reads a flipped byte in an array's
data without complaint (the values just come back wrong), so every checkpoint carries one
checksum per array, computed on the devices when it is saved and compared when it is
restored.
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax import lax

from train.errors import CheckpointWriteError
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


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_DISK_FULL_TEXT = ("No space left on device", "Disk quota exceeded")


def _causes(e: BaseException):
    """e, its causes and contexts, and the members of exception groups among them."""
    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        yield x
        todo += [x.__cause__, x.__context__, *getattr(x, "exceptions", ())]


def write_failure(e: BaseException) -> str | None:
    """What went wrong when `e` stops a checkpoint write, if it is the storage's doing (a
    full disk, another OSError, TensorStore's errors that carry one): a phrase for the
    message. None for anything else."""
    for x in _causes(e):
        if (isinstance(x, OSError) and x.errno in _DISK_FULL) or any(
                t in str(x) for t in _DISK_FULL_TEXT):
            return f"the disk is full ({type(x).__name__}: {x})"
    for x in _causes(e):
        if isinstance(x, OSError) or "[OS error" in str(x):
            return f"{type(x).__name__}: {str(x).splitlines()[0][:300] if str(x) else ''}"
    return None


class _QuietWriteFailures(logging.Filter):
    """Drops Orbax's log records of a failed write (a traceback from each of its background
    threads): the Checkpointer reports the failure itself, once."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and write_failure(exc) is not None)


class Checkpointer:
    """Orbax's CheckpointManager with verified restores, and one clear error when a write
    fails: `CheckpointWriteError` naming the directory, the step and the checkpoints that
    are intact (an asynchronous save's failure is raised by the next `save` or `close`).
    Close it (`close()`, or use it as a context manager)."""

    def __init__(self, directory: str | Path, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=async_save)
        self._in_flight: int | None = None  # the step whose save may still be running
        self.async_save = async_save
        self._quiet = _QuietWriteFailures()
        logging.getLogger("absl").addFilter(self._quiet)
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        self._closed = self._failed = False

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _write_error(self, step: int, e: BaseException) -> BaseException:
        """The error to raise for `e` stopping step's save: CheckpointWriteError when the
        storage failed, else `e` itself."""
        why = write_failure(e)
        if why is None:
            return e
        self._failed = True
        if jax.process_index() == 0:  # the failed write's partial files: nothing to keep
            for partial in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
                shutil.rmtree(partial, ignore_errors=True)
        intact = [s for s in saved_steps(self.directory) if s != step]
        if intact:
            left = (f"The checkpoints already there are intact (step"
                    f"{'s' if len(intact) > 1 else ''} {', '.join(map(str, intact))}): "
                    f"`python -m train --resume {self.directory.parent}` restarts from step "
                    f"{intact[-1]}")
        else:
            left = ("There is no earlier checkpoint: `python -m train --resume "
                    f"{self.directory.parent}` starts that run over")
        return CheckpointWriteError(
            f"checkpoint of step {step} in {self.directory} could not be written: {why}. "
            f"{left} once the cause is fixed (free space, or move train.run_dir elsewhere). "
            f"The unfinished step's files were removed.")

    def _finish(self) -> None:
        """Wait for the save in flight (its failure raised as that step's), then list its
        files."""
        step, self._in_flight = self._in_flight, None
        if step is None:
            return
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - reported as the step's write failure
            raise self._write_error(step, e) from e
        self._list_files(step)

    # The files of each finished step and their sizes, kept beside the checkpoints
    # (`<directory>_files/<step>.json`): a restore first checks that they are all there
    # at their sizes, so a step with a missing or cut-short file is found unusable
    # without handing it to Orbax, whose failed restores leave reads in flight that
    # complete after their event loop closed ("RuntimeError: Event loop is closed").
    @property
    def _listing_dir(self) -> Path:
        return self.directory.with_name(f"{self.directory.name}_files")

    def _list_files(self, step: int) -> None:
        if jax.process_index() != 0:
            return
        step_dir = self.directory / str(step)
        if not step_dir.is_dir():
            return
        files = {str(f.relative_to(step_dir)): f.stat().st_size
                 for f in sorted(step_dir.rglob("*")) if f.is_file()}
        self._listing_dir.mkdir(exist_ok=True)
        tmp = self._listing_dir / f"{step}.json.tmp"
        tmp.write_text(json.dumps(files))
        tmp.replace(self._listing_dir / f"{step}.json")
        kept = {str(s) for s in saved_steps(self.directory)}
        for old in self._listing_dir.glob("*.json"):
            if old.stem not in kept:
                old.unlink(missing_ok=True)

    def _missing_files(self, step: int) -> str | None:
        """Why step's files are not those its listing names, or None (also when there is
        no listing: a checkpoint from before listings, or one whose writer was killed
        before it listed it)."""
        try:
            files = json.loads((self._listing_dir / f"{step}.json").read_text())
        except (OSError, ValueError):
            return None
        step_dir = self.directory / str(step)
        for name, size in files.items():
            try:
                now = (step_dir / name).stat().st_size
            except OSError:
                return f"its file {name} is missing"
            if now != size:
                return f"its file {name} has {now} bytes, {size} when it was saved"
        return None

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Starts the save; with async saving it returns once arrays are copied off device,
        so the next train step may reuse (donate) the state's buffers."""
        self._finish()  # the previous save first: its failure is its own step's
        (self._listing_dir / f"{step}.json").unlink(missing_ok=True)  # a step written anew
        meta = {**meta, "fingerprint": fingerprint(state)}
        self._in_flight = step
        try:
            self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
        except Exception as e:  # noqa: BLE001
            self._in_flight = None
            raise self._write_error(step, e) from e
        if not self.async_save:  # written already: list its files now
            self._finish()

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
        why = self._missing_files(step)
        if why is None and optimizer is not None:
            why = self._layout_mismatch(step, optimizer)
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
        self._finish()  # a save in flight: finished (and listed) first
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
            (self._listing_dir / f"{step}.json").unlink(missing_ok=True)
        barrier(f"checkpoint step {step} set aside")
        return dest

    def close(self) -> None:
        """Wait for the save in flight (raising CheckpointWriteError if it failed) and
        close the manager; closing again does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            self._finish()
        finally:
            # after a failed write, closing repeats it: it is reported already
            with contextlib.suppress(Exception) if self._failed else contextlib.nullcontext():
                self.manager.close()
            logging.getLogger("absl").removeFilter(self._quiet)
