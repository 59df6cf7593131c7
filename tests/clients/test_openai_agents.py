"""The OpenAI Agents SDK against ``loraplex serve``: a tool loop that finishes (the tool is called with
arguments its schema allows, its result is fed back, the run ends with a final answer), on
``OpenAIChatCompletionsModel`` with a text answer, and with a structured ``output_type`` on both that and the
SDK's default ``OpenAIResponsesModel``. On the Responses path the final answer must end before
``max_output_tokens`` (the SDK takes ``incomplete`` for a failure), and the tiny random model's free text never
does: only a structured answer ends there."""

from __future__ import annotations

from typing import Literal

import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from agents.items import ToolCallOutputItem
from openai import AsyncOpenAI
from pydantic import BaseModel

from tests.clients.conftest import ADAPTER, Served


class Answer(BaseModel):
    sky: Literal["sunny", "rainy"]


def run_loop(served: Served, model_class: type, output_type: type | None) -> object:
    set_tracing_disabled(True)  # no export to OpenAI's servers
    calls: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather now in a city."""
        calls.append(city)
        return "sunny, 21 C"

    client = AsyncOpenAI(base_url=served.v1, api_key="unused", max_retries=0, timeout=60)
    agent = Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather],
                  output_type=output_type, model=model_class(model=ADAPTER, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                               temperature=0, max_tokens=64))
    result = Runner.run_sync(agent, "Weather in Paris?", max_turns=4)
    assert calls and set(calls) <= {"Paris", "Rome"}
    outputs = [item.output for item in result.new_items if isinstance(item, ToolCallOutputItem)]
    assert outputs and outputs[0] == "sunny, 21 C"  # fed back to the model
    return result.final_output  # the SDK resets tool_choice after the call: the next turn answers


def test_chat_completions_tool_loop_finishes(served: Served) -> None:
    assert isinstance(run_loop(served, OpenAIChatCompletionsModel, None), str)


@pytest.mark.parametrize("model_class", [OpenAIResponsesModel, OpenAIChatCompletionsModel])
def test_tool_loop_with_a_structured_answer_finishes(served: Served, model_class: type) -> None:
    assert isinstance(run_loop(served, model_class, Answer), Answer)
