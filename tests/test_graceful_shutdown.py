"""Graceful shutdown of a real ``loraplex serve`` (engine process, preparation worker): on SIGTERM new
requests and ``/health`` get 503 with ``Connection: close``, a stream in flight finishes in full, requests still open at
``--shutdown-timeout`` end with an error, and the server exits 0; SIGINT twice exits at once. Also the
body limit on a chunked upload, through the real server."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil

from loraplex.engine.engine import STEP_DELAY_ENV
from tests.test_cli import free_port, wait_healthy

LONG = 480  # tokens; a prompt list of these on few seats runs for thousands of steps, each held STEP_DELAY
STEP_DELAY = 0.005  # s (the engine's test hook): 32 x 480 steps on one seat last > 70 s on any machine


@contextmanager
def serve(tiny_llama: Path, adapter: Path, log: Path, *flags: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """``loraplex serve`` on the tiny model with adapter "chat"; yields (process, base URL) once healthy.
    On exit the process is killed if it still runs, and its children are reaped."""
    port = free_port()
    cmd = [sys.executable, "-m", "loraplex.cli", "serve", "--model", str(tiny_llama), "--adapter", f"chat={adapter}",
           "--port", str(port), "--kv-cache-blocks", "256", "--prepare-workers", "1", *flags]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, STEP_DELAY_ENV: str(STEP_DELAY)})
    url, children = f"http://127.0.0.1:{port}", []
    try:
        wait_healthy(proc, url, log)
        children = psutil.Process(proc.pid).children(recursive=True)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, [c.cmdline() for c in alive]


def body(prompts: int, max_tokens: int, stream: bool) -> dict:
    """``prompts`` different prompts (a list repeating one prompt would count as that many choices of it,
    bounded by ``--max-request-output-tokens``)."""
    return {"model": "chat", "prompt": [f"Once upon a time {i}" for i in range(prompts)] if prompts > 1
            else "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}


def in_engine(url: str) -> int:
    """Requests running or waiting in the engine, from ``/metrics``."""
    text = httpx.get(f"{url}/metrics").text
    return sum(int(float(m)) for m in re.findall(r"^loraplex_requests_(?:running|waiting) (\S+)$", text, re.M))


class Background:
    """A request in a thread: ``result`` is (status, SSE data lines or JSON body)."""

    def __init__(self, url: str, payload: dict) -> None:
        self.result: tuple[int, object] | None = None
        self.started = threading.Event()  # the response's headers (and for a stream its first event) came
        self.thread = threading.Thread(target=self._run, args=(url, payload), daemon=True)
        self.thread.start()

    def _run(self, url: str, payload: dict) -> None:
        try:
            self._request(url, payload)
        except httpx.TransportError as exc:  # dropped: a forced exit
            self.result = (-1, exc)
            self.started.set()

    def _request(self, url: str, payload: dict) -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=payload, timeout=120) as r:
            if not payload["stream"]:
                self.started.set()
                self.result = (r.status_code, json.loads(r.read()))
                return
            events = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    self.started.set()
            self.result = (r.status_code, events)

    def join(self) -> tuple[int, object]:
        self.thread.join(120)
        assert self.result is not None
        return self.result


def assert_stopping(url: str) -> None:
    health = httpx.get(f"{url}/health")
    assert health.status_code == 503 and health.json()["status"] == "stopping", health.text
    refused = httpx.post(f"{url}/v1/completions", json=body(1, 2, False), timeout=30)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == 503, refused.text
    assert "shutting down" in refused.json()["error"]["message"]
    assert health.headers["connection"] == refused.headers["connection"] == "close"  # keep-alive ends: no reuse


def test_sigterm_drains_then_ends_what_is_left_and_exits_0(tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
                                                          tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    with serve(tiny_llama, tiny_llama_adapters["r4_attn"], log, "--max-num-seqs", "2", "--shutdown-timeout", "3",
               "--max-request-bytes", "20000") as (proc, url):
        big = json.dumps(body(1, 2, False) | {"prompt": "x" * 30_000}).encode()
        chunked = httpx.post(f"{url}/v1/completions", content=iter([big[:10_000], big[10_000:]]),
                             headers={"content-type": "application/json"})  # no Content-Length
        assert chunked.status_code == 413 and "--max-request-bytes" in chunked.json()["error"]["message"]

        finishing = Background(url, body(1, 100, stream=True) | {"stream_options": {"include_usage": True}})
        assert finishing.started.wait(120)  # it holds one of the two seats
        too_long = Background(url, body(32, LONG, stream=True))  # ~15,000 held steps on the other seat
        too_long_whole = Background(url, body(32, LONG, stream=False))
        deadline = time.monotonic() + 120
        while in_engine(url) < 60:  # both are accepted (their first choices may have finished)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert_stopping(url)
        status, events = finishing.join()
        assert status == 200 and events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert not any("error" in c for c in chunks)
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == 100  # served in full during the drain
        status, events = too_long.join()
        assert status == 200 and events[-1] == "[DONE]"
        error = json.loads(events[-2]).get("error", events[-3:])
        assert isinstance(error, dict) and error["code"] == 503 and "--shutdown-timeout" in error["message"], (
            error, log.read_text()[-3000:])
        status, whole = too_long_whole.join()  # ended by the shutdown timeout
        assert status == 503 and "--shutdown-timeout" in whole["error"]["message"], whole
        assert proc.wait(60) == 0, log.read_text()
        assert 2.5 < time.monotonic() - signalled < 60
    text = log.read_text()
    assert "shutdown timeout (3 s) reached: ended 2 open request(s)" in text, text


def test_sigint_twice_exits_at_once(tiny_llama: Path, tiny_llama_adapters: dict[str, Path], tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    with serve(tiny_llama, tiny_llama_adapters["r4_attn"], log, "--max-num-seqs", "1",
               "--shutdown-timeout", "120") as (proc, url):
        streaming = Background(url, body(16, LONG, stream=True))
        assert streaming.started.wait(120)
        proc.send_signal(signal.SIGINT)
        assert_stopping(url)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0, log.read_text()
        assert time.monotonic() - signalled < 30
        assert streaming.join()[0] == -1  # dropped, not served for two minutes
