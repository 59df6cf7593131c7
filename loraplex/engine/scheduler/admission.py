"""``WaitingBound``: the bound on requests queued in the engine and not running (``max_waiting_requests``).

A request waits from ``add_requests`` until the scheduler admits it: first in the engine's inbox, then
in the scheduler's waiting queue (or held while its grammar compiles; a preempted request waits again).
Requests that the next step can start at once do not count as waiting: the seats free under
``max_num_seqs`` widen the bound. So at most ``max_num_seqs + max_waiting_requests`` requests are in
the engine at any time, and a burst into an idle engine is not refused for the instant it sits in
the inbox.

``admit`` runs on the submitting thread while the step thread moves requests between the queues: a
count read mid-step may be off by the requests that step moves, never by more. None means unbounded.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from loraplex.config import EngineConfig
from loraplex.engine.sampling.structured.waiting import GrammarWaitlist
from loraplex.engine.scheduler.scheduler import Scheduler
from loraplex.errors import QueueFull

RETRY_AFTER_S = 1  # the Retry-After a refused request gets: a step or a few frees seats on any model


class WaitingBound:
    """Counts the requests in the engine's inbox itself; reads the scheduler's waiting and running queues
    and the requests held for their grammar (``GrammarWaitlist``: a group of choices counts once)."""

    def __init__(self, config: EngineConfig, scheduler: Scheduler, grammars: GrammarWaitlist) -> None:
        self.limit = config.max_waiting_requests
        self._max_running = config.max_num_seqs
        self._scheduler = scheduler
        self._grammars = grammars
        self._in_inbox = 0
        self._lock = threading.Lock()

    @contextmanager
    def admitting(self, n: int) -> Iterator[None]:
        """Count ``n`` requests into the inbox, or raise ``QueueFull`` (nothing counted) when they would pass
        the bound; if the block raises (the requests were refused), they are counted out again."""
        with self._lock:
            if self.limit is not None:
                waiting = self._in_inbox + len(self._scheduler.waiting) + len(self._grammars)
                allowed = self.limit + max(0, self._max_running - len(self._scheduler.running))
                if waiting + n > allowed:
                    raise QueueFull(f"the server is at capacity: {waiting} requests are waiting to start, "
                                    f"at most {self.limit} may (--max-waiting-requests); retry after "
                                    f"{RETRY_AFTER_S} s", RETRY_AFTER_S)
            self._in_inbox += n
        try:
            yield
        except BaseException:
            self.drained(n)
            raise

    def drained(self, n: int) -> None:
        """The step thread moved ``n`` requests from the inbox into the scheduler (or to their grammar)."""
        with self._lock:
            self._in_inbox -= n
