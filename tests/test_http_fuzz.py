"""A Hypothesis state machine over real HTTP (issue 18): random interleavings of completions, streams cut at
random points, adapter loads, unloads and reloads (under other names and folders), bad adapter paths and
names, and unknown models, against a server on the tiny model with two device slots.

Streams run in background threads: a rule waits only until the server answered the headers (the request
is accepted or refused then), so the next rules (an unload, a reload with another folder, more streams)
run while it decodes. After each run:

- no 5xx and no error event: every refusal is the 4xx the state predicts (404 for a name not loaded, 409
  for a name taken, 400/403/404 for a bad adapter);
- every accepted stream that was not cut ends with ``finish_reason`` and ``[DONE]``: 0 lost requests, also
  when its adapter was unloaded or reloaded with other weights meanwhile;
- greedy texts equal the reference of the (folder, prompt) the name held when the request was accepted,
  computed once, alone, offline with the same engine configuration; a cut stream's text is a prefix of it;
- every KV block and adapter pin is returned (engine stats and ``/metrics``), and the adapter manager's
  integrity check holds.

Bounded for CI: a fixed number of examples and steps, derandomized (the same runs each time), no database,
no shrinking (a failing example is reported with its steps as they ran).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from loraplex import LLM, SamplingParams
from tests.server_harness import BASE, MODES, Server, tiny_server, wait_until_idle

CONFIG = dict(max_loras=2, max_cpu_loras=3, max_lora_rank=16, kv_cache_blocks=160, max_num_seqs=4)
FOLDERS = ("r8_all", "r4_attn", "r2_qv")
NAMES = ("a", "b", "c")
PROMPTS = ("Once upon a time", "def fibonacci(n):", "Roses are red")
MAX_TOKENS = 10
UNKNOWN_MODELS = ("nope", "A", "a/../b", "ü" * 3, "x" * 300, " ")
EXAMPLES, STEPS = 20, 20  # ~400 HTTP requests, ~15 s here
COUNTS: Counter = Counter()  # reported in the closing note: examples, requests, outcomes


def references(model: Path, adapters: dict[str, Path]) -> dict[tuple[str | None, str], str]:
    """(folder or None for the base, prompt) -> greedy text, each request run alone offline."""
    llm = LLM(model=str(model), **CONFIG)
    for folder in FOLDERS:
        llm.load_adapter(folder, adapters[folder])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return {(folder, prompt): llm.generate([prompt], params, adapters=[folder], use_tqdm=False)[0].text
            for folder in (None, *FOLDERS) for prompt in PROMPTS}


class Stream:
    """A streamed completion in a thread: ``accepted`` is set once the status is known."""

    def __init__(self, url: str, model: str, prompt: str, cut_after: int | None) -> None:
        self.model, self.prompt, self.cut_after = model, prompt, cut_after
        self.status: int | None = None
        self.text, self.finish_reason, self.done, self.errors = "", None, False, []
        self.accepted = threading.Event()
        body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "stream": True}
        self.thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self.thread.start()

    def _run(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
                self.status = response.status_code
                self.accepted.set()
                if response.status_code != 200:
                    response.read()
                    return
                self._read(response)
        except httpx.HTTPError as exc:
            self.errors.append(repr(exc))
        finally:
            self.accepted.set()

    def _read(self, response: httpx.Response) -> None:
        chunks = 0
        for line in response.iter_lines():
            if line == "data: [DONE]":
                self.done = True
                return
            if not line.startswith("data: "):
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                self.errors.append(event["error"])
                continue
            choice = event["choices"][0]
            self.text += choice["text"]
            self.finish_reason = choice["finish_reason"] or self.finish_reason
            chunks += 1
            if self.cut_after is not None and chunks >= self.cut_after:
                return  # the client goes away mid-stream


class HttpChurn(RuleBasedStateMachine):
    srv: Server
    refs: dict[tuple[str | None, str], str]

    def __init__(self) -> None:
        super().__init__()
        self.http = httpx.Client(base_url=self.srv.url, timeout=30)
        self.loaded: dict[str, str] = {}  # name -> folder
        self.streams: list[tuple[Stream, str | None]] = []  # and the folder the name held when it was accepted
        COUNTS["examples"] += 1

    @initialize(folders=st.lists(st.sampled_from(FOLDERS), min_size=len(NAMES), max_size=len(NAMES)))
    def load_all(self, folders: list[str]) -> None:
        """Start with every name loaded (so most requests are served), from random folders."""
        for name, folder in zip(NAMES, folders, strict=True):
            self.load(name, folder)

    def post(self, path: str, body: dict) -> httpx.Response:
        COUNTS["requests"] += 1
        response = self.http.post(path, json=body)
        COUNTS[f"http {response.status_code}"] += 1
        assert response.status_code < 500, (path, body, response.text)
        return response

    def expected_model(self, model: str) -> tuple[int, str | None]:
        if model == BASE:
            return 200, None
        return (200, self.loaded[model]) if model in self.loaded else (404, None)

    @rule(model=st.sampled_from((BASE, *NAMES)), prompt=st.sampled_from(PROMPTS),
          cut_after=st.none() | st.integers(1, MAX_TOKENS - 1))
    def stream(self, model: str, prompt: str, cut_after: int | None) -> None:
        status, folder = self.expected_model(model)
        COUNTS["requests"] += 1
        stream = Stream(self.srv.url, model, prompt, cut_after)
        assert stream.accepted.wait(60)
        assert stream.status == status, (model, stream.status, stream.errors)
        COUNTS[f"stream {status}"] += 1
        self.streams.append((stream, folder))

    @rule(model=st.sampled_from((BASE, *NAMES, *UNKNOWN_MODELS)), prompt=st.sampled_from(PROMPTS))
    def complete(self, model: str, prompt: str) -> None:
        status, folder = self.expected_model(model)
        r = self.post("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                          "temperature": 0, "ignore_eos": True})
        assert r.status_code == status, (model, r.text)
        if status == 200:
            assert r.json()["choices"][0]["text"] == self.refs[(folder, prompt)], (model, folder, prompt)

    @rule(name=st.sampled_from(NAMES), folder=st.sampled_from(FOLDERS))
    def load(self, name: str, folder: str) -> None:
        r = self.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(self.srv.root / folder)})
        assert r.status_code == (409 if name in self.loaded else 200), r.text
        self.loaded.setdefault(name, folder)

    @rule(name=st.sampled_from(NAMES))
    def unload(self, name: str) -> None:
        r = self.post("/v1/unload_lora_adapter", {"lora_name": name})
        assert r.status_code == (200 if name in self.loaded else 404), r.text
        self.loaded.pop(name, None)

    @rule(name=st.sampled_from(NAMES), folder=st.sampled_from(FOLDERS))
    def reload(self, name: str, folder: str) -> None:
        """Unload then load again, maybe from another folder: streams of the old version keep it."""
        self.post("/v1/unload_lora_adapter", {"lora_name": name})
        self.loaded.pop(name, None)
        self.load(name, folder)

    @rule(kind=st.sampled_from(("missing", "outside", "broken", "base name", "empty name", "no folder")))
    def load_bad(self, kind: str) -> None:
        root, name = self.srv.root, "bad"
        path, status = {"missing": (root / "missing", 404), "outside": (self.srv.outside["r8_all"], 403),
                        "broken": (root / "broken", 400), "no folder": (root / "r8_all" / "adapter_config.json", 404),
                        "base name": (root / "r8_all", 400), "empty name": (root / "r8_all", 400)}[kind]
        name = {"base name": BASE, "empty name": ""}.get(kind, name)
        r = self.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        assert r.status_code == status, (kind, r.text)
        assert r.json()["error"]["code"] == status

    @invariant()
    def no_stream_failed(self) -> None:
        for stream, _ in self.streams:
            assert not stream.errors, (stream.model, stream.errors)

    def teardown(self) -> None:
        deadline = time.monotonic() + 30  # for all of them: a tiny model serves these in well under a second
        for stream, folder in self.streams:
            stream.thread.join(max(0.0, deadline - time.monotonic()))
            assert not stream.thread.is_alive(), f"a stream of {stream.model!r} never ended"
            assert not stream.errors, (stream.model, stream.errors)  # no error event, no dropped connection
            if stream.status != 200:
                continue
            reference = self.refs[(folder, stream.prompt)]
            if stream.cut_after is None:
                assert stream.done and stream.finish_reason == "length", (stream.model, stream.text)
                assert stream.text == reference, (stream.model, folder, stream.prompt)
                COUNTS["streams served in full"] += 1
            else:
                assert reference.startswith(stream.text), (stream.model, folder, stream.prompt)
                COUNTS["streams cut"] += 1
        for name in list(self.loaded):
            self.unload(name)
        wait_until_idle(self.srv.engine_client, timeout=15)
        metrics = self.http.get("/metrics").text
        gauge = {m: float(v) for m, v in re.findall(r"^(loraplex_\w+) (\S+)$", metrics, re.M)}
        assert gauge["loraplex_kv_blocks_free"] == gauge["loraplex_kv_blocks_total"]
        assert gauge["loraplex_adapter_slots_pinned"] == 0
        assert self.http.get("/v1/models").json()["data"][1:] == []
        self.srv.check_integrity()
        self.http.close()


@pytest.mark.parametrize("mode", MODES)
def test_http_churn_state_machine(mode: str, tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
                                  tmp_path: Path) -> None:
    refs = references(tiny_llama, tiny_llama_adapters)
    COUNTS.clear()  # this mode's counts only
    with tiny_server(tiny_llama, tiny_llama_adapters, (), FOLDERS, tmp_path, mode=mode, **CONFIG) as srv:
        (srv.root / "broken").mkdir()
        (srv.root / "broken" / "adapter_config.json").write_text("{not json")
        HttpChurn.srv, HttpChurn.refs = srv, refs
        run_state_machine_as_test(HttpChurn, settings=settings(
            max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None, derandomize=True, database=None,
            suppress_health_check=list(HealthCheck), phases=(Phase.explicit, Phase.generate)))  # no shrinking:
        # a failing run waits on hung streams; its steps are printed as they were
    print(dict(COUNTS))  # noqa: T201 - the fuzz counts, for the closing note (pytest -s)
    assert COUNTS["examples"] >= EXAMPLES and COUNTS["streams served in full"] > 0 and COUNTS["streams cut"] > 0, COUNTS
