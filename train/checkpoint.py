"""Orbax checkpoints of the whole train state (async, keep N).

One checkpoint = `state` (params, optimizer state, step, RNG, codec/feedback state; sharded
arrays, restored into the same shardings) + `meta` (JSON: data position, config, wall time).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    def __init__(self, directory: str | Path, keep: int = 3, async_save: bool = True):
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(Path(directory).absolute(), options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Starts the save; with async saving it returns once arrays are copied off device,
        so the next train step may reuse (donate) the state's buffers."""
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)

    def restore(self, step: int, like: Any) -> tuple[Any, dict]:
        """Restore into the structure, dtypes and shardings of `like` (arrays or abstract)."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        return out.state, out.meta

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
