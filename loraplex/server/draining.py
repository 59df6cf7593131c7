"""``DrainingServer``: uvicorn with a graceful shutdown that answers instead of refusing connections.

On SIGTERM (or a first SIGINT) the app's ``ServerLifecycle`` starts draining: the listening socket stays
open and every new request gets 503 (``/health`` too, with ``"status": "stopping"``), so load balancers
and clients see why; requests already running go on. When none is left, or after ``shutdown_timeout``
seconds (the requests still open then end with an error: 503, or a final error event on a stream),
uvicorn's own shutdown runs (close the socket, finish the responses, the app's lifespan end) and
``serve`` returns: the caller stops the engine and exits 0. A second SIGINT exits at once (uvicorn's
force exit: open connections are dropped).
"""

from __future__ import annotations

import logging
import signal
from types import FrameType

import uvicorn

from loraplex.errors import EngineUnavailable
from loraplex.server.lifecycle import ServerLifecycle

logger = logging.getLogger(__name__)

DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
FINISH_RESPONSES_S = 5.0  # after the drain, uvicorn's bound on writing the last responses


class DrainingServer(uvicorn.Server):
    """``lifecycle``: the app's (``app.state.lifecycle``); ``shutdown_timeout``: seconds running requests
    may take to finish after the signal."""

    def __init__(self, config: uvicorn.Config, lifecycle: ServerLifecycle,
                 shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> None:
        if shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {shutdown_timeout}")
        config.timeout_graceful_shutdown = FINISH_RESPONSES_S
        super().__init__(config)
        self.lifecycle = lifecycle
        self.shutdown_timeout = shutdown_timeout
        self._announced = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """The signal handler (main thread; only flags are set here, the event loop acts on them)."""
        if not self.lifecycle.stopping:
            self.lifecycle.begin_drain(self.shutdown_timeout)
        elif sig == signal.SIGINT:
            self.force_exit = self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.lifecycle.stopping and not self.should_exit:
            self._drain_step()
        return await super().on_tick(counter)

    def _drain_step(self) -> None:
        lifecycle = self.lifecycle
        if not self._announced:
            self._announced = True
            logger.info("shutting down: new requests get 503; waiting up to %g s for %d running request(s)",
                        self.shutdown_timeout, lifecycle.active)
        if lifecycle.drained:
            logger.info("every request finished; stopping")
            self.should_exit = True
        elif lifecycle.overdue:
            ended = lifecycle.end_open(EngineUnavailable(
                f"the server shut down before this request finished (--shutdown-timeout {self.shutdown_timeout:g} s)"))
            logger.warning("shutdown timeout (%g s) reached: ended %d open request(s) with an error",
                           self.shutdown_timeout, ended)
            self.should_exit = True
