"""``loraplex serve`` as users run it (the engine in its own process, requests prepared in worker
processes) keeps every stream flowing while it refuses huge requests (issue 21): a 10 MB prompt, a
100k-message chat and a 1 MB ``stop`` list, sent one after the other next to 8 streams.

Measured from the client side: a timestamp on every chunk of every stream and on every ``/health``
request and reply. Each gap between two chunks of a stream, and each ``/health`` round trip, is an
interval; it is attributed to every huge request whose time in flight it overlaps (a stall that starts
during a huge request and ends after it counts against that request, not against the quiet baseline).
The bound is absolute, scaled by a calibration taken in the same run: the median gap between two chunks
outside the huge requests (one decode step of the 8 streams on this host at this moment). No gap
overlapping a huge request may exceed ``GAP_STEPS`` median gaps, and no ``/health`` round trip
overlapping one may exceed ``HEALTH_LIMIT_S`` or ``HEALTH_STEPS`` median gaps, whichever is larger (a
loaded host stretches both the step and the scheduling latency of the API process). An event-loop block
of a second (``time.sleep(1)`` in the completions handler) fails it.

The model is a random Llama sized so that a decode step takes tens of milliseconds, not
scheduler-noise-sized; the engine runs one thread (``--threads 1``: one core for the step loop, the
other for the API process and the workers, as vLLM reserves a core for its API server).

Then the engine process is killed: the open stream ends with an error event, ``/health`` turns 503
and new requests get 503. SIGTERM stops the server, and no process it started is left behind.
"""

from __future__ import annotations

import asyncio
import json
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest

from tests.fixtures import write_tiny_model
from tests.test_cli import free_port

MID = dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=24, num_attention_heads=6,
           num_key_value_heads=2, max_position_embeddings=2048)
STREAMS = 8
HEALTH_LIMIT_S = 0.1
WARM_CHUNKS = 8  # chunks every stream has received before its gaps count (prefill and start-up)
QUIET_CHUNKS = 30  # gaps of every stream measured before the first huge request and after the last
GAP_STEPS = 10  # the longest gap next to a huge request, in median gaps of the same run
HEALTH_STEPS = 6  # the longest /health round trip next to a huge request, in median gaps
HUGE = [  # (what, path, body, the refused field)
    ("10 MB prompt", "/v1/completions",
     {"model": "mid", "prompt": "lorem ipsum " * 873_813, "max_tokens": 4}, "prompt"),
    ("100k-message chat", "/v1/chat/completions",
     {"model": "mid", "messages": [{"role": "user", "content": "hi"}] * 100_000}, "messages"),
    ("1 MB stop list", "/v1/completions",
     {"model": "mid", "prompt": "Hello", "stop": [f"stop-{i:07d}" for i in range(95_000)]}, "stop"),
]


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log: Path
    children: list[psutil.Process] = field(default_factory=list)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = write_tiny_model(tmp_path_factory.mktemp("mid"), "llama", **MID)
    port, log = free_port(), tmp_path_factory.mktemp("serve") / "serve.log"
    cmd = [sys.executable, "-m", "loraplex.cli", "serve", "--model", str(folder), "--served-model-name", "mid",
           "--port", str(port), "--kv-cache-blocks", "1024", "--max-request-bytes", str(64 << 20), "--threads", "1",
           "--log-level", "WARNING"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    srv = Server(f"http://127.0.0.1:{port}", proc, log)
    try:
        deadline = time.monotonic() + 300
        while not _healthy(srv.url):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        srv.children = psutil.Process(proc.pid).children(recursive=True)
        yield srv
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health").status_code == 200
    except httpx.TransportError:
        return False


async def stream_chunks(http: httpx.AsyncClient, i: int, arrivals: list[float], stop: asyncio.Event) -> None:
    """Stream a long completion, recording when each chunk arrives, until ``stop`` is set."""
    body = {"model": "mid", "prompt": f"Stream number {i} says:", "max_tokens": 1500, "temperature": 0,
            "ignore_eos": True, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                assert "error" not in json.loads(line[6:]), line
                arrivals.append(time.perf_counter())
            if stop.is_set():
                return


@dataclass
class Phase:
    arrivals: list[list[float]]  # per stream, when each chunk arrived
    windows: list[tuple[float, float]]  # while each huge request was in flight
    health: list[tuple[float, float]]  # (sent, answered) of /health, polled throughout
    answers: list[httpx.Response]


async def wait_for_chunks(arrivals: list[list[float]], more: int) -> None:
    target = min(len(a) for a in arrivals) + more
    while min(len(a) for a in arrivals) < target:
        await asyncio.sleep(0.01)


async def huge_requests_next_to_streams(url: str) -> Phase:
    bodies = [(path, json.dumps(body).encode()) for _, path, body, _ in HUGE]  # built before the clock runs
    phase = Phase([[] for _ in range(STREAMS)], [], [], [])
    stop = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        tasks = [asyncio.ensure_future(stream_chunks(http, i, phase.arrivals[i], stop)) for i in range(STREAMS)]

        async def poll_health() -> None:
            while not stop.is_set():
                start = time.perf_counter()
                assert (await http.get("/health")).status_code == 200
                phase.health.append((start, time.perf_counter()))
                await asyncio.sleep(0.03)

        await wait_for_chunks(phase.arrivals, WARM_CHUNKS)
        poller = asyncio.ensure_future(poll_health())
        await wait_for_chunks(phase.arrivals, QUIET_CHUNKS)
        for path, content in bodies:
            start = time.perf_counter()
            phase.answers.append(await http.post(path, content=content, headers={"content-type": "application/json"}))
            phase.windows.append((start, time.perf_counter()))
        await wait_for_chunks(phase.arrivals, QUIET_CHUNKS)
        stop.set()
        await asyncio.gather(poller, *tasks)
    return phase


def overlapped(interval: tuple[float, float], windows: list[tuple[float, float]]) -> list[int]:
    """The huge requests (indices into ``windows``) whose time in flight overlaps ``interval``."""
    begin, end = interval
    return [k for k, (lo, hi) in enumerate(windows) if begin < hi and end > lo]


def stalls(phase: Phase) -> tuple[float, list[str]]:
    """The calibration (the median gap outside the huge requests) and every gap or /health round trip
    overlapping a huge request beyond its bound (module docstring)."""
    gaps = [[(begin, end) for begin, end in zip(times[WARM_CHUNKS:], times[WARM_CHUNKS + 1:], strict=False)]
            for times in phase.arrivals]
    step = statistics.median(end - begin for stream in gaps for begin, end in stream
                             if not overlapped((begin, end), phase.windows))
    found = []
    for what, bound, intervals in [
            *((f"stream {i}", GAP_STEPS * step, stream) for i, stream in enumerate(gaps)),
            ("/health", max(HEALTH_LIMIT_S, HEALTH_STEPS * step), phase.health)]:
        next_to = [(end - begin, k) for begin, end in intervals for k in overlapped((begin, end), phase.windows)]
        if not next_to:
            found.append(f"{what}: nothing measured while the huge requests were served")
        elif max(next_to)[0] > bound:
            worst, k = max(next_to)
            found.append(f"{what}: {worst * 1e3:.0f} ms next to the {HUGE[k][0]}; bound {bound * 1e3:.0f} ms")
    return step, found


def test_streams_keep_flowing_while_huge_requests_are_refused(server: Server) -> None:
    phase = asyncio.run(huge_requests_next_to_streams(server.url))
    for (what, _, _, param), answer in zip(HUGE, phase.answers, strict=True):
        assert answer.status_code == 400, (what, answer.text[:300])
        assert answer.json()["error"]["param"] == param, (what, answer.text[:300])
    step, found = stalls(phase)
    assert not found, f"median gap {step * 1e3:.1f} ms; {found}"


def test_engine_death_ends_open_requests_then_sigterm_leaves_nothing(server: Server) -> None:
    engine = next(p for p in server.children if "loraplex.engine.core_process" in " ".join(p.cmdline()))
    body = {"model": "mid", "prompt": "Doomed", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: {")
        engine.kill()
        rest = [line for line in lines if line]
    assert '"error"' in rest[-2] and rest[-1] == "data: [DONE]", rest[-3:]
    assert json.loads(rest[-2][6:])["error"]["code"] == 503
    r = httpx.get(f"{server.url}/health")
    assert (r.status_code, r.json()["status"]) == (503, "restarting")  # the engine restarts (issue 30)
    r = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False})
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable", r.text
    deadline = time.monotonic() + 120
    while httpx.get(f"{server.url}/health").status_code != 200:
        assert time.monotonic() < deadline, server.log.read_text()
        time.sleep(0.2)
    children = psutil.Process(server.proc.pid).children(recursive=True)  # the new engine among them
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=60) == 0, server.log.read_text()
    _, alive = psutil.wait_procs([*server.children, *children], timeout=30)
    assert not alive, f"left behind: {[(p.pid, p.cmdline()) for p in alive]}"
