"""Per-key limits (``server/tenancy/keys.py``): requests in flight and tokens per minute; over a limit is 429 with
``Retry-After``.

- ``max_concurrent_requests``: completions and chat completions of the key running at once (a streamed
  one counts until its last event is sent or its client goes away).
- ``tokens_per_minute``: prompt plus generated tokens of the key's requests over the last 60 seconds
  (prompt tokens counted when a request is admitted, generated ones when it ends). A request is refused
  while the window already holds the limit; ``Retry-After`` is when enough of it will have expired.
  One request may pass the limit (its cost is known only as it runs); the next ones wait for it.
"""

from __future__ import annotations

import math
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable

from loraplex.server.openai.errors import ServerError
from loraplex.server.tenancy.keys import ApiKey

WINDOW_S = 60.0


class Lease:
    """One admitted request; ``release(generated_tokens)`` exactly once when it ends (later calls: no-op)."""

    def __init__(self, quotas: TenantQuotas, key: ApiKey) -> None:
        self._quotas, self._key, self._open = quotas, key, True

    def release(self, generated_tokens: int = 0) -> None:
        if self._open:
            self._open = False
            self._quotas._end(self._key, generated_tokens)

    def __del__(self) -> None:  # a streamed response whose body never started: its slot is not lost
        self.release()


class TenantQuotas:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._running: dict[ApiKey, int] = defaultdict(int)
        self._spent: dict[ApiKey, deque[tuple[float, int]]] = defaultdict(deque)  # (when, tokens), oldest first

    def admit(self, key: ApiKey, prompt_tokens: int) -> Lease:
        """A lease for one request of ``key``, or ``ServerError(429)`` with ``Retry-After`` seconds."""
        with self._lock:
            limit = key.max_concurrent_requests
            if limit is not None and self._running[key] >= limit:
                raise _too_many(f"this key already has {limit} requests in flight (max_concurrent_requests)", 1)
            if key.tokens_per_minute is not None:
                wait = self._wait_for_tokens(key, key.tokens_per_minute)
                if wait > 0:
                    raise _too_many(f"this key used its {key.tokens_per_minute} tokens of the last minute "
                                    "(tokens_per_minute)", wait)
                self._spend(key, prompt_tokens)
            self._running[key] += 1
        return Lease(self, key)

    def _end(self, key: ApiKey, generated_tokens: int) -> None:
        with self._lock:
            self._running[key] -= 1
            if key.tokens_per_minute is not None:
                self._spend(key, generated_tokens)

    def _spend(self, key: ApiKey, tokens: int) -> None:
        if tokens > 0:
            self._spent[key].append((self._clock(), tokens))

    def _wait_for_tokens(self, key: ApiKey, limit: int) -> int:
        """Whole seconds until the window holds fewer than ``limit`` tokens (0: it does now)."""
        now, spent = self._clock(), self._spent[key]
        while spent and spent[0][0] <= now - WINDOW_S:
            spent.popleft()
        total = sum(tokens for _, tokens in spent)
        if total < limit:
            return 0
        for when, tokens in spent:  # oldest first: when it expires, is the rest under the limit?
            total -= tokens
            if total < limit:
                return max(1, math.ceil(when + WINDOW_S - now))
        raise AssertionError("unreachable: an empty window holds 0 < limit tokens")


def _too_many(message: str, retry_after: int) -> ServerError:
    return ServerError(429, f"rate limit: {message}; retry after {retry_after} s", headers={
        "Retry-After": str(retry_after)})
