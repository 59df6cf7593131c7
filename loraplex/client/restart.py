"""What ``EngineProcess`` needs to restart a dead engine process: the retry policy and the adapters to load again.

``RestartPolicy``: after the engine process dies, up to ``max_attempts`` starts, the k-th after
``min(backoff_s * 2**k, max_backoff_s)`` seconds; when all fail the engine stays "dead".

``AdapterRecipes``: the calls that made the adapter table what it is, as this process sent them
(a folder path, or the tensors and config it handed over: kept here by reference while the name is
loaded), so a new engine process can load the same adapters. Per name only the current version is
replayed (older versions served requests that died with the engine); a rollback returns to the
previous recipe when one is kept (``MAX_VERSIONS_KEPT``), else the name is forgotten and not restored.
Pins are restored; a split's shares are not (the split's versions are gone: the name serves its
current version again). Version ids: a new engine continues after ``next_version_id``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from loraplex.adapters.versions import VersionView

logger = logging.getLogger(__name__)

MAX_VERSIONS_KEPT = 4  # recipes kept per name, for rollbacks


@dataclass(frozen=True)
class RestartPolicy:
    max_attempts: int = 5
    backoff_s: float = 0.5
    max_backoff_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError(f"invalid restart policy {self}")

    def delays(self) -> Iterator[float]:
        """Seconds to wait before each attempt."""
        for attempt in range(self.max_attempts):
            yield min(self.backoff_s * 2**attempt, self.max_backoff_s)


@dataclass(frozen=True)
class Recipe:
    """One ``load_adapter`` call: (name, path) positional, the keyword arguments as sent (no ``new_version``)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class AdapterRecipes:
    """Thread-safe enough for its one writer (the event loop) and one reader (the restart, while no call runs)."""

    def __init__(self, startup: Sequence[tuple[str, str]] = ()) -> None:
        self._loads: dict[str, list[Recipe]] = {name: [Recipe((name, path), {})] for name, path in startup}
        self._pins: set[str] = set()
        self.next_version_id = 1

    def record(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A call ``method(*args, **kwargs)`` succeeded in the engine."""
        name = args[0] if args else None
        if method == "load_adapter":
            kept = {k: v for k, v in kwargs.items() if k != "new_version"}
            recipe = Recipe(tuple(args), kept)
            history = self._loads.get(name, []) if kwargs.get("new_version") else []
            self._loads[name] = [*history, recipe][-MAX_VERSIONS_KEPT:]
        elif method == "unload_adapter":
            self._loads.pop(name, None)
            self._pins.discard(name)
        elif method == "rollback_adapter":
            history = self._loads.get(name, [])
            if len(history) > 1:
                history.pop()
            else:
                logger.warning("adapter %r rolled back past its recorded versions: a restarted engine will not "
                               "load it again", name)
                self._loads.pop(name, None)
        elif method == "pin_adapter":
            self._pins.add(name)
        elif method == "unpin_adapter":
            self._pins.discard(name)

    def saw(self, view: VersionView) -> None:
        """Version ids in ``view`` are taken: a new engine starts after them."""
        ids = [held.version_id for entry in view.names.values() for held in entry.held]
        self.next_version_id = max([self.next_version_id, *(i + 1 for i in ids)])

    def replay(self) -> list[tuple[str, tuple[Any, ...], dict[str, Any]]]:
        """The calls that rebuild the table: every name's current load, then its pin."""
        calls = [("load_adapter", history[-1].args, history[-1].kwargs) for history in self._loads.values()]
        return calls + [("pin_adapter", (name,), {}) for name in self._loads if name in self._pins]

    def forget(self, name: str) -> None:
        """``name`` could not be loaded again."""
        self._loads.pop(name, None)
        self._pins.discard(name)
