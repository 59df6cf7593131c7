"""litellm's OpenAI-compatible provider against ``loraplex serve``: a plain completion equals HF + PEFT, a
stream adds up to it, and a forced tool call arrives parsed."""

from __future__ import annotations

import json
import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its bundled price map: no fetch from GitHub
import litellm  # noqa: E402  (reads the variable at import)

from tests.clients.conftest import ADAPTER, Served
from tests.clients.hf_chat import hf_chat_text

MESSAGES = [{"role": "user", "content": "Hello"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}}


def complete(served: Served, **kw: object) -> object:
    return litellm.completion(model=f"openai/{ADAPTER}", api_base=served.v1, api_key="unused", temperature=0,
                              num_retries=0, timeout=60, **kw)


def test_plain_and_streamed_equal_hf(served: Served) -> None:
    expected = hf_chat_text(served.model, served.adapter, MESSAGES, 8)
    assert complete(served, messages=MESSAGES, max_tokens=8).choices[0].message.content == expected
    chunks = complete(served, messages=MESSAGES, max_tokens=8, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected


def test_forced_tool_call(served: Served) -> None:
    forced = {"type": "function", "function": {"name": "get_weather"}}
    message = complete(served, messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=24,
                       tools=[TOOL], tool_choice=forced).choices[0].message
    [call] = message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
