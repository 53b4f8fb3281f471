"""The ways a run stops that are expected (another trainer holds its directory, a resumed
run asked to become another, a full disk, a damaged file): each message names what and
where and says what to do, and `python -m train` prints it without a traceback."""
from __future__ import annotations


class TrainError(Exception):
    """An expected stop of a run; its message says what happened and what to do.
    `python -m train` prints it and exits with `exit_status`."""

    exit_status = 1


class RunDirInUse(TrainError, FileExistsError):
    """The run directory cannot be used by this run: a fresh run (no resume) was given one
    that holds checkpoints, or another trainer holds it now."""

    exit_status = 2


class RunChanged(TrainError, ValueError):
    """A resumed run was given settings that would make it another run."""

    exit_status = 2


class CorruptRunFile(TrainError, ValueError):
    """A run's file (metrics.jsonl) is damaged where it cannot be repaired safely."""


class CheckpointWriteError(TrainError, OSError):
    """A checkpoint could not be written (a full disk, say); the earlier ones are intact."""


class TokenCacheError(TrainError, OSError):
    """A token cache entry is damaged and could not be rebuilt."""
