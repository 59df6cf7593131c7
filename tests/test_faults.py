"""Faults over real HTTP (issue 18): a step that raises fails only its own requests; a NaN-producing slot write
fails only the requests that read that slot; a step thread that dies turns ``/health`` 503 and ends every
open request with an error instead of leaving it hanging.

Faults are injected into the in-process engine (``AsyncEngine``, "thread" mode): the engine process of
``loraplex serve`` runs the same ``Engine.step`` and reports its step failures through ``StepOutputs``."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from loraplex import LLM, SamplingParams
from tests.server_harness import Server, tiny_server, wait_until_idle

CONFIG = dict(max_loras=2, max_cpu_loras=4, max_lora_rank=16, kv_cache_blocks=256, max_num_seqs=2, debug_checks=True)
PROMPTS = ["Once upon a time", "The weather today", "def fibonacci(n):", "Dear diary,"]


@pytest.fixture
def server(tiny_llama: Path, tiny_llama_adapters: dict[str, Path], tmp_path: Path) -> Iterator[Server]:
    with tiny_server(tiny_llama, tiny_llama_adapters, ("r8_all", "r4_attn"), (), tmp_path, **CONFIG) as srv:
        yield srv


def solo(tiny_llama: Path, adapters: dict[str, Path], model: str, prompt: str, max_tokens: int) -> str:
    llm = LLM(model=str(tiny_llama), **CONFIG)
    llm.load_adapter(model, adapters[model])
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return llm.generate([prompt], params, adapters=[model], use_tqdm=False)[0].text


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


def check_returned(srv: Server) -> None:
    """Every KV block and pin is back, and the engine's invariants hold."""
    wait_until_idle(srv.engine_client)
    engine = srv.engine
    assert engine is not None
    engine.adapters.check_integrity()
    engine.allocator.check_integrity([])
    assert engine.adapters.slot_table.pinned() == 0 and engine.adapters.versions.in_flight == {}


def test_a_failing_step_fails_only_its_requests(server: Server, tiny_llama: Path,
                                                tiny_llama_adapters: dict[str, Path]) -> None:
    """Two streams run (``max_num_seqs=2``), two more wait; the model's forward pass raises once: the two in
    that step end with an error event, the two waiting ones run afterwards and equal their solo text."""
    engine = server.engine
    armed = threading.Event()
    execute = engine.runner.execute

    def faulty(*args: object, **kwargs: object) -> torch.Tensor:
        if armed.is_set():
            armed.clear()
            raise RuntimeError("injected fault in the model forward")
        return execute(*args, **kwargs)

    engine.runner.execute = faulty
    events: list[list[dict]] = [[] for _ in range(4)]
    threads = [threading.Thread(target=stream, args=(server.url, "r8_all", PROMPTS[i], 200 if i < 2 else 8, events[i]))
               for i in range(4)]
    for i, thread in enumerate(threads):
        thread.start()
        if i == 1:  # the first two run before the others queue
            wait_for(lambda: server.stats().num_running == 2, "two streams running")
    wait_for(lambda: server.stats().num_waiting == 2, "two requests waiting")
    armed.set()
    for thread in threads:
        thread.join(60)
    for i in (0, 1):
        assert "error" in events[i][-1] and "injected fault" in events[i][-1]["error"]["message"], events[i][-1]
    for i in (2, 3):
        text = "".join(e["choices"][0]["text"] for e in events[i])
        assert text == solo(tiny_llama, tiny_llama_adapters, "r8_all", PROMPTS[i], 8)
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok" and health["step_failures"] == 1
    assert "injected fault" in health["last_step_error"]
    assert "loraplex_engine_step_failures_total 1.0" in httpx.get(f"{server.url}/metrics").text
    check_returned(server)


def test_a_nan_slot_write_fails_only_the_requests_reading_it(server: Server, tiny_llama: Path,
                                                              tiny_llama_adapters: dict[str, Path]) -> None:
    """A slot write that leaves NaN in ``r4_attn``'s slot: its request fails with an error response naming
    non-finite logits; a request of another adapter, before and after, is served exactly."""
    model = server.engine.model
    set_slot = model.set_slot

    def poisoning(slot: int, weights: object) -> None:
        set_slot(slot, weights)
        if str(weights.path) == str(tiny_llama_adapters["r4_attn"]):
            for module in model.modules():
                if hasattr(module, "lora_b"):
                    module.lora_b[slot].fill_(float("nan"))

    model.set_slot = poisoning
    client = server.client()
    expected = solo(tiny_llama, tiny_llama_adapters, "r8_all", PROMPTS[0], 6)
    kw = dict(prompt=PROMPTS[0], max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert client.completions.create(model="r8_all", **kw).choices[0].text == expected
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "r4_attn", "prompt": PROMPTS[1], "max_tokens": 6,
                                                         "temperature": 0}, timeout=60)
    assert r.status_code == 500 and "non-finite logits" in r.json()["error"]["message"], r.text
    assert client.completions.create(model="r8_all", **kw).choices[0].text == expected
    assert httpx.get(f"{server.url}/health").json()["step_failures"] == 1
    check_returned(server)


def test_a_dead_step_thread_ends_every_open_request(server: Server) -> None:
    """The step thread dies (an exception the step loop does not catch): ``/health`` turns 503 "dead", the
    open stream and the queued request end with an error instead of hanging, and new requests get 503."""
    engine = server.engine
    armed = threading.Event()
    step = engine.step

    class Fatal(BaseException):
        pass

    def dying() -> object:
        if armed.is_set():
            raise Fatal("injected: the step thread dies")
        return step()

    engine.step = dying
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
    armed.set()
    for thread in (*threads, third):
        thread.join(30)
        assert not thread.is_alive(), "a request hangs after the step thread died"
    for e in events:
        assert "error" in e[-1] and "step loop died" in e[-1]["error"]["message"], e[-1]
    assert queued[0].status_code == 503 and "step loop died" in queued[0].json()["error"]["message"]
    r = httpx.get(f"{server.url}/health")
    assert r.status_code == 503 and r.json()["status"] == "dead" and "injected" in r.json()["detail"]
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "r8_all", "prompt": "x", "max_tokens": 2}, timeout=30)
    assert r.status_code == 503, r.text
