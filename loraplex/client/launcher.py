"""Starting and stopping the engine process (``core_process``) for ``EngineProcess``.

``launch`` runs ``python -m loraplex.engine.core_process FD`` with one end of a socket pair, sends
``Start`` and waits for ``Ready`` (its ``EngineInfo`` and version table) or ``StartFailed`` (the engine's own error,
raised here). The child gets this process's environment plus the OpenMP settings below; ``cpus``
binds its OpenMP threads to those cores (``GOMP_CPU_AFFINITY``, one thread per core unless the
config sets ``num_threads``). ``terminate`` ends it: SIGTERM, then SIGKILL; ``exit_status`` waits
for it after it closed its socket.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection

from loraplex.config import EngineConfig
from loraplex.engine import wire as m
from loraplex.errors import EngineUnavailable

logger = logging.getLogger(__name__)

# OpenMP workers that spin between parallel regions take the CPU that the API process (and, on a
# shared host, everyone else) needs: measured on this 2-core host under load, spinning made decode
# steps 20-30x slower than sleeping. A value in the environment wins.
OMP_WAIT_POLICY = "PASSIVE"


def launch(config: EngineConfig, adapters: Sequence[tuple[str, str]], cpus: Sequence[int] | None,
           log_level: str, timeout: float) -> tuple[subprocess.Popen, Connection, m.Ready]:
    """Start the engine process and wait until it serves; (process, connection, its ``Ready``)."""
    ours, theirs = socket.socketpair()
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", OMP_WAIT_POLICY)
    if cpus:
        env["GOMP_CPU_AFFINITY"] = " ".join(map(str, cpus))
        env["OMP_NUM_THREADS"] = str(config.num_threads or len(cpus))
    proc = subprocess.Popen([sys.executable, "-m", "loraplex.engine.core_process", str(theirs.fileno())],
                            pass_fds=[theirs.fileno()], env=env)
    theirs.close()
    conn = Connection(ours.detach())
    conn.send(m.Start(config, tuple(adapters), log_level))
    importer = threading.Thread(target=_import_transformers, daemon=True)  # overlaps the engine's start-up
    importer.start()
    try:
        reply = _await_reply(proc, conn, timeout)
    except BaseException:
        conn.close()
        terminate(proc)
        raise
    importer.join()
    if isinstance(reply, m.StartFailed):
        conn.close()
        proc.wait()
        raise reply.error
    return proc, conn, reply


def _await_reply(proc: subprocess.Popen, conn: Connection, timeout: float) -> m.Ready | m.StartFailed:
    deadline = time.monotonic() + timeout
    while not conn.poll(0.2):
        if proc.poll() is not None:
            raise EngineUnavailable(f"the engine process exited while starting (status {proc.returncode})")
        if time.monotonic() > deadline:
            raise EngineUnavailable(f"the engine process did not start within {timeout:.0f} s")
    try:
        return conn.recv()
    except (EOFError, OSError) as exc:
        raise EngineUnavailable(f"the engine process exited while starting (status {proc.poll()})") from exc


def _import_transformers() -> None:
    import transformers  # noqa: F401 - seconds of imports: done while the engine process loads the model


def exit_status(proc: subprocess.Popen, grace: float = 10.0) -> int:
    """The exit status of a process that closed its end of the socket, terminated if it lingers."""
    try:
        return proc.wait(grace)
    except subprocess.TimeoutExpired:
        return terminate(proc)


def terminate(proc: subprocess.Popen, grace: float = 5.0) -> int:
    """SIGTERM, then SIGKILL after ``grace`` seconds; the exit status."""
    if proc.poll() is None:
        proc.terminate()
        try:
            return proc.wait(grace)
        except subprocess.TimeoutExpired:
            logger.warning("engine process %d ignored SIGTERM; killing it", proc.pid)
            proc.kill()
    return proc.wait()
