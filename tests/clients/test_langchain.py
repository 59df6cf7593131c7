"""LangChain's ``ChatOpenAI`` (``langchain-openai``) against ``loraplex serve``: ``invoke`` equals HF + PEFT on
chat completions and with ``use_responses_api``, a stream adds up to the same text, ``bind_tools`` with a forced
tool returns a parsed call, and ``with_structured_output`` returns the schema's object by both methods."""

from __future__ import annotations

from typing import Literal

import pytest
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

from tests.clients.conftest import ADAPTER, Served
from tests.clients.hf_chat import hf_chat_text


class Weather(BaseModel):
    """The weather in a city."""

    city: Literal["Paris", "Rome"]


def chat(served: Served, max_tokens: int, **kw: object) -> ChatOpenAI:
    return ChatOpenAI(model=ADAPTER, base_url=served.v1, api_key="unused", temperature=0, max_tokens=max_tokens,
                      max_retries=0, timeout=60, **kw)


@pytest.mark.parametrize("responses_api", [False, True])
def test_invoke_and_stream_equal_hf(served: Served, responses_api: bool) -> None:
    expected = hf_chat_text(served.model, served.adapter, [{"role": "user", "content": "Hello"}], 8)
    llm = chat(served, 8, use_responses_api=responses_api)
    assert llm.invoke("Hello").text == expected
    assert "".join(chunk.text for chunk in llm.stream("Hello")) == expected


def test_bind_tools_forced_call(served: Served) -> None:
    llm = chat(served, 24).bind_tools([Weather], tool_choice="Weather")
    [call] = llm.invoke("Weather in Paris?").tool_calls
    assert call["name"] == "Weather" and call["args"]["city"] in ("Paris", "Rome")


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output(served: Served, method: str) -> None:
    answer = chat(served, 24).with_structured_output(Weather, method=method).invoke("Weather in Rome?")
    assert isinstance(answer, Weather)
