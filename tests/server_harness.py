"""Run a real uvicorn server for an app in a background thread, on 127.0.0.1 and a free port."""

from __future__ import annotations

import asyncio
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import uvicorn
from fastapi import FastAPI

from loraplex.client.base import EngineClient
from loraplex.client.inproc import AsyncEngine
from loraplex.client.process import EngineProcess
from loraplex.config import EngineConfig
from loraplex.engine.engine import Engine, EngineStats
from loraplex.server.app import create_app
from loraplex.server.prepare.preparer import RequestPreparer

BASE = "tiny"  # the served name of the tiny base model


@contextmanager
def running_server(app: FastAPI, timeout: float = 120.0) -> Iterator[str]:
    """Serve ``app`` until the block exits; yields its base URL (``http://127.0.0.1:PORT``). ``timeout``
    only detects a hang: the app's start-up (reading the checkpoint's fingerprint, warming the preparation
    worker) took over 30 s on a 2-core host shared by several suites."""
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


def engine_stats(target: Engine | EngineClient) -> EngineStats:
    """``stats()`` of an in-process ``Engine``, or of any engine client (from a thread without a loop)."""
    return target.stats() if isinstance(target, Engine) else asyncio.run(target.stats())


def wait_until_idle(target: Engine | EngineClient, timeout: float = 30.0) -> None:
    """Wait until the engine runs nothing, holds no adapter pin and has every KV block free."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine_stats(target)
        if (stats.num_running == stats.num_waiting == stats.slots_pinned == 0
                and stats.kv_blocks_free == stats.kv_blocks_total):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle after {timeout}s: {stats}")
        time.sleep(0.05)


@dataclass
class Server:
    url: str
    engine: Engine | None  # the engine itself when it runs in this process ("thread" mode)
    engine_client: EngineClient  # what the app drives: an AsyncEngine, or an EngineProcess ("process" mode)
    root: Path  # the --adapter-root
    outside: dict[str, Path]  # adapter folders outside the root

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60)

    def async_client(self, api_key: str = "unused") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=120)

    def stats(self) -> EngineStats:
        return engine_stats(self.engine_client)

    def check_integrity(self) -> None:
        """The adapter manager's integrity check, where the engine is reachable (in-process)."""
        if self.engine is not None:
            self.engine.adapters.check_integrity()


MODES = ("thread", "process")  # the step loop in a thread of the server's process, or in its own process


@contextmanager
def tiny_server(model: Path, adapters: dict[str, Path], startup: tuple[str, ...], in_root: tuple[str, ...],
                root: Path, mode: str = "thread", app_options: dict | None = None,
                **config: object) -> Iterator[Server]:
    """A server on ``model`` with ``startup`` adapters loaded, runtime loading on, and copies of the
    ``in_root`` adapters inside the adapter root ``root``. ``mode="process"`` runs the engine in its own
    process and prepares requests in a worker process, as ``loraplex serve`` does. ``app_options``: more
    ``create_app`` arguments (``request_timeout``, API keys, load on demand...)."""
    for name in in_root:
        shutil.copytree(adapters[name], root / name)
    engine_config = EngineConfig(model=str(model), **config)
    engine: Engine | None = None
    client: EngineClient
    preparer = RequestPreparer(processes=1 if mode == "process" else 0)
    preparer.start()  # as ``loraplex serve``: the worker process imports while the engine starts
    if mode == "process":
        client = EngineProcess(engine_config, [(name, str(adapters[name])) for name in startup])
        client.start()
    else:
        engine = Engine(engine_config)
        for name in startup:
            engine.load_adapter(name, adapters[name])
        client = AsyncEngine(engine)
    try:
        app = create_app(client, served_model_name=BASE, allow_runtime_adapters=True, adapter_roots=[root],
                         preparer=preparer, **(app_options or {}))
        with running_server(app) as url:
            yield Server(url, engine, client, root, adapters)
    finally:
        client.shutdown()


@contextmanager
def streaming(url: str, model: str, headers: dict[str, str] | None = None) -> Iterator[None]:
    """A long streamed completion of ``model`` in a thread while the block runs; stopped and joined after."""
    done = threading.Event()

    def stream() -> None:
        body = {"model": model, "prompt": "Once", "max_tokens": 400, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json=body, headers=headers or {}) as r:
            for _ in r.iter_lines():
                if done.is_set():
                    break

    thread = threading.Thread(target=stream)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(60)
