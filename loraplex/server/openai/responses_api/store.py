"""Stored responses: per tenant (a key sees only its own tenant's), LRU with a size cap and a TTL."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_RESPONSES = 1024
DEFAULT_TTL_S = 3600.0


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the Response object as it was answered
    conversation: list[dict[str, Any]]  # chat messages: the input (without instructions) and the output


class ResponseStore:
    """``put``/``get``/``delete`` by (tenant, response id); the least recently used entry goes past
    ``max_responses``, any entry past ``ttl_s`` seconds after it was stored."""

    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES, ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_responses, self.ttl_s, self.clock = max_responses, ttl_s, clock
        self._entries: OrderedDict[tuple[str, str], tuple[float, StoredResponse]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, tenant: str, response_id: str, stored: StoredResponse) -> None:
        with self._lock:
            self._entries[(tenant, response_id)] = (self.clock() + self.ttl_s, stored)
            self._entries.move_to_end((tenant, response_id))
            while len(self._entries) > self.max_responses:
                self._entries.popitem(last=False)

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        with self._lock:
            entry = self._entries.get((tenant, response_id))
            if entry is None:
                return None
            if entry[0] < self.clock():
                del self._entries[(tenant, response_id)]
                return None
            self._entries.move_to_end((tenant, response_id))
            return entry[1]

    def delete(self, tenant: str, response_id: str) -> bool:
        with self._lock:
            return self._entries.pop((tenant, response_id), None) is not None

    def __len__(self) -> int:
        return len(self._entries)
