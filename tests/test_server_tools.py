"""Tool calls over HTTP with the official client: ``tool_choice`` "required" and a named function constrain
the output to the tool-call JSON (arguments validate against each tool's parameters); "auto" parses the
model's own Hermes-style ``<tool_call>`` blocks; ids, ``finish_reason: "tool_calls"``, streamed deltas;
assistant ``tool_calls`` and ``tool`` messages round-trip through a chat template; errors name the field."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest
from transformers import AutoTokenizer

from loraplex.server.openai.protocol import ChatCompletionRequest
from loraplex.server.openai.tool_parsers import PARSERS
from tests.server_harness import BASE, MODES, Server, tiny_server

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"]}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMA_OF = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module", params=MODES)
def server(request: pytest.FixtureRequest, tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """In both engine modes: ``loraplex serve``'s (the engine process and a preparation worker) and in-process."""
    with tiny_server(tiny_llama, tiny_llama_adapters, ("r8_all",), (), tmp_path_factory.mktemp("root"),
                     mode=request.param, max_loras=2, max_lora_rank=16, kv_cache_blocks=256,
                     max_num_seqs=16) as srv:
        yield srv


def check_calls(calls: list, names: set[str]) -> None:
    assert calls and len({c.id for c in calls}) == len(calls)
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function" and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])


@pytest.mark.parametrize("model", [BASE, "r8_all"])
def test_required_and_named_tool_choice(server: Server, model: str) -> None:
    client = server.client()
    required = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                              max_tokens=200, temperature=0, parallel_tool_calls=False)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    check_calls(choice.message.tool_calls, set(SCHEMA_OF))
    for call in choice.message.tool_calls:  # compact JSON: outside strings, no whitespace but one space
        outside = re.sub(r'"(?:[^"\\]|\\.)*"', '""', call.function.arguments)
        assert not re.search(r"\s\s|[\n\t\r]", outside), call.function.arguments
    named = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, max_tokens=200, temperature=0.8, seed=3, n=2,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False)
    for choice in named.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        check_calls(choice.message.tool_calls, {"get_time"})


def test_a_forced_call_wins_over_a_response_format(server: Server) -> None:
    """As on OpenAI (and as agent loops send it): with ``tool_choice`` forcing a call, this turn's output is the
    call, and ``response_format`` waits for the turn that writes a message; a bad format is still a 400."""
    client = server.client()
    out = client.chat.completions.create(model="r8_all", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                         response_format={"type": "json_object"}, max_tokens=200, temperature=0,
                                         parallel_tool_calls=False)
    assert out.choices[0].finish_reason == "tool_calls"
    check_calls(out.choices[0].message.tool_calls, set(SCHEMA_OF))
    bad = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": BASE, "messages": MESSAGES, "max_tokens": 4, "tools": TOOLS, "tool_choice": "required",
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format", bad.text


def test_streamed_tool_calls_equal_the_whole_response(server: Server) -> None:
    """Streamed as vLLM sends them: per call a first delta with id, type and name, then argument fragments
    that add up to the whole response's arguments."""
    client = server.client()
    kw = dict(model="r8_all", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0,
              parallel_tool_calls=False)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    firsts = [d for d in deltas if d.id is not None]
    assert [(d.index, d.type, d.function.name, d.function.arguments) for d in firsts] == [
        (i, "function", c.function.name, "") for i, c in enumerate(whole)]
    assert all(d.id.startswith("call_") for d in firsts)
    fragments = [d for d in deltas if d.id is None]
    assert len(fragments) > 1 and all(d.function.name is None for d in fragments)  # arguments as generated
    assert ["".join(d.function.arguments for d in fragments if d.index == i) for i in range(len(whole))] == [
        c.function.arguments for c in whole]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_forced_call_cut_by_max_tokens_is_the_partial_call(server: Server) -> None:
    client = server.client()
    for stream in (False, True):
        kw = dict(model=BASE, messages=MESSAGES, tools=TOOLS, max_tokens=6, temperature=0, stream=stream,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
        if not stream:
            choice = client.chat.completions.create(**kw).choices[0]
            [call] = choice.message.tool_calls
            assert (choice.finish_reason, choice.message.content, call.function.name) == ("length", None, "get_weather")
            partial = call.function.arguments
            assert partial.startswith("{") and partial
            continue
        chunks = [c for c in client.chat.completions.create(**kw) if c.choices]
        deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
        assert deltas[0].function.name == "get_weather" and chunks[-1].choices[0].finish_reason == "length"
        assert "".join(d.function.arguments or "" for d in deltas) == partial
        assert not any(c.choices[0].delta.content for c in chunks)


def test_auto_parses_hermes_tool_calls(server: Server) -> None:
    """The model is made to write a Hermes block (a regex constraint); auto mode must find the call."""
    block = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
    regex = "".join("\\" + ch if ch in "{}[]().*+?|\\^$" else ch for ch in "Let me check. " + block)
    r = server.client().chat.completions.create(model=BASE, messages=MESSAGES, tools=TOOLS, max_tokens=120,
                                                temperature=0, extra_body={"structured_outputs": {"regex": regex}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris",
                                                                                          "unit": "C"}
    free = server.client().chat.completions.create(model=BASE, messages=MESSAGES, tools=TOOLS, max_tokens=8,
                                                   temperature=0)
    assert free.choices[0].message.tool_calls is None and free.choices[0].finish_reason == "length"


def test_streamed_auto_tool_calls_come_as_fragments(server: Server) -> None:
    """Issue 36 item 7: an ``auto`` call streamed as vLLM streams it: a first delta with ``id``, ``type`` and
    ``name``, then ``arguments`` fragments adding up to the call; the text before it as content."""
    block = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
    regex = "".join("\\" + ch if ch in "{}[]().*+?|\\^$" else ch for ch in "Let me check. " + block)
    chunks = list(server.client().chat.completions.create(
        model=BASE, messages=MESSAGES, tools=TOOLS, max_tokens=120, temperature=0, stream=True,
        extra_body={"structured_outputs": {"regex": regex}}))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].type == "function" and deltas[0].function.name == "get_weather"
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    assert len(deltas) > 2  # fragments as they are generated, not one delta at the end
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert json.loads(arguments) == {"city": "Paris", "unit": "C"}
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content.strip() == "Let me check."
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def parse_hermes(text: str) -> tuple:
    return PARSERS["hermes"].scan(text).parsed(text)


def test_hermes_parser() -> None:
    two = ('Sure. <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
           '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>')
    content, calls = parse_hermes(two)
    assert content == "Sure." and [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": 1}), ("b", {})]
    assert parse_hermes("no calls here") == ("no calls here", [])
    assert parse_hermes("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])


HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>\n"
    "{% endif %}{%- for m in messages %}{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{% for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% elif m.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n{% else %}<|im_start|>"
    "{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{%- endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_tool_messages_round_trip_through_the_chat_template(server: Server, tiny_llama: Path) -> None:
    first = server.client().chat.completions.create(model=BASE, messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                                    tool_choice="required", temperature=0).choices[0].message
    call = first.tool_calls[0]
    conversation = [*MESSAGES, first.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    again = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": BASE, "messages": conversation, "tools": TOOLS, "max_tokens": 4})
    assert again.status_code == 200, again.text
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    tokenizer.chat_template = HERMES_TEMPLATE
    body = ChatCompletionRequest.model_validate({"model": BASE, "messages": conversation, "tools": TOOLS})
    text = tokenizer.decode(body.prompt_ids(tokenizer))
    rendered = json.loads(text.split("<tool_call>\n")[1].split("\n</tool_call>")[0])
    assert rendered == {"name": call.function.name, "arguments": json.loads(call.function.arguments)}  # an object
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in text and '"name": "get_time"' in text


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_bad_tool_fields_are_400(server: Server, fields: dict, param: str) -> None:
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                   json={"model": BASE, "messages": MESSAGES, "max_tokens": 4, **fields})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_template_without_tools_gets_the_default_tool_prompt(server: Server, tiny_llama: Path) -> None:
    """The tiny model's (SmolLM2's) template never reads ``tools``: they go into the system prompt, after
    the default tool prompt or the request's ``tool_prompt``; the prompt equals HF's rendering of that."""
    from loraplex.server.openai.tools import DEFAULT_TOOL_PROMPT

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    assert "tools" not in tokenizer.chat_template
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in TOOLS)

    def hf_tokens(system: str) -> int:
        rendered = tokenizer.apply_chat_template([{"role": "system", "content": system}, *MESSAGES],
                                                 add_generation_prompt=True, return_dict=True)
        return len(rendered["input_ids"])

    client = server.client()
    kw = dict(model=BASE, messages=MESSAGES, max_tokens=1, tool_choice="none")
    with_tools = client.chat.completions.create(**kw, tools=TOOLS).usage.prompt_tokens
    assert with_tools == hf_tokens(f"{DEFAULT_TOOL_PROMPT}\n{listed}")
    custom = client.chat.completions.create(**kw, tools=TOOLS, extra_body={"tool_prompt": "Tools:"})
    assert custom.usage.prompt_tokens == hf_tokens(f"Tools:\n{listed}") < with_tools
