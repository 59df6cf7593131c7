"""``loraplex serve`` as users run it (the engine in its own process, requests prepared in worker
processes) keeps every stream flowing while it refuses huge requests (issue 21): a 10 MB prompt, a
100k-message chat and a 1 MB ``stop`` list, sent one after the other next to 8 streams. ``/health``
answers within 100 ms throughout, and no stream's gap between two chunks while a huge request is in
flight exceeds twice its median gap.

Measured robustly: the client runs in this process, the server in others; the model is a random
Llama sized so that a decode step takes tens of milliseconds, not scheduler-noise-sized; the engine
runs one thread (``--threads 1``: one core for the step loop, the other for the API process and the
workers, as vLLM reserves a core for its API server; two OpenMP threads sharing both cores with every
other process turn each preemption into a stalled step); and each stream's gaps outside the huge
requests (``QUIET_CHUNKS`` before the first and after the last) are its baseline, and so are the
``/health`` latencies outside them. On a quiet machine those baselines stay under twice the median
and under 100 ms, and the bounds are exactly the ones above; on a host shared with other busy
processes, a gap or a ``/health`` latency is blamed on the huge requests only if it also exceeds every
baseline one (other tenants' bursts hit both phases alike), and only if it happens again in each of
``ATTEMPTS`` runs (a stall the huge requests cause is in every run; another tenant's burst is not).

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
ATTEMPTS = 3  # runs of the huge requests before a stall counts (see the test)
QUIET_CHUNKS = 30  # gaps of every stream measured before the first huge request and after the last
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
    health: list[tuple[float, float]]  # (when it answered, latency) of /health, polled throughout
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
                phase.health.append((time.perf_counter(), time.perf_counter() - start))
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


def stalls(phase: Phase) -> list[str]:
    """What in ``phase`` the huge requests may have stalled: a /health latency or a stream's gap beyond its
    bound (module docstring)."""
    found = []
    health_during = [lat for end, lat in phase.health if any(lo <= end <= hi for lo, hi in phase.windows)]
    health_quiet = [lat for end, lat in phase.health if not any(lo <= end <= hi for lo, hi in phase.windows)]
    if not health_during or max(health_during) >= max(HEALTH_LIMIT_S, max(health_quiet)):
        found.append(f"/health took {max(health_during, default=float('nan')) * 1e3:.0f} ms during the huge "
                     f"requests; outside them at most {max(health_quiet) * 1e3:.0f} ms")
    for i, times in enumerate(phase.arrivals):
        gaps = [(end, end - begin) for begin, end in zip(times[WARM_CHUNKS:], times[WARM_CHUNKS + 1:], strict=False)]
        during = [(gap, end) for end, gap in gaps if any(lo <= end <= hi for lo, hi in phase.windows)]
        quiet = [gap for end, gap in gaps if not any(lo <= end <= hi for lo, hi in phase.windows)]
        median = statistics.median(gap for _, gap in gaps)
        if not during:
            found.append(f"stream {i}: no chunk arrived while the huge requests were served")
        elif max(during)[0] > max(2 * median, max(quiet)):
            worst, at = max(during)
            which = next(HUGE[k][0] for k, (lo, hi) in enumerate(phase.windows) if lo <= at <= hi)
            found.append(f"stream {i}: a gap of {worst * 1e3:.0f} ms during the {which}; median {median * 1e3:.0f} "
                         f"ms, largest quiet gap {max(quiet) * 1e3:.0f} ms")
    return found


def test_streams_keep_flowing_while_huge_requests_are_refused(server: Server) -> None:
    """Up to ``ATTEMPTS`` runs: a stall the huge requests cause shows in every run; another tenant's burst
    on a shared host (measured: about one run in four at load 3-4 on 2 cores) does not."""
    failures: list[list[str]] = []
    while len(failures) < ATTEMPTS:
        phase = asyncio.run(huge_requests_next_to_streams(server.url))
        for (what, _, _, param), answer in zip(HUGE, phase.answers, strict=True):
            assert answer.status_code == 400, (what, answer.text[:300])
            assert answer.json()["error"]["param"] == param, (what, answer.text[:300])
        found = stalls(phase)
        if not found:
            return
        failures.append(found)
    raise AssertionError(f"every run stalled: {failures}")


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
    assert (r.status_code, r.json()["status"]) == (503, "dead")
    r = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False})
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable", r.text
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=60) == 0, server.log.read_text()
    _, alive = psutil.wait_procs(server.children, timeout=30)
    assert not alive, f"left behind: {[(p.pid, p.cmdline()) for p in alive]}"
