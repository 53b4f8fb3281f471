"""One trainer per run directory: an exclusive lock held while a run trains.

The lock is `fcntl.flock` on `<run_dir>/train.lock`: the kernel drops it when the holding
process exits however it ends (killed included), so a crashed run never leaves a stale
lock behind. The file records who holds it (pid, host, start time, command), which a
refused trainer names.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from train.errors import RunDirInUse

LOCK_NAME = "train.lock"


def holder(run_dir: str | Path) -> dict:
    """What the lock file of `run_dir` says about its holder ({} if nothing readable)."""
    try:
        info = json.loads((Path(run_dir) / LOCK_NAME).read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def describe_holder(info: dict) -> str:
    if not info:
        return "another process (its lock file names no holder yet)"
    since = info.get("since")
    when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since)) if since else ""
    return f"pid {info.get('pid', '?')} on host {info.get('host', '?')}{when}"


class RunDirLock:
    """The exclusive lock of a run directory. `RunDirLock(run_dir)` takes it (creating the
    directory) or raises RunDirInUse naming the directory and the holder; `release()` (or
    the end of a `with` block, or the process's exit) gives it back."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.created = not self.run_dir.exists()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / LOCK_NAME
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            self._fd = None
            raise RunDirInUse(
                f"run directory {self.run_dir} is in use by another trainer "
                f"({describe_holder(holder(self.run_dir))}, lock {self.path}): wait for it "
                f"to finish or stop it, then `python -m train --resume {self.run_dir}`; or "
                f"give this run another train.run_dir") from None
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                "argv": sys.argv}
        os.ftruncate(self._fd, 0)
        os.write(self._fd, (json.dumps(info) + "\n").encode())

    def release(self) -> None:
        """Give the lock back. A directory this lock created that holds nothing else (a run
        refused or failed before it wrote anything) is removed again."""
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)
        empty = self.created and [p.name for p in self.run_dir.iterdir()] == [LOCK_NAME]
        if empty:  # unlinked while still held: no one can take a lock on a file gone
            self.path.unlink(missing_ok=True)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None
        if empty:
            try:
                self.run_dir.rmdir()
            except OSError:  # someone wrote into it meanwhile
                pass

    def __enter__(self) -> "RunDirLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
