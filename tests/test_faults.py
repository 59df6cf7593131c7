"""Faults over real HTTP (issue 18), in both engine modes (``loraplex serve``'s engine process with a
preparation worker, and the in-process engine): a step that raises fails only its own requests; a NaN-producing
slot write fails only the requests that read that slot; a step loop that dies turns ``/health`` 503 and ends
every open request with an error instead of leaving it hanging.

Faults are armed at run time through the engine's test hook (``loraplex/engine/checks/faults.py``: files in the
folder named by ``LORAPLEX_TEST_FAULTS``), so the same fault reaches either engine. Expected texts are HF
transformers + PEFT's greedy tokens, decoded by HF's tokenizer. One server per mode serves the module's tests
in file order; the dying step loop comes last."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loraplex.engine.checks.faults import FAULTS_ENV
from tests.hf_text import hf_complete
from tests.server_harness import MODES, Server, tiny_server, wait_until_idle

CONFIG = dict(max_loras=2, max_cpu_loras=4, max_lora_rank=16, kv_cache_blocks=256, max_num_seqs=2, debug_checks=True)
PROMPTS = ["Once upon a time", "The weather today", "def fibonacci(n):", "Dear diary,"]


@pytest.fixture(scope="module", params=MODES)
def server(request: pytest.FixtureRequest, tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv(FAULTS_ENV, str(tmp_path_factory.mktemp(f"faults-{request.param}")))  # read at the engine's start
        with tiny_server(tiny_llama, tiny_llama_adapters, ("r8_all", "r4_attn"), (), tmp_path_factory.mktemp("root"),
                         mode=request.param, **CONFIG) as srv:
            yield srv


@pytest.fixture
def flags(server: Server) -> Path:
    """The served engine's fault folder: a file written into it arms that fault (``engine/checks/faults.py``)."""
    return Path(os.environ[FAULTS_ENV])


def stream(url: str, model: str, prompt: str, max_tokens: int, events: list[dict]) -> None:
    """Stream a completion, appending every event (the text chunks and an error event, if any)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events.extend(json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {"))


def wait_for(condition: object, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def step_failures(srv: Server) -> int:
    return httpx.get(f"{srv.url}/health").json().get("step_failures", 0)


def check_returned(srv: Server) -> None:
    """Every KV block and pin is back (and, in-process, the engine's own integrity checks hold; the engine
    process runs its invariant checks every step: ``debug_checks``)."""
    wait_until_idle(srv.engine_client)
    engine = srv.engine
    if engine is not None:
        engine.adapters.check_integrity()
        engine.allocator.check_integrity([])
        assert engine.adapters.slot_table.pinned() == 0 and engine.adapters.versions.in_flight == {}


def test_a_failing_step_fails_only_its_requests(server: Server, flags: Path, tiny_llama: Path,
                                                tiny_llama_adapters: dict[str, Path]) -> None:
    """Two streams run (``max_num_seqs=2``), two more wait; the model's forward pass raises once: the two in
    that step end with an error event, the two waiting ones run afterwards and equal HF + PEFT's text."""
    before = step_failures(server)
    events: list[list[dict]] = [[] for _ in range(4)]
    threads = [threading.Thread(target=stream, args=(server.url, "r8_all", PROMPTS[i], 200 if i < 2 else 8, events[i]))
               for i in range(4)]
    for i, thread in enumerate(threads):
        thread.start()
        if i == 1:  # the first two run before the others queue
            wait_for(lambda: server.stats().num_running == 2, "two streams running")
    wait_for(lambda: server.stats().num_waiting == 2, "two requests waiting")
    (flags / "forward").write_text("")
    for thread in threads:
        thread.join(60)
    assert not (flags / "forward").exists(), "the fault never fired"
    for i in (0, 1):
        assert "error" in events[i][-1] and "injected fault" in events[i][-1]["error"]["message"], events[i][-1]
    for i in (2, 3):
        text = "".join(e["choices"][0]["text"] for e in events[i])
        assert text == hf_complete(tiny_llama, tiny_llama_adapters["r8_all"], PROMPTS[i], 8, ignore_eos=True).text
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok" and health["step_failures"] == before + 1
    assert "injected fault" in health["last_step_error"]
    assert f"loraplex_engine_step_failures_total {float(before + 1)}" in httpx.get(f"{server.url}/metrics").text
    check_returned(server)


def test_a_nan_slot_write_fails_only_the_requests_reading_it(server: Server, flags: Path, tiny_llama: Path,
                                                              tiny_llama_adapters: dict[str, Path]) -> None:
    """A slot write that leaves NaN in ``r4_attn``'s slot: its request fails with an error response naming
    non-finite logits; a request of another adapter, before and after, equals HF + PEFT's text."""
    before = step_failures(server)
    (flags / "nan-slot").write_text(str(tiny_llama_adapters["r4_attn"]))
    try:
        client = server.client()
        expected = hf_complete(tiny_llama, tiny_llama_adapters["r8_all"], PROMPTS[0], 6, ignore_eos=True).text
        kw = dict(prompt=PROMPTS[0], max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        assert client.completions.create(model="r8_all", **kw).choices[0].text == expected
        r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                       json={"model": "r4_attn", "prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0})
        assert r.status_code == 500 and "non-finite logits" in r.json()["error"]["message"], r.text
        assert client.completions.create(model="r8_all", **kw).choices[0].text == expected
        assert step_failures(server) == before + 1
        check_returned(server)
    finally:
        (flags / "nan-slot").unlink()


def test_a_dead_step_loop_ends_every_open_request(server: Server, flags: Path) -> None:
    """The step loop dies (an exception it does not catch; in ``loraplex serve`` that ends the engine process,
    which this server does not restart): ``/health`` turns 503 "dead", the open streams and the queued request
    end with an error instead of hanging, and new requests get 503. Last: the server stays dead."""
    why = "step loop died" if server.engine is not None else "engine process exited"
    events: list[list[dict]] = [[], []]
    threads = [threading.Thread(target=stream, args=(server.url, "r8_all", p, 300, e))
               for p, e in zip(PROMPTS[:2], events, strict=True)]
    for thread in threads:
        thread.start()
    wait_for(lambda: server.stats().num_running == 2, "two streams running")
    queued: list[httpx.Response] = []
    third = threading.Thread(target=lambda: queued.append(httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": "r4_attn", "prompt": "x", "max_tokens": 5})))
    third.start()
    wait_for(lambda: server.stats().num_waiting == 1, "a request waiting")
    (flags / "die").write_text("")
    for thread in (*threads, third):
        thread.join(30)
        assert not thread.is_alive(), "a request hangs after the step loop died"
    for e in events:
        assert "error" in e[-1] and why in e[-1]["error"]["message"], e[-1]
    assert queued[0].status_code == 503 and why in queued[0].json()["error"]["message"], queued[0].text
    r = httpx.get(f"{server.url}/health")
    assert r.status_code == 503 and r.json()["status"] == "dead", r.text
    if server.engine is not None:  # the engine process's traceback is in its log, not in /health
        assert "injected" in r.json()["detail"]
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "r8_all", "prompt": "x", "max_tokens": 2}, timeout=30)
    assert r.status_code == 503, r.text
