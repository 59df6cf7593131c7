"""Bounded ``adapter`` label values for the request metrics.

A client chooses the ``model`` string it sends, so a label taken from it verbatim would let anyone grow
``/metrics`` (and the server's memory) without bound, one random name at a time. ``AdapterLabels``
maps a request's adapter to a label that is

- the adapter's name while it is loaded,
- ``base`` for the base model (``BASE_LABEL``),
- for an adapter mix (``client/adapter_mix.py``: names joined by "+", which no adapter name holds) whose
  members are all loaded, its members' names, sorted, joined by "+", for the first ``MAX_MIX_LABELS``
  distinct blends that have series; every other blend shares ``mix`` (``MIX_LABEL``), so blends add at most
  ``MAX_MIX_LABELS + 1`` label values; a blend's series go when one of its members is unloaded,
- ``unknown`` for every other name (a 404, or an adapter unloaded before its request ended);

and removes the series of a name once it is no longer loaded (``prune``), so the label values are
always the loaded adapters plus the two fixed ones. A reloaded name starts its counters from zero
(a Prometheus counter reset, which ``rate()`` handles).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

BASE_LABEL = "base"  # the ``adapter`` label value of requests to the base model
UNKNOWN_LABEL = "unknown"  # requests naming no loaded adapter
MIX_LABEL = "mix"  # requests blending loaded adapters, past MAX_MIX_LABELS blends with their own label
MAX_MIX_LABELS = 16
FIXED_LABELS = frozenset({BASE_LABEL, UNKNOWN_LABEL, MIX_LABEL})


class AdapterLabels:
    """``label(adapter)`` for a request; ``child(metric, label, *other_values)`` returns (and remembers)
    the labelled child of a metric whose FIRST label is ``adapter``; ``prune()`` removes the children of
    names that are no longer loaded. Thread-safe."""

    def __init__(self, is_loaded: Callable[[str], bool]) -> None:
        self._is_loaded = is_loaded
        self._children: dict[str, set[tuple[Any, tuple[str, ...]]]] = {}  # label -> (metric, label values)
        self._lock = threading.Lock()

    def label(self, adapter: str | None) -> str:
        if adapter is None:
            return BASE_LABEL
        if "+" in adapter:
            label = "+".join(sorted(adapter.split("+")))
            if not self._live(label):
                return UNKNOWN_LABEL
            with self._lock:
                mixes = sum("+" in known for known in self._children)
                return label if label in self._children or mixes < MAX_MIX_LABELS else MIX_LABEL
        return adapter if adapter not in FIXED_LABELS and self._is_loaded(adapter) else UNKNOWN_LABEL

    def _live(self, label: str) -> bool:
        """Whether a label's series stay: a fixed one, a loaded name, a blend of loaded names."""
        return label in FIXED_LABELS or all(self._is_loaded(name) for name in label.split("+"))

    def child(self, metric: Any, label: str, *values: str) -> Any:
        new = label not in self._children
        if new and label not in FIXED_LABELS:
            self.prune()  # a new name: forget the ones that left first, so no stale name lingers
        with self._lock:
            self._children.setdefault(label, set()).add((metric, (label, *values)))
            return metric.labels(label, *values)

    def prune(self) -> None:
        """Remove every series of an adapter name that is not loaded now."""
        with self._lock:
            gone = [label for label in self._children if not self._live(label)]
            for label in gone:
                for metric, values in self._children.pop(label):
                    metric.remove(*values)

    def names(self) -> set[str]:
        """The label values that have series now."""
        with self._lock:
            return set(self._children)
