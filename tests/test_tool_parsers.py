"""Each tool-call format on its own examples (vLLM's parser tests' model outputs and expected calls), whole and
streamed (the deltas, in steps of 1, 3 and 9 characters, add up to the whole response): one call, several,
calls after text, no call; format detection from chat templates; forced calls cut short."""

from __future__ import annotations

import json

import pytest

from loraplex.server.openai.tool_parsers import (
    PARSERS,
    REQUIRED,
    NamedParser,
    ToolCallStream,
    ToolParser,
    detect_parser,
    final_message,
)

WEATHER_SF = ("get_weather", {"city": "San Francisco", "metric": "celsius"})
MORE_TYPES = ("register_user", {"name": "John Doe", "age": 37, "address": {"city": "San Francisco", "state": "CA"},
                                "role": None, "passed_test": True, "aliases": ["John", "Johnny"]})


def _json_call(name: str, args: dict, key: str = "arguments") -> str:
    return json.dumps({"name": name, key: args}, ensure_ascii=False)


# (parser, model output, expected content, expected [(name, arguments)]): vLLM's tests' examples
CASES = [
    ("hermes", f"<tool_call>{_json_call(*WEATHER_SF)}</tool_call>", None, [WEATHER_SF]),
    ("hermes", f"<tool_call>{_json_call(*MORE_TYPES)}</tool_call>", None, [MORE_TYPES]),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>', None, [("get_weather", {})]),
    ("hermes", f"I'll check.\n<tool_call>\n{_json_call(*WEATHER_SF)}\n</tool_call>\n<tool_call>\n"
               f"{_json_call(*MORE_TYPES)}\n</tool_call>", "I'll check.", [WEATHER_SF, MORE_TYPES]),
    ("hermes", '<tool_call>{"name": "say", "arguments": {"text": "a \\"}\\" in {braces}"}}</tool_call>', None,
     [("say", {"text": 'a "}" in {braces}'})]),
    ("llama3_json", '<|python_tag|>{"name": "searchTool", "parameters": {"query": "test1"}}; '
                    '{"name": "getOpenIncidentsTool", "parameters": {}}', None,
     [("searchTool", {"query": "test1"}), ("getOpenIncidentsTool", {})]),
    ("llama3_json", _json_call(*WEATHER_SF, key="parameters"), None, [WEATHER_SF]),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 3.5, "b": 4}}]', None, [("add", {"a": 3.5, "b": 4})]),
    ("mistral", f'Sure [TOOL_CALLS][{_json_call(*WEATHER_SF)}, {_json_call(*MORE_TYPES)}]', "Sure",
     [WEATHER_SF, MORE_TYPES]),
    ("mistral", f'[{_json_call(*WEATHER_SF)}]', None, [WEATHER_SF]),  # [TOOL_CALLS] skipped as a special token
    ("granite", '<|tool_call|>[{"name": "get_current_weather", "arguments": {"city": "Dallas", "state": "TX", '
                '"unit": "fahrenheit"}}]', None,
     [("get_current_weather", {"city": "Dallas", "state": "TX", "unit": "fahrenheit"})]),
    ("granite", f'<tool_call>[{_json_call(*WEATHER_SF)}, {_json_call(*MORE_TYPES)}]', None, [WEATHER_SF, MORE_TYPES]),
    ("phi4_mini_json", f'functools[{_json_call(*WEATHER_SF)}]', None, [WEATHER_SF]),
    ("phi4_mini_json", f'Let me see. functools[{_json_call(*WEATHER_SF)}, {_json_call(*MORE_TYPES)}]',
     "Let me see.", [WEATHER_SF, MORE_TYPES]),
    ("pythonic", "[get_weather(city='San Francisco', metric='celsius')]", None, [WEATHER_SF]),
    ("pythonic", "[register_user(name='John Doe', age=37, address={'city': 'San Francisco', 'state': 'CA'}, "
                 "role=None, passed_test=True, aliases=['John', 'Johnny'])]", None, [MORE_TYPES]),
    ("pythonic", "[get_weather()]", None, [("get_weather", {})]),
    ("pythonic", "[do_something_cool(additional_data={})]", None, [("do_something_cool", {"additional_data": {}})]),
    ("pythonic", "[do_something_cool(steps=[])]", None, [("do_something_cool", {"steps": []})]),
    ("pythonic", r"""[get_weather(city='Martha\'s Vineyard', metric='\"cool units\"')]""", None,
     [("get_weather", {"city": "Martha's Vineyard", "metric": '"cool units"'})]),
    ("pythonic", "[get_weather(city='San Francisco', metric='celsius'), register_user(name='John Doe', age=37, "
                 "address={'city': 'San Francisco', 'state': 'CA'}, role=None, passed_test=True, "
                 "aliases=['John', 'Johnny'])]", None, [WEATHER_SF, MORE_TYPES]),
]
NO_CALLS = ["How can I help you today?", "The list [1, 2] has { braces } too.", "<tool_call>{not json}</tool_call>",
            "[1, 2] is a list", ""]


def streamed(parser: ToolParser, text: str, step: int, finish_reason: str = "stop") -> tuple[str, list, str | None]:
    """(content, [(id, name, arguments)], finish reason) from the deltas of ``text`` generated ``step``
    characters at a time; the first delta of each call carries its id, type and name, the rest only fragments."""
    stream, content, calls, reason = ToolCallStream(parser), "", [], None
    cuts = [*range(step, len(text), step), len(text)]
    for cut in cuts:
        delta, reason = stream.delta(text[:cut], cut == len(text), finish_reason if cut == len(text) else None)
        content += delta.get("content", "")
        for entry in delta.get("tool_calls", ()):
            if "id" in entry:
                assert entry["index"] == len(calls) and entry["type"] == "function"
                assert entry["function"]["arguments"] == ""
                calls.append([entry["id"], entry["function"]["name"], ""])
            else:
                assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}
                calls[entry["index"]][2] += entry["function"]["arguments"]
    return content, calls, reason


@pytest.mark.parametrize(("name", "text", "content", "expected"), CASES)
def test_parser_on_the_formats_examples(name: str, text: str, content: str | None, expected: list) -> None:
    parser = PARSERS[name]
    got_content, calls, reason = final_message(parser, text, "stop")
    assert reason == "tool_calls" and got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
    for step in (1, 3, 9):
        s_content, s_calls, s_reason = streamed(parser, text, step)
        assert s_reason == "tool_calls"
        assert [(n, a) for _, n, a in s_calls] == [(c.name, c.arguments) for c in calls]  # the same text
        assert s_content.strip() == (content or "")
        assert len({i for i, _, _ in s_calls}) == len(s_calls)


@pytest.mark.parametrize("name", sorted(PARSERS))
@pytest.mark.parametrize("text", NO_CALLS)
def test_text_without_calls_is_content(name: str, text: str) -> None:
    parser = PARSERS[name]
    assert final_message(parser, text, "stop") == (text, [], "stop")
    for step in (1, 4):
        assert streamed(parser, text, step) == (text, [], "stop")


def test_a_marker_being_generated_is_held_back() -> None:
    stream = ToolCallStream(PARSERS["hermes"])
    assert stream.delta("Hi <tool_", False, None)[0] == {"content": "Hi "}
    assert stream.delta("Hi <tool_call>", False, None)[0] == {}
    first, _ = stream.delta('Hi <tool_call>{"name": "f", "arguments": {"x"', False, None)
    assert first["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    assert first["tool_calls"][1]["function"] == {"arguments": '{"x"'}


def test_auto_call_cut_short_is_text() -> None:
    text = '<tool_call>{"name": "f", "arguments": {"x": 1'
    assert final_message(PARSERS["hermes"], text, "length") == (text, [], "length")


def test_forced_calls_cut_short_are_the_partial_call() -> None:
    content, calls, reason = final_message(REQUIRED, '[{"name":"get_weather","parameters":{"city":"Par', "length")
    assert (content, reason) == (None, "length")
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city":"Par')]
    content, calls, reason = final_message(NamedParser("get_time"), '{"zone":"U', "length")
    assert (content, reason, calls[0].name, calls[0].arguments) == (None, "length", "get_time", '{"zone":"U')
    whole = '[{"name":"a","parameters":{}},{"name":"b","parameters":{"k":[1,2]}}]'
    _, calls, reason = final_message(REQUIRED, whole, "stop")
    assert reason == "tool_calls" and [(c.name, c.arguments) for c in calls] == [("a", "{}"), ("b", '{"k":[1,2]}')]
    assert [(n, a) for _, n, a in streamed(REQUIRED, whole, 2)[1]] == [("a", "{}"), ("b", '{"k":[1,2]}')]


@pytest.mark.parametrize(("template", "name"), [
    ("{% for t in tools %}<tool_call>{{ t }}</tool_call>{% endfor %}", "hermes"),
    ("{{ '[TOOL_CALLS]' }}{{ tool_calls | tojson }}", "mistral"),
    ("<|start_of_role|>available_tools<|end_of_role|>{{ '<|tool_call|>' }}", "granite"),
    ("{{ '<|python_tag|>' }}{{ tool_call | tojson }}", "llama3_json"),
    ('Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.',
     "llama3_json"),
    ("In the form functools[{\"name\": ...}]", "phi4_mini_json"),
    ("[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]", "pythonic"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", "hermes"),
    (None, "hermes"),
])
def test_format_detected_from_the_chat_template(template: str | None, name: str) -> None:
    assert detect_parser(template) == name
