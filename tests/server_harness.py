"""Run a real uvicorn server for an app in a background thread, on 127.0.0.1 and a free port."""

from __future__ import annotations

import shutil
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import openai
import uvicorn
from fastapi import FastAPI

from loraplex.config import EngineConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.engine import Engine
from loraplex.server.app import create_app

BASE = "tiny"  # the served name of the tiny base model


@contextmanager
def running_server(app: FastAPI, timeout: float = 30.0) -> Iterator[str]:
    """Serve ``app`` until the block exits; yields its base URL (``http://127.0.0.1:PORT``)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()


def wait_until_idle(engine: Engine, timeout: float = 30.0) -> None:
    """Wait until the engine runs nothing, holds no adapter pin and has every KV block free."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        pinned = engine.adapters.slot_table.pinned()
        if (stats.num_running == stats.num_waiting == pinned == 0
                and stats.kv_blocks_free == stats.kv_blocks_total):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle after {timeout}s: {stats}, pinned slots {pinned}")
        time.sleep(0.05)


@dataclass
class Server:
    url: str
    engine: Engine
    async_engine: AsyncEngine
    root: Path  # the --adapter-root
    outside: dict[str, Path]  # adapter folders outside the root

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60)

    def async_client(self, api_key: str = "unused") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=120)


@contextmanager
def tiny_server(model: Path, adapters: dict[str, Path], startup: tuple[str, ...], in_root: tuple[str, ...],
                root: Path, **config: object) -> Iterator[Server]:
    """A server on ``model`` with ``startup`` adapters loaded, runtime loading on, and copies of the
    ``in_root`` adapters inside the adapter root ``root``."""
    for name in in_root:
        shutil.copytree(adapters[name], root / name)
    engine = Engine(EngineConfig(model=str(model), **config))
    for name in startup:
        engine.load_adapter(name, adapters[name])
    async_engine = AsyncEngine(engine)
    app = create_app(async_engine, served_model_name=BASE, allow_runtime_adapters=True, adapter_roots=[root])
    with running_server(app) as url:
        yield Server(url, engine, async_engine, root, adapters)
