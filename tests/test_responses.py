"""``/v1/responses`` with the real ``openai`` client against a tiny model: ``responses.create`` (text equal to
HF's greedy continuation of the same chat prompt), ``responses.stream`` (its events add up to the same
response), ``previous_response_id`` (the follow-up's prompt is the whole conversation, as HF's template
renders it), function tools (a call, its output fed back, a final answer), ``text.format`` json_schema,
``max_output_tokens`` (incomplete), GET/DELETE per tenant, unimplemented fields as 400s, and the store's
LRU, size cap and TTL."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from loraplex.config import EngineConfig
from loraplex.server.openai.responses_api.store import ResponseStore, StoredResponse
from tests.reference import greedy_with_adapter
from tests.server_harness import BASE, Server, tiny_server

KEYS = """
[[keys]]
key = "sk-a-0123456789"
tenant = "a"
adapters = ["*"]

[[keys]]
key = "sk-b-0123456789"
tenant = "b"
adapters = ["*"]
"""
KEY_A, KEY_B = "sk-a-0123456789", "sk-b-0123456789"
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather now", "parameters": WEATHER}]


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    keys = tmp_path_factory.mktemp("keys") / "keys.toml"
    keys.write_text(KEYS)
    with tiny_server(tiny_llama, tiny_llama_adapters, ("r8_all",), (), tmp_path_factory.mktemp("root"),
                     app_options={"api_keys": str(keys)}, max_loras=2, max_lora_rank=16, kv_cache_blocks=128,
                     max_num_seqs=4) as srv:
        yield srv


def _hf_text(model: Path, adapter: Path | None, messages: list[dict], n: int) -> tuple[str, int]:
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    [(tokens, _)] = greedy_with_adapter(model, adapter, [list(prompt)], n)
    if tokenizer.eos_token_id in tokens:
        tokens = tokens[: tokens.index(tokenizer.eos_token_id)]
    return tokenizer.decode(tokens, skip_special_tokens=True), len(prompt)


@pytest.mark.parametrize("model", [BASE, "r8_all"])
def test_create_and_stream_equal_hf(server: Server, tiny_llama: Path, tiny_llama_adapters: dict, model: str) -> None:
    client = server.client(KEY_A)
    kw = dict(model=model, instructions="Be terse.", input="Name a colour.", max_output_tokens=8, temperature=0)
    response = client.responses.create(**kw)
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a colour."}]
    text, prompt_tokens = _hf_text(tiny_llama, tiny_llama_adapters.get(model), messages, 8)
    assert response.output_text == text and response.usage.input_tokens == prompt_tokens
    assert response.status in ("completed", "incomplete") and response.object == "response"
    with client.responses.stream(**kw) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    final = events[-1].response  # response.completed, or response.incomplete (as OpenAI: past max_output_tokens)
    assert final.status == response.status and final.id != response.id
    assert final.output_text == text and final.usage.output_tokens == response.usage.output_tokens
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.output_text.delta" in kinds and "response.output_item.done" in kinds


def test_previous_response_id_continues_the_conversation(server: Server, tiny_llama: Path) -> None:
    client = server.client(KEY_A)
    first = client.responses.create(model=BASE, input="Hello there.", max_output_tokens=6, temperature=0)
    second = client.responses.create(model=BASE, input="And then?", previous_response_id=first.id,
                                     max_output_tokens=6, temperature=0)
    messages = [{"role": "user", "content": "Hello there."}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "And then?"}]
    text, prompt_tokens = _hf_text(tiny_llama, None, messages, 6)
    assert (second.output_text, second.usage.input_tokens) == (text, prompt_tokens)
    assert client.responses.retrieve(first.id).id == first.id
    with pytest.raises(openai.NotFoundError):  # another tenant's response
        server.client(KEY_B).responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        server.client(KEY_B).responses.create(model=BASE, input="x", previous_response_id=first.id)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    unstored = client.responses.create(model=BASE, input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_tool_loop_finishes(server: Server) -> None:
    client = server.client(KEY_A)
    called = client.responses.create(model=BASE, input="Weather in Paris?", tools=TOOLS, tool_choice="required",
                                     parallel_tool_calls=False, max_output_tokens=40, temperature=0)
    [call] = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Rome")
    final = client.responses.create(model=BASE, previous_response_id=called.id, tools=TOOLS, max_output_tokens=6,
                                    temperature=0, input=[{"type": "function_call_output", "call_id": call.call_id,
                                                           "output": '{"temp": 21}'}])
    assert final.output and final.output[0].type == "message"
    with client.responses.stream(model=BASE, input="Weather in Rome?", tools=TOOLS, tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=40, temperature=0) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    streamed = events[-1].response
    [streamed_call] = [item for item in streamed.output if item.type == "function_call"]
    assert "response.function_call_arguments.delta" in kinds
    jsonschema.validate(json.loads(streamed_call.arguments), WEATHER)


def test_text_format_json_schema(server: Server) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    response = server.client(KEY_A).responses.create(
        model=BASE, input="Answer in JSON.", max_output_tokens=30, temperature=0,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(response.output_text), schema)


def test_incomplete_and_unimplemented_fields(server: Server) -> None:
    client = server.client(KEY_A)
    cut = client.responses.create(model=BASE, input="Tell a long story.", max_output_tokens=2, temperature=0)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    headers = {"Authorization": f"Bearer {KEY_A}"}
    for field, value in (("background", True), ("truncation", "auto"), ("frobnicate", 1)):
        r = httpx.post(f"{server.url}/v1/responses", headers=headers, json={"model": BASE, "input": "x", field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    r = httpx.post(f"{server.url}/v1/responses", headers=headers, json={"model": "nope", "input": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_store_is_per_tenant_lru_with_a_ttl() -> None:
    now = [0.0]
    store = ResponseStore(max_responses=2, ttl_s=10, clock=lambda: now[0])
    entry = StoredResponse({"id": "r"}, [])
    store.put("a", "r1", entry)
    store.put("a", "r2", entry)
    assert store.get("b", "r1") is None and store.get("a", "r1") is entry  # r1 now most recently used
    store.put("a", "r3", entry)
    assert store.get("a", "r2") is None and store.get("a", "r1") is entry and len(store) == 2
    now[0] = 11
    assert store.get("a", "r1") is None and store.get("a", "r3") is None


def test_streamed_reasoning_becomes_a_reasoning_item() -> None:
    """A chat stream's ``reasoning_content`` deltas (what ``--reasoning-parser`` splits off, checked over
    HTTP in test_reasoning) stream as ``response.reasoning_text.delta`` events of one reasoning item before
    the message; every event parses as the ``openai`` package's own event types."""
    from pydantic import TypeAdapter

    from loraplex.server.openai.responses_api.output import ResponseEvents
    from loraplex.server.openai.responses_api.request import ResponsesRequest

    events = ResponseEvents(ResponsesRequest.model_validate({"model": BASE, "input": "Is 7 prime?", "stream": True}))
    deltas = [{"reasoning_content": "Seven has "}, {"reasoning_content": "no divisors."}, {"content": "Yes"},
              {"content": "."}]
    lines = events.start() + [e for d in deltas for e in events.chunk({"choices": [{"index": 0, "delta": d}]})]
    lines += events.chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    lines += events.chunk({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12,
                                                    "prompt_tokens_details": {"cached_tokens": 0}}})
    parser = TypeAdapter(openai.types.responses.ResponseStreamEvent)
    parsed = [parser.validate_python(json.loads(line.split("data: ", 1)[1])) for line in lines]
    assert [p.sequence_number for p in parsed] == list(range(len(parsed)))
    thought = [p for p in parsed if p.type == "response.reasoning_text.delta"]
    assert "".join(p.delta for p in thought) == "Seven has no divisors." and {p.output_index for p in thought} == {0}
    text = [p for p in parsed if p.type == "response.output_text.delta"]
    assert "".join(p.delta for p in text) == "Yes." and {p.output_index for p in text} == {1}
    done = next(p for p in parsed if p.type == "response.reasoning_text.done")
    assert done.text == "Seven has no divisors."
    final = parsed[-1].response
    assert parsed[-1].type == "response.completed" and [i.type for i in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "Seven has no divisors." and final.output_text == "Yes."


def test_usage_counts_prompt_tokens_from_the_prefix_cache(server: Server) -> None:
    """``prompt_tokens_details.cached_tokens`` (chat) and ``input_tokens_details.cached_tokens`` (Responses)
    are the engine's count: a new prompt shares only its chat template's first blocks with earlier ones;
    the same prompt again reuses every full block but the one holding its last token (recomputed for its
    logits)."""
    client = server.client(KEY_A)
    text = "Count the blocks of this fairly long and entirely unique prompt, said only by this test, twice over."
    kw = dict(model=BASE, messages=[{"role": "user", "content": text}], max_tokens=2, temperature=0)
    first, again = client.chat.completions.create(**kw).usage, client.chat.completions.create(**kw).usage
    block = EngineConfig.block_size  # tiny_server's default
    assert first.prompt_tokens_details.cached_tokens % block == 0
    assert first.prompt_tokens_details.cached_tokens < again.prompt_tokens_details.cached_tokens
    assert again.prompt_tokens_details.cached_tokens == (again.prompt_tokens - 1) // block * block
    response = client.responses.create(model=BASE, input=text, max_output_tokens=2, temperature=0)
    assert response.usage.input_tokens_details.cached_tokens == again.prompt_tokens_details.cached_tokens
    assert response.usage.input_tokens_details.cache_write_tokens == 0
