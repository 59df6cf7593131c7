"""A dead request-preparation worker is replaced alone (issue 30, item 6), over real HTTP: SIGKILL of one of
two worker processes leaves the other one (same pid) serving every following request at once, while the dead
one is replaced in the background; on main the whole pool was replaced with cold workers and every new
request waited for them (~25 s with SmolLM2's tokenizer)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import psutil

from loraplex.client.inproc import AsyncEngine
from loraplex.config import EngineConfig
from loraplex.engine.engine import Engine
from loraplex.server.app import create_app
from tests.server_harness import BASE, running_server

CONFIG = dict(max_loras=2, max_cpu_loras=4, max_lora_rank=16, kv_cache_blocks=128, max_num_seqs=4)


def test_a_dead_worker_is_replaced_alone(tiny_llama: Path) -> None:
    client = AsyncEngine(Engine(EngineConfig(model=str(tiny_llama), **CONFIG)))
    app = create_app(client, served_model_name=BASE, prepare_processes=2)
    preparer = app.state.context.preparer
    body = {"model": BASE, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    try:
        with running_server(app, timeout=120) as url:
            assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).status_code == 200
            first, second = preparer.worker_pids()
            os.kill(first, signal.SIGKILL)
            psutil.Process(first).wait(10) if psutil.pid_exists(first) else None
            for _ in range(6):  # each served by the live worker, none waiting on a cold start
                start = time.monotonic()
                response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
                assert response.status_code == 200, response.text
                assert time.monotonic() - start < 5.0
            assert second in preparer.worker_pids() and first not in preparer.worker_pids()
            assert preparer.replaced == 1
            deadline = time.monotonic() + 60
            while len(preparer.worker_pids()) < 2 and time.monotonic() < deadline:  # the replacement starts
                time.sleep(0.05)
            assert len(preparer.worker_pids()) == 2 and second in preparer.worker_pids()
    finally:
        client.shutdown()
