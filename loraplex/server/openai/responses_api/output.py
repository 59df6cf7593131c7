"""A chat answer as a Response object (``response_body``), its conversation for a follow-up, and a chat
stream as the Responses stream's typed events (``ResponseEvents``: ``response.created``, ...,
``response.output_text.delta``, ``response.function_call_arguments.delta``, ..., ``response.completed``)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from loraplex.server.openai.responses_api.request import ResponsesRequest


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, item_id: str | None = None, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id or _id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": _id("fc"), "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


def reasoning_item(text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": _id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat message's output items: its reasoning, its text, its function calls."""
    items = [reasoning_item(message["reasoning_content"])] if message.get("reasoning_content") else []
    if message.get("content"):
        items.append(message_item(message["content"]))
    return items + [call_item(c) for c in message.get("tool_calls") or ()]


def response_body(request: ResponsesRequest, response_id: str, created: int, output: list[dict[str, Any]],
                  finish_reason: str | None, usage: dict[str, int] | None) -> dict[str, Any]:
    """The Response object (``status`` "incomplete" with ``max_output_tokens`` when the budget ended it)."""
    incomplete = finish_reason == "length"
    fmt = request.text.format.model_dump(by_alias=True, exclude_none=True) if request.text and request.text.format \
        else {"type": "text"}
    return {
        "id": response_id, "object": "response", "created_at": created, "model": request.model,
        "status": "incomplete" if incomplete else "completed", "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": request.instructions, "output": output, "metadata": request.metadata or {},
        "parallel_tool_calls": request.parallel_tool_calls is not False, "previous_response_id":
        request.previous_response_id, "store": request.store is not False, "temperature": request.temperature,
        "top_p": request.top_p, "max_output_tokens": request.max_output_tokens,
        "tool_choice": request.tool_choice or "auto",
        "tools": [t.model_dump(exclude_none=True) for t in request.tools or ()], "text": {"format": fmt},
        "truncation": "disabled", "reasoning": request.reasoning or {"effort": None, "summary": None},
        "user": request.user, "usage": None if usage is None else {
            "input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"], "input_tokens_details": {
                # the prefix cache fills as a side effect of every prefill, never as a billed write
                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"], "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}},
    }


def conversation_of(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The output items as chat messages (what a follow-up's history holds)."""
    text = "".join(p["text"] for i in output if i["type"] == "message" for p in i["content"])
    calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in output if i["type"] == "function_call"]
    return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]


def from_chat(request: ResponsesRequest, chat: dict[str, Any]) -> dict[str, Any]:
    """The Response object of a whole chat completion body."""
    choice = chat["choices"][0]
    return response_body(request, _id("resp"), int(time.time()), output_items(choice["message"]),
                         choice["finish_reason"], chat.get("usage"))


class ResponseEvents:
    """Turns one streamed chat choice's chunks into Responses events (each with its ``sequence_number``)."""

    def __init__(self, request: ResponsesRequest) -> None:
        self.request, self.id, self.created = request, _id("resp"), int(time.time())
        self.output: list[dict[str, Any]] = []
        self.text_at: int | None = None  # the output index of the message item being streamed
        self.reasoning_at: int | None = None  # the output index of the reasoning item being streamed
        self.calls: dict[int, int] = {}  # tool call index -> output index
        self.sequence = 0
        self.finish_reason: str | None = None
        self.final: dict[str, Any] | None = None

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def start(self) -> list[str]:
        shell = response_body(self.request, self.id, self.created, [], None, None)
        shell["status"] = "in_progress"
        return [self.event("response.created", response=shell), self.event("response.in_progress", response=shell)]

    def chunk(self, chunk: dict[str, Any]) -> list[str]:
        """The events of one chat chunk (its usage chunk ends the stream)."""
        events: list[str] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._reasoning(delta["reasoning_content"])
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        if chunk.get("usage") is not None:
            events += self._done(chunk["usage"])
        return events

    def _text(self, text: str) -> list[str]:
        events = []
        if self.text_at is None:
            self.text_at = len(self.output)
            item = message_item("", status="in_progress")
            self.output.append(item)
            events += [self.event("response.output_item.added", output_index=self.text_at,
                                   item={**item, "content": []}),
                       self.event("response.content_part.added", output_index=self.text_at, item_id=item["id"],
                                   content_index=0, part=item["content"][0])]
        item = self.output[self.text_at]
        item["content"][0]["text"] += text
        return events + [self.event("response.output_text.delta", output_index=self.text_at, item_id=item["id"],
                                     content_index=0, delta=text, logprobs=[])]

    def _reasoning(self, text: str) -> list[str]:
        events = []
        if self.reasoning_at is None:
            self.reasoning_at = len(self.output)
            item = reasoning_item("")
            item["status"] = "in_progress"
            self.output.append(item)
            events += [self.event("response.output_item.added", output_index=self.reasoning_at,
                                   item={**item, "content": []}),
                       self.event("response.content_part.added", output_index=self.reasoning_at,
                                   item_id=item["id"], content_index=0, part=item["content"][0])]
        item = self.output[self.reasoning_at]
        item["content"][0]["text"] += text
        return events + [self.event("response.reasoning_text.delta", output_index=self.reasoning_at,
                                     item_id=item["id"], content_index=0, delta=text)]

    def _call(self, call: dict[str, Any]) -> list[str]:
        if "id" in call:
            self.calls[call["index"]] = len(self.output)
            item = call_item({"id": call["id"], "function": {"name": call["function"]["name"], "arguments": ""}},
                             status="in_progress")
            self.output.append(item)
            return [self.event("response.output_item.added", output_index=self.calls[call["index"]], item=item)]
        at = self.calls[call["index"]]
        fragment = call["function"].get("arguments") or ""
        self.output[at]["arguments"] += fragment
        return [self.event("response.function_call_arguments.delta", output_index=at,
                            item_id=self.output[at]["id"], delta=fragment)] if fragment else []

    def _done(self, usage: dict[str, int]) -> list[str]:
        events = []
        for at, item in enumerate(self.output):
            item["status"] = "completed"
            if item["type"] == "reasoning":
                part = item["content"][0]
                events += [self.event("response.reasoning_text.done", output_index=at, item_id=item["id"],
                                       content_index=0, text=part["text"]),
                           self.event("response.content_part.done", output_index=at, item_id=item["id"],
                                       content_index=0, part=part)]
            elif item["type"] == "message":
                part = item["content"][0]
                events += [self.event("response.output_text.done", output_index=at, item_id=item["id"],
                                       content_index=0, text=part["text"], logprobs=[]),
                           self.event("response.content_part.done", output_index=at, item_id=item["id"],
                                       content_index=0, part=part)]
            else:
                events.append(self.event("response.function_call_arguments.done", output_index=at,
                                          item_id=item["id"], arguments=item["arguments"], name=item["name"]))
            events.append(self.event("response.output_item.done", output_index=at, item=item))
        self.final = response_body(self.request, self.id, self.created, self.output,
                                   self.finish_reason, usage)
        kind = "response.incomplete" if self.final["status"] == "incomplete" else "response.completed"
        return events + [self.event(kind, response=self.final)]
