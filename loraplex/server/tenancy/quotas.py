"""Per-key limits (``server/tenancy/keys.py``), enforced when a request is admitted; over a limit is 429.

- ``max_concurrent_requests``: completions and chat completions of the key open at once (a streamed one
  counts until its last event is sent or its client goes away).
- ``max_running_requests``: engine requests of the key in flight (seats: every choice of every prompt is
  one, so ``n=128`` takes 128), not HTTP connections. A request needing more seats than are free waits for
  nothing: it is refused at once.
- ``tokens_per_minute``: a request *reserves* its real maximum, ``prompt + n·max_tokens`` (each choice's
  ``max_tokens`` capped by what is left of the context), when it is admitted; it is admitted only if the
  tokens spent over the last 60 seconds, plus the reservations of the key's running requests, plus its own
  stay within the limit. When it ends, its reservation is replaced by what it really used (prompt plus
  generated tokens, counted in the window from then): the unused part is returned at once. So parallel
  requests can never pass the limit together.

A 429 that waiting can cure carries ``Retry-After`` (seconds: when enough of the window expires, or 1 while
the key's running requests hold the room); a request that can never fit (more seats or tokens than the
limit itself) is a 429 without it, saying so.
"""

from __future__ import annotations

import math
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass

from loraplex.server.openai.errors import ServerError
from loraplex.server.tenancy.keys import ApiKey

WINDOW_S = 60.0


@dataclass(frozen=True)
class Demand:
    """What one request may take: its prompt tokens, its most generated tokens (all choices), its seats."""

    prompt_tokens: int
    max_new_tokens: int = 0
    seats: int = 1

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.max_new_tokens


class Lease:
    """One admitted request; ``release(generated_tokens)`` exactly once when it ends (later calls: no-op)."""

    def __init__(self, quotas: TenantQuotas, key: ApiKey, demand: Demand) -> None:
        self._quotas, self._key, self._demand, self._open = quotas, key, demand, True

    def release(self, generated_tokens: int = 0) -> None:
        if self._open:
            self._open = False
            self._quotas._end(self._key, self._demand, generated_tokens)

    def __del__(self) -> None:  # a streamed response whose body never started: its slot is not lost
        self.release()


class TenantQuotas:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._running: dict[ApiKey, int] = defaultdict(int)  # open requests
        self._seats: dict[ApiKey, int] = defaultdict(int)  # engine requests in flight
        self._reserved: dict[ApiKey, int] = defaultdict(int)  # tokens reserved by open requests
        self._spent: dict[ApiKey, deque[tuple[float, int]]] = defaultdict(deque)  # (when, tokens), oldest first

    def admit(self, key: ApiKey, demand: Demand | int) -> Lease:
        """A lease for one request of ``key`` (an int: prompt tokens only), or ``ServerError(429)``."""
        demand = demand if isinstance(demand, Demand) else Demand(demand)
        with self._lock:
            limit = key.max_concurrent_requests
            if limit is not None and self._running[key] >= limit:
                raise _too_many(f"this key already has {limit} requests in flight (max_concurrent_requests)", 1)
            self._check_seats(key, demand.seats)
            if key.tokens_per_minute is not None:
                self._check_tokens(key, key.tokens_per_minute, demand.tokens)
            self._running[key] += 1
            self._seats[key] += demand.seats
            self._reserved[key] += demand.tokens
        return Lease(self, key, demand)

    def reserved(self, key: ApiKey) -> tuple[int, int, int]:
        """(open requests, seats, reserved tokens) of ``key`` now."""
        with self._lock:
            return self._running[key], self._seats[key], self._reserved[key]

    def _check_seats(self, key: ApiKey, seats: int) -> None:
        limit = key.max_running_requests
        if limit is None:
            return
        if seats > limit:
            raise _too_many(f"this request needs {seats} engine requests (n x prompts), more than this key's "
                            f"max_running_requests {limit}", None)
        if self._seats[key] + seats > limit:
            raise _too_many(f"this request needs {seats} engine requests and this key already runs "
                            f"{self._seats[key]} of its {limit} (max_running_requests)", 1)

    def _check_tokens(self, key: ApiKey, limit: int, tokens: int) -> None:
        if tokens > limit:
            raise _too_many(f"this request may use {tokens} tokens (prompt + n x max_tokens), more than this "
                            f"key's tokens_per_minute {limit}", None)
        wait = self._wait_for_tokens(key, limit - self._reserved[key] - tokens)
        if wait > 0:
            raise _too_many(f"this request may use {tokens} tokens (prompt + n x max_tokens) and this key's "
                            f"tokens_per_minute {limit} are spent or reserved", wait)

    def _end(self, key: ApiKey, demand: Demand, generated_tokens: int) -> None:
        with self._lock:
            self._running[key] -= 1
            self._seats[key] -= demand.seats
            self._reserved[key] -= demand.tokens
            used = demand.prompt_tokens + max(0, generated_tokens)
            if key.tokens_per_minute is not None and used > 0:
                self._spent[key].append((self._clock(), used))

    def _wait_for_tokens(self, key: ApiKey, room: int) -> int:
        """Whole seconds until the window's tokens are at most ``room`` (0: they are now; 1 when even an
        empty window is not enough: the key's running requests hold the rest until they end)."""
        now, spent = self._clock(), self._spent[key]
        while spent and spent[0][0] <= now - WINDOW_S:
            spent.popleft()
        total = sum(tokens for _, tokens in spent)
        if total <= room:
            return 0
        if room < 0:
            return 1
        for when, tokens in spent:  # oldest first: when it expires, is the rest within the room?
            total -= tokens
            if total <= room:
                return max(1, math.ceil(when + WINDOW_S - now))
        raise AssertionError("unreachable: an empty window holds 0 <= room tokens")


def _too_many(message: str, retry_after: int | None) -> ServerError:
    if retry_after is None:
        return ServerError(429, f"rate limit: {message}; it cannot be admitted under this key")
    return ServerError(429, f"rate limit: {message}; retry after {retry_after} s", headers={
        "Retry-After": str(retry_after)})
