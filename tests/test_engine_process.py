"""The engine process's life cycle: a start-up failure is the engine's own error with nothing left
running, and when the process that started it is killed (SIGKILL: no clean-up code runs), the
engine process and the request-preparation workers exit by themselves."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from loraplex.client.process import EngineProcess
from loraplex.config import EngineConfig
from loraplex.errors import AdapterNotFound, EngineUnavailable


def test_a_failed_start_raises_the_engine_error_and_leaves_nothing(tiny_llama: Path, tmp_path: Path) -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    client = EngineProcess(EngineConfig(model=str(tiny_llama), kv_cache_blocks=16), [("gone", str(tmp_path / "no"))])
    with pytest.raises(AdapterNotFound):
        client.start()
    assert client.health().state == "dead" and not client.running
    with pytest.raises(EngineUnavailable):
        _ = client.info
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert not left, [p.cmdline() for p in left]


HOLDER = """
import asyncio, time
from loraplex.config import EngineConfig
from loraplex.client.process import EngineProcess
from loraplex.server.prepare.preparer import PrepareConfig, RequestPreparer

client = EngineProcess(EngineConfig(model={model!r}, kv_cache_blocks=16))
client.start()
asyncio.run(RequestPreparer(PrepareConfig(None, 512), processes=1).warm_up())
print("ready", flush=True)
time.sleep(600)
"""


def test_engine_and_workers_exit_when_their_parent_is_killed(tiny_llama: Path) -> None:
    code = textwrap.dedent(HOLDER.format(model=str(tiny_llama)))
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        children = psutil.Process(holder.pid).children(recursive=True)
        commands = [" ".join(p.cmdline()) for p in children]
        assert any("loraplex.engine.core_process" in c for c in commands), commands
        assert any("multiprocessing" in c for c in commands), commands  # the preparation worker
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        if holder.poll() is None:
            holder.kill()
