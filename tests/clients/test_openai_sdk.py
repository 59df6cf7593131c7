"""The ``openai`` package against ``loraplex serve``: chat completions and ``responses.create`` answer as HF +
PEFT do (base and adapter), ``responses.parse`` returns the pydantic object, ``previous_response_id`` chains
(``tests/test_responses.py`` has the streamed events and the store in depth)."""

from __future__ import annotations

from typing import Literal

import openai
import pytest
from pydantic import BaseModel

from tests.clients.conftest import ADAPTER, Served
from tests.clients.hf_chat import hf_chat_text

MESSAGES = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a colour."}]


class Colour(BaseModel):
    name: Literal["red", "green", "blue"]


def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.v1, api_key="unused", max_retries=0, timeout=60)


@pytest.mark.parametrize("adapter", [False, True])
def test_chat_and_responses_equal_hf(served: Served, adapter: bool) -> None:
    model = ADAPTER if adapter else served.base
    expected = hf_chat_text(served.model, served.adapter if adapter else None, MESSAGES, 8)
    chat = client(served).chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == expected
    response = client(served).responses.create(model=model, instructions="Be terse.", input="Name a colour.",
                                               max_output_tokens=8, temperature=0)
    assert response.output_text == expected


def test_responses_parse_and_previous_response_id(served: Served) -> None:
    parsed = client(served).responses.parse(model=ADAPTER, input="A colour?", text_format=Colour,
                                            max_output_tokens=24, temperature=0)
    assert isinstance(parsed.output_parsed, Colour)
    follow = client(served).responses.create(model=ADAPTER, previous_response_id=parsed.id, input="Another?",
                                             max_output_tokens=4, temperature=0)
    first = parsed.usage.input_tokens + parsed.usage.output_tokens
    assert follow.usage.input_tokens > first  # the whole conversation is the follow-up's prompt
