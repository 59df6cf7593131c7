"""Backpressure and timeouts over real HTTP, in both engine modes: a full queue (``max_waiting_requests``)
answers 503 with ``Retry-After`` and OpenAI's error body, never queues without bound; ``--request-timeout``
stops a request (504, or a final error event on a stream), aborts it in the engine and returns its KV
blocks and adapter pin."""

from __future__ import annotations

import json
import pickle
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loraplex.config import EngineConfig
from loraplex.engine.checks.faults import FAULTS_ENV
from loraplex.engine.engine import STEP_DELAY_ENV, Engine
from loraplex.engine.request import NewRequest, SamplingParams
from loraplex.errors import QueueFull, RequestError
from tests.server_harness import BASE, MODES, tiny_server, wait_until_idle

LONG = 480  # tokens: with one seat, four prompts of these run for ~2,000 steps, each >= STEP_DELAY
STEP_DELAY = 0.005  # s: the engine's test hook holds each step, so ~2,000 steps last >= 10 s on any machine


def sse_events(response: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def test_the_bound_counts_waiting_requests_not_running_ones(tiny_llama: Path) -> None:
    engine = Engine(EngineConfig(model=str(tiny_llama), max_num_seqs=1, max_waiting_requests=1, kv_cache_blocks=64))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params)  # the free seat
    with pytest.raises(RequestError):  # refused for another reason: not counted
        engine.add_request("bad", [], params)
    engine.add_request("b", [5, 6, 7], params)  # waits
    with pytest.raises(QueueFull, match="--max-waiting-requests") as refused:
        engine.add_requests([NewRequest("c", [5], params)])
    assert refused.value.retry_after == 1 and refused.value.http_status == 503
    copy = pickle.loads(pickle.dumps(refused.value))  # crosses the engine process's socket
    assert (type(copy), str(copy), copy.retry_after) == (QueueFull, str(refused.value), 1)
    engine.step()  # "a" runs, "b" waits: the seat is taken, one may wait
    assert engine.stats().num_running == 1 and engine.stats().num_waiting == 1
    with pytest.raises(QueueFull):
        engine.add_request("c", [5], params)
    finished = set()
    while engine.has_unfinished_requests():
        finished |= {out.request_id for out in engine.step() if out.finished}
    assert finished == {"a", "b"}  # nothing refused was queued
    engine.add_requests([NewRequest("d", [5], params), NewRequest("e", [6], params)])  # idle again: seat + one waiting


@pytest.fixture(params=MODES)
def server(request: pytest.FixtureRequest, tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
           tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator:
    monkeypatch.setenv(STEP_DELAY_ENV, str(STEP_DELAY))  # read by the engine (and the engine process) at start
    monkeypatch.setenv(FAULTS_ENV, str(tmp_path / "faults"))  # the "hold" gate (engine/checks/faults.py)
    (tmp_path / "faults").mkdir()
    (tmp_path / "root").mkdir()
    with tiny_server(tiny_llama, tiny_llama_adapters, ("r4_attn",), (), tmp_path / "root", mode=request.param,
                     app_options={"request_timeout": 1.5}, max_num_seqs=1, max_waiting_requests=3,
                     kv_cache_blocks=128) as srv:
        yield srv


def long_body(stream: bool, prompts: int = 1, max_tokens: int = LONG) -> dict:
    prompt = "Once upon a time" if prompts == 1 else ["Once upon a time"] * prompts
    return {"model": "r4_attn", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}


def assert_queue_full(r: httpx.Response) -> None:
    assert r.status_code == 503, r.text
    assert r.headers["Retry-After"] == "1"
    error = r.json()["error"]
    assert error["code"] == 503 and error["type"] == "service_unavailable"
    assert "--max-waiting-requests" in error["message"]


def test_full_queue_is_503_with_retry_after_and_timeouts_stop_requests(server) -> None:
    url = server.url
    with httpx.Client(base_url=url, timeout=120) as http:
        # one seat, three may wait: five choices cannot all be in the engine at once
        assert_queue_full(http.post("/v1/completions", json={**long_body(False, max_tokens=2), "n": 5}))
        hold = server.root.parent / "faults" / "hold"
        hold.write_text("")  # the engine admits the stream, then waits at the gate: the seat stays taken
        events: list[str] = []

        def stream() -> None:
            with http.stream("POST", "/v1/completions", json=long_body(True, max_tokens=8)) as response:
                events.extend(sse_events(response))

        running = threading.Thread(target=stream)
        running.start()
        deadline = time.monotonic() + 60
        while server.stats().num_running != 1:  # it holds the seat now
            assert time.monotonic() < deadline and running.is_alive(), events
            time.sleep(0.01)
        assert_queue_full(http.post("/v1/completions", json=long_body(False, prompts=4, max_tokens=2)))
        assert_queue_full(http.post("/v1/chat/completions", json={
            "model": BASE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 4}))
        hold.unlink()
        running.join(60)
        rest = [json.loads(e) for e in events if e.startswith("{")]
        assert rest[-1]["choices"][0]["finish_reason"] == "length"  # accepted, then served in full
        wait_until_idle(server.engine_client)
        ok = http.post("/v1/completions", json=long_body(False, max_tokens=2))
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2

        # --request-timeout 1.5: four prompts of 480 tokens on one seat: ~2,000 held steps, >= 10 s
        timed_out = http.post("/v1/completions", json=long_body(False, prompts=4))
        assert timed_out.status_code == 504, timed_out.text
        error = timed_out.json()["error"]
        assert (error["code"], error["type"]) == (504, "timeout_error") and "--request-timeout" in error["message"]
        wait_until_idle(server.engine_client, timeout=10)  # aborted in the engine: blocks and pin returned
        with http.stream("POST", "/v1/completions", json=long_body(True, prompts=4)) as streamed:
            assert streamed.status_code == 200
            events = sse_events(streamed)
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert last["error"]["code"] == 504 and last["error"]["type"] == "timeout_error", events[-3:]
        assert any("choices" in json.loads(e) for e in events[:-2])  # tokens came before the cut
        wait_until_idle(server.engine_client, timeout=10)
