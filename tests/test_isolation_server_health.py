"""The server says when it cannot serve, and sockets cannot be held (issue 30, item 6), over real HTTP:

- ``/health`` reads the step loop's heartbeat: with a request open and no step for ``--stall-timeout``
  seconds (the engine process SIGSTOPped, an in-process step that never returns) it is 503
  ``{"status": "stalled"}`` with ``Retry-After``, and 200 again once steps resume; an idle engine is never
  stalled (on main ``/health`` said ``ok`` while new requests hung);
- connection limits: a client sending its request header byte by byte (slowloris) is disconnected after
  ``--header-timeout``, on a fresh connection and on a kept-alive one after its first response, while a
  header that arrives in time is served.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn

from loraplex.cli import build_parser
from loraplex.client.inproc import AsyncEngine
from loraplex.config import EngineConfig
from loraplex.engine.engine import Engine
from loraplex.server.app import create_app
from loraplex.server.connections import ConnectionLimits
from tests.server_harness import BASE, MODES, Server, tiny_server
from tests.test_server_tenancy import engine_paused

CONFIG = dict(max_loras=2, max_cpu_loras=4, max_lora_rank=16, kv_cache_blocks=128, max_num_seqs=4)
STALL_S = 0.5
HEADER_S = 0.5


@pytest.fixture(scope="module", params=MODES)
def server(request: pytest.FixtureRequest, tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with tiny_server(tiny_llama, tiny_llama_adapters, (), (), tmp_path_factory.mktemp("root"), mode=request.param,
                     app_options={"stall_timeout": STALL_S}, **CONFIG) as srv:
        yield srv


def health(url: str) -> httpx.Response:
    return httpx.get(f"{url}/health", timeout=10)


def poll_health(url: str, status: int, deadline_s: float = 15.0) -> httpx.Response:
    deadline = time.monotonic() + deadline_s
    while (response := health(url)).status_code != status and time.monotonic() < deadline:
        time.sleep(0.05)
    return response


def test_health_says_stalled_while_requests_wait_on_a_stopped_step_loop(server: Server) -> None:
    time.sleep(STALL_S * 1.5)  # time passes with nothing open: idle is not stalled
    assert health(server.url).status_code == 200
    body = {"model": BASE, "prompt": "Once", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        next(lines)
        with engine_paused(server):
            stalled = poll_health(server.url, 503)
            assert stalled.status_code == 503 and stalled.headers["retry-after"] == "1"
            body = stalled.json()
            assert body["status"] == "stalled" and "no engine step finished for" in body["detail"]
            assert f"--stall-timeout {STALL_S:g}" in body["detail"]
        for _ in range(3):  # steps arrive again (the pause lasted longer than the stall timeout)
            next(lines)
        assert health(server.url).status_code == 200
        assert server.engine_client.heartbeat()[0] == 1  # ... with the request still open: its steps are the beat
        assert list(lines)[-2] == "data: [DONE]"
    assert health(server.url).status_code == 200


@contextmanager
def limited_server(model: Path, limits: ConnectionLimits) -> Iterator[tuple[str, int]]:
    client = AsyncEngine(Engine(EngineConfig(model=str(model), **CONFIG)))
    app = create_app(client, served_model_name=BASE)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **limits.uvicorn_options()))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield sock.getsockname()
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        client.shutdown()


def trickle(conn: socket.socket, data: bytes, every_s: float, until_s: float) -> float | None:
    """Send ``data`` a byte at a time; seconds until the server closed the connection, None if it never did
    within ``until_s`` (nor answered)."""
    start = time.monotonic()
    conn.settimeout(every_s)
    for byte in data:
        try:
            conn.sendall(bytes([byte]))
            if conn.recv(1, socket.MSG_PEEK) == b"":  # peeked: a response stays to be read
                return time.monotonic() - start
        except TimeoutError:
            pass
        except (BrokenPipeError, ConnectionResetError):
            return time.monotonic() - start
        if time.monotonic() - start > until_s:
            return None
    return None


def read_response(conn: socket.socket) -> bytes:
    conn.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def test_slowloris_is_disconnected_after_the_header_timeout(tiny_llama: Path) -> None:
    header = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 200 + b"\r\n\r\n"
    with limited_server(tiny_llama, ConnectionLimits(header_timeout=HEADER_S)) as address:
        with socket.create_connection(address) as conn:  # a fresh connection
            closed = trickle(conn, header, 0.05, 10 * HEADER_S)
        assert closed is not None and HEADER_S * 0.8 <= closed <= HEADER_S + 2.0
        with socket.create_connection(address) as conn:  # a kept-alive one, after its first response
            conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_response(conn).startswith(b"HTTP/1.1 200")
            closed = trickle(conn, header, 0.05, 10 * HEADER_S)
        assert closed is not None and closed <= HEADER_S + 2.0
        with socket.create_connection(address) as conn:  # a header that arrives in time is served
            quick = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
            assert trickle(conn, quick, 0.005, HEADER_S) is None
            assert read_response(conn).startswith(b"HTTP/1.1 200")
        assert httpx.get(f"http://{address[0]}:{address[1]}/health", timeout=10).status_code == 200


def test_the_connection_flags_reach_uvicorn() -> None:
    args = build_parser().parse_args(["serve", "--header-timeout", "2.5", "--timeout-keep-alive", "3",
                                      "--h11-max-incomplete-event-size", "8192", "--limit-concurrency", "64",
                                      "--stall-timeout", "9"])
    limits = ConnectionLimits(args.header_timeout, args.timeout_keep_alive, args.h11_max_incomplete_event_size,
                              args.limit_concurrency)
    options = limits.uvicorn_options()
    assert (options["timeout_keep_alive"], options["h11_max_incomplete_event_size"], options["limit_concurrency"],
            options["http"].header_timeout, args.stall_timeout) == (3.0, 8192, 64, 2.5, 9.0)
    config = uvicorn.Config(lambda *a: None, **options)
    config.load()
    assert config.http_protocol_class is options["http"]
