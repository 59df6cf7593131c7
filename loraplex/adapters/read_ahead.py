"""``ReadAhead``: which cold adapter versions the background reader may fetch from disk now.

The scheduler tells the manager, once per admission pass, the adapter versions its waiting requests
want in admission order (``AdapterManager.read_ahead``). The *window* is the first ``depth`` distinct
ones not already in a device slot: the versions the next slot releases will go to. Only those are
read (and kept most recently used in the host tier), so reads run ahead of admission by at most
``depth`` adapters: a long queue over more adapters than the host tier holds no longer makes the
reader fetch adapters that push out the ones the queue's head needs next (each would be read again,
and the reader would compete with the step loop for the CPU all run long). The head of the queue is
always in the window, so every waiting request's adapter is read in its turn (no starvation).

Before any window is declared (a manager driven without a scheduler), every cold version may be read.
Not thread-safe on its own: ``AdapterManager`` calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


def read_ahead_depth(max_loras: int, max_cpu_loras: int) -> int:
    """How many not-yet-placed adapters to keep read ahead: one full turnover of the slots, at most half
    the host tier (the other half keeps what the slots hold, so a window read does not evict them)."""
    return max(1, min(max_loras, max_cpu_loras // 2))


class ReadAhead:
    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"read-ahead depth must be >= 1, got {depth}")
        self.depth = depth
        self.window: frozenset[int] | None = None  # None: no scheduler has declared its queue yet

    def plan(self, wanted: Iterable[int], placed: Callable[[int], bool]) -> list[int]:
        """The new window: the first ``depth`` distinct ids of ``wanted`` (admission order) for which
        ``placed(id)`` (in a device slot) is False, in that order."""
        window: list[int] = []
        for version_id in wanted:
            if version_id not in window and not placed(version_id):
                window.append(version_id)
                if len(window) == self.depth:
                    break
        self.window = frozenset(window)
        return window

    def allows(self, version_id: int) -> bool:
        """Whether a cold ``version_id`` may be read now."""
        return self.window is None or version_id in self.window
