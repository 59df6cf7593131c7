"""The OpenAI-compatible server over real HTTP (uvicorn on 127.0.0.1), with the official ``openai``
client and httpx: completions and chat, streamed and not, for the base model and two adapters, each
equal to HF transformers + PEFT's greedy output decoded by HF's tokenizer (``tests/hf_text.py``: no loraplex
code on the expected side); ``/v1/models`` through runtime load and unload; metrics; a client that disconnects
frees its request."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplex.engine.engine import STEP_DELAY_ENV
from tests.hf_text import HfAnswer, hf_chat, hf_complete
from tests.server_harness import BASE, MODES, Server, tiny_server, wait_until_idle

CONFIG = dict(max_loras=2, max_cpu_loras=4, max_lora_rank=16, kv_cache_blocks=256, max_num_seqs=8)
STARTUP = ("r8_all", "r4_attn")  # loaded at start; r16_mlp is loaded through the API
PROMPT = "The capital of France is"
STEP_DELAY = 0.002  # s per step
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module", params=MODES)
def server(request: pytest.FixtureRequest, tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The same app over an in-process engine ("thread") and over the engine process ("process"). Each step is
    held ``STEP_DELAY`` (the engine's test hook), so a 480-token request runs for >= 1 s on any machine."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv(STEP_DELAY_ENV, str(STEP_DELAY))  # read when the engine (or its process) starts
        with tiny_server(tiny_llama, tiny_llama_adapters, STARTUP, ("r16_mlp",), tmp_path_factory.mktemp("root"),
                         mode=request.param, **CONFIG) as srv:
            yield srv


@pytest.fixture(scope="module")
def hf(tiny_llama: Path, tiny_llama_adapters: dict[str, Path]) -> Callable[..., HfAnswer]:
    """``hf(model, prompt, max_tokens, ...)``: HF + PEFT's answer for a served name (``hf_complete``)."""
    def answer(model: str, prompt: str | list[int], max_tokens: int, **kw: object) -> HfAnswer:
        return hf_complete(tiny_llama, tiny_llama_adapters.get(model), prompt, max_tokens, **kw)
    return answer


def sse_lines(response: httpx.Response) -> list[str]:
    return [line for line in response.iter_lines() if line]


@pytest.mark.parametrize("model", [BASE, *STARTUP])
def test_completion_streamed_and_not_equal_hf(server: Server, hf: Callable[..., HfAnswer], model: str) -> None:
    want = hf(model, PROMPT, 12)
    text, n_tokens, finish = want.text, len(want.token_ids), want.finish_reason
    client = server.client()
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    assert full.choices[0].text == text
    assert full.choices[0].finish_reason == finish
    assert full.usage.completion_tokens == n_tokens
    assert full.usage.prompt_tokens == len(want.prompt_ids)
    assert full.usage.total_tokens == full.usage.prompt_tokens + n_tokens
    assert full.model == model and full.object == "text_completion"
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish
    assert chunks[-1].usage.completion_tokens == n_tokens


@pytest.mark.parametrize("model", [BASE, *STARTUP])
def test_chat_streamed_and_not_equal_hf(server: Server, tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
                                       model: str) -> None:
    want = hf_chat(tiny_llama, tiny_llama_adapters.get(model), MESSAGES, 10)
    prompt_ids, text, n_tokens, finish = want.prompt_ids, want.text, len(want.token_ids), want.finish_reason
    client = server.client()
    full = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=10, temperature=0)
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == text
    assert full.choices[0].finish_reason == finish
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (len(prompt_ids), n_tokens)
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=10, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == finish


def test_stop_strings_equal_hf(server: Server, hf: Callable[..., HfAnswer]) -> None:
    """Stop strings taken from the middle of HF's text end the request at the token that completes them, with
    the text before them, streamed or not (the engine process's outputs are detokenized and matched in the
    server)."""
    free = hf("r8_all", PROMPT, 24, ignore_eos=True).text
    stop = [free[len(free) // 2:len(free) // 2 + 3], "never appears"]
    want = hf("r8_all", PROMPT, 24, ignore_eos=True, stop=stop)
    assert want.finish_reason == "stop" and len(want.text) < len(free)
    kw = dict(model="r8_all", prompt=PROMPT, max_tokens=24, temperature=0, stop=stop, extra_body={"ignore_eos": True})
    full = server.client().completions.create(**kw)
    assert (full.choices[0].text, full.choices[0].finish_reason) == (want.text, "stop")
    assert full.usage.completion_tokens == len(want.token_ids)
    chunks = list(server.client().completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "stop"
    wait_until_idle(server.engine_client)


def test_adapters_change_the_output(hf: Callable[..., HfAnswer]) -> None:
    """Guards the equality tests above: base and the two adapters write different texts."""
    texts = {hf(model, PROMPT, 12).text for model in (BASE, *STARTUP)}
    assert len(texts) == 3


def test_raw_sse_format(server: Server) -> None:
    body = {"model": "r8_all", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = sse_lines(response)
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_models_follow_runtime_load_and_unload(server: Server, hf: Callable[..., HfAnswer]) -> None:
    client = server.client()
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {BASE, *STARTUP}
    assert cards[BASE].parent is None and cards[BASE].object == "model"
    for name in STARTUP:
        assert cards[name].parent == BASE
        assert Path(cards[name].root).resolve() == server.outside[name].resolve()
    folder = server.root / "r16_mlp"
    r = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "r16_mlp", "lora_path": str(folder)})
    assert r.status_code == 200, r.text
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {BASE, *STARTUP, "r16_mlp"}
    assert (cards["r16_mlp"].parent, Path(cards["r16_mlp"].root)) == (BASE, folder.resolve())
    text = hf("r16_mlp", PROMPT, 8).text
    assert client.completions.create(model="r16_mlp", prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text \
        == text
    r = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "r16_mlp"})
    assert r.status_code == 200, r.text
    assert {m.id for m in client.models.list().data} == {BASE, *STARTUP}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="r16_mlp", prompt=PROMPT, max_tokens=2)


def test_disconnect_mid_stream_aborts_the_request(server: Server) -> None:
    """Streamed and not: the client leaves early; the request is aborted, its KV blocks and pin freed."""
    aborted_before = metric_value(server, "loraplex_requests_total", adapter="r8_all", status="abort")
    body = {"model": "r8_all", "prompt": PROMPT, "max_tokens": 480, "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert server.stats().num_running == 1  # decoding, not finished
    asyncio.run(leave_once_running(server, body))
    wait_until_idle(server.engine_client)
    # Aborted, not run to the end: each request counted once, as "abort".
    assert metric_value(server, "loraplex_requests_total", adapter="r8_all", status="abort") == aborted_before + 2


async def leave_once_running(server: Server, body: dict) -> None:
    """POST ``body`` (not streamed) and drop the connection as soon as the engine runs it: no wall-clock
    guess of how long its tokens take (if it had finished first, it would count as "length", not "abort")."""
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        request = asyncio.ensure_future(http.post("/v1/completions", json=body))
        while (await server.engine_client.stats()).num_running == 0:
            assert not request.done(), request.result().text
            await asyncio.sleep(0.002)
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request


def metric_value(server: Server, name: str, **labels: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def test_metrics_and_health(server: Server) -> None:
    client = server.client()
    before = metric_value(server, "loraplex_requests_total", adapter="r4_attn", status="length")
    tokens_before = metric_value(server, "loraplex_generation_tokens_total", adapter="r4_attn")
    client.completions.create(model="r4_attn", prompt=PROMPT, max_tokens=5, temperature=0, extra_body={
        "ignore_eos": True})
    assert metric_value(server, "loraplex_requests_total", adapter="r4_attn", status="length") == before + 1
    assert metric_value(server, "loraplex_generation_tokens_total", adapter="r4_attn") == tokens_before + 5
    assert metric_value(server, "loraplex_time_to_first_token_seconds_count") >= 1
    assert metric_value(server, "loraplex_time_per_output_token_seconds_count") >= 1
    assert metric_value(server, "loraplex_step_latency_seconds_count") >= 5
    assert metric_value(server, "loraplex_adapter_slots_total") == 2
    assert metric_value(server, "loraplex_adapter_loads_total") >= len(STARTUP)
    assert metric_value(server, "loraplex_requests_running") == 0
    assert 0 <= metric_value(server, "loraplex_adapter_slot_occupancy") <= 1
    r = httpx.get(f"{server.url}/health")
    assert (r.status_code, r.json()) == (200, {"status": "ok"})
    hits = metric_value(server, "loraplex_adapter_prefix_cache_hit_tokens_total", adapter="r4_attn")
    queried = metric_value(server, "loraplex_adapter_prefix_cache_queried_tokens_total", adapter="r4_attn")
    for _ in range(2):  # 40 prompt tokens: the second request finds the first's two full blocks cached
        client.completions.create(model="r4_attn", prompt=list(range(5, 45)), max_tokens=2, temperature=0)
    assert metric_value(server, "loraplex_adapter_prefix_cache_hit_tokens_total", adapter="r4_attn") == hits + 32
    assert metric_value(server, "loraplex_adapter_prefix_cache_queried_tokens_total", adapter="r4_attn") == (
        queried + 80)
    assert metric_value(server, "loraplex_prefix_cache_blocks") >= 2
    slots = httpx.get(f"{server.url}/v1/slots").json()  # the engine's adapter_snapshot, through the client
    assert len(slots["slots"]) == 2 and {a["adapter"] for a in slots["adapters"]} >= set(STARTUP)


def test_chat_renders_the_adapters_own_template(server: Server, tiny_llama: Path,
                                               tiny_llama_adapters: dict[str, Path]) -> None:
    """An adapter folder that ships ``chat_template.jinja``: its chat requests are rendered with it (the
    base model's and other adapters' with the base template)."""
    folder = server.root / "templated"
    shutil.copytree(tiny_llama_adapters["r2_qv"], folder)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n"
                                                "{% endfor %}[assistant]")
    r = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "templated", "lora_path": str(folder)})
    assert r.status_code == 200, r.text
    try:
        want = hf_chat(tiny_llama, folder, MESSAGES, 8)
        base_prompt = hf_chat(tiny_llama, tiny_llama_adapters["r2_qv"], MESSAGES, 1).prompt_ids
        full = server.client().chat.completions.create(model="templated", messages=MESSAGES, max_tokens=8,
                                                       temperature=0)
        assert full.usage.prompt_tokens == len(want.prompt_ids) != len(base_prompt)
        assert full.choices[0].message.content == want.text
    finally:
        httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "templated"})
