"""The step loop both engine clients drive (``AsyncEngine``'s thread, the engine process's main thread).

It steps while the engine has work and otherwise sleeps on ``wakeup`` (set by whoever adds, aborts or
unloads). A step that schedules nothing (e.g. every waiting request's adapter is still being read) backs
off briefly instead of spinning. A fault in a step's forward pass or sampling fails only that step's
requests (``Engine.step``); a step that raises anyway (its scheduling or bookkeeping: a bug in the engine)
goes to ``on_failure``, which fails what is in flight, and the loop keeps serving. An exception that is not
an ``Exception`` ends the loop: the caller reports the engine dead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from loraplex.engine.engine import Engine
from loraplex.engine.request import EngineOutput

logger = logging.getLogger(__name__)

_IDLE_POLL_S = 0.005  # back-off when the engine has queued work but could not schedule any


def run_step_loop(engine: Engine, wakeup: threading.Event, stopping: Callable[[], bool],
                  on_outputs: Callable[[float, list[EngineOutput]], None],
                  on_failure: Callable[[Exception], None]) -> None:
    """Step ``engine`` until ``stopping()``; each step's outputs go to ``on_outputs(seconds, outputs)``."""
    while not stopping():
        if not engine.has_unfinished_requests():
            wakeup.wait()
            wakeup.clear()
            continue
        start = time.perf_counter()
        try:
            outputs = engine.step()
        except Exception as exc:
            logger.exception("engine step failed; failing every request in flight")
            on_failure(exc)
            continue
        on_outputs(time.perf_counter() - start, outputs)
        if not outputs:
            wakeup.wait(_IDLE_POLL_S)
            wakeup.clear()
