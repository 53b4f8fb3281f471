"""Decisions that every process of a multi-process run must take together."""
from __future__ import annotations

from typing import Callable

import jax
import numpy as np


def agree_any(flag: bool, gather: Callable | None = None) -> bool:
    """True on every process when `flag` is set on any of them, so that all of them take
    the same branch (stop and checkpoint, or skip a checkpoint) before any enters a
    collective that the others would not. One process: `flag` itself, no communication.
    `gather`: the all-gather of one value per process (default
    jax.experimental.multihost_utils.process_allgather)."""
    if jax.process_count() == 1:
        return bool(flag)
    if gather is None:
        from jax.experimental import multihost_utils
        gather = multihost_utils.process_allgather
    return bool(np.any(np.asarray(gather(np.int32(bool(flag))))))


def barrier(name: str) -> None:
    """Wait until every process reaches this point (no-op with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)
