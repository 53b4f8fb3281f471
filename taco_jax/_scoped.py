"""A per-thread stack of settings for the code traced inside a `with` block: what
`taco_jax.config` (the recipe) and `kernels.dispatch.kernel_impl` push and read."""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator


class ScopedStack:
    """Values pushed for the duration of a `with` block, innermost last, one stack per
    thread (a trace runs in the thread that started it)."""

    def __init__(self):
        self._local = threading.local()

    def top(self, default: Any = None) -> Any:
        """The innermost value pushed in this thread, else `default`."""
        stack = getattr(self._local, "stack", None)
        return stack[-1] if stack else default

    @contextlib.contextmanager
    def pushed(self, value: Any) -> Iterator[Any]:
        """`value` on top of the stack inside the block; yields it."""
        stack = self._local.__dict__.setdefault("stack", [])
        stack.append(value)
        try:
            yield value
        finally:
            stack.pop()
