"""OpenAI-compatible request bodies (pydantic) and the response/chunk bodies the server sends.

Request models only check types; ranges (temperature in [0, 2], ...) are checked once, by
``SamplingParams.validate``, so the offline API and the server reject the same values with the
same messages. Unknown fields are ignored, as OpenAI clients send many optional ones.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from loraplex.engine.request import RequestOutput, SamplingParams
from loraplex.errors import RequestError


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: int | None = None  # None: up to the model's context
    temperature: float | None = None  # None: 1.0, as OpenAI
    top_p: float | None = None
    top_k: int | None = None  # 0 or -1 = off
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # what torch.Generator.manual_seed takes
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    ignore_eos: bool = False  # an extension (as in vLLM): generate max_tokens even past EOS

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """Validated ``SamplingParams``; raises ``RequestError`` naming the offending field."""
        if self.n not in (None, 1):
            raise RequestError(f"only n=1 is supported, got n={self.n}", "n")
        params = SamplingParams(
            max_tokens=default_max_tokens if self.max_tokens is None else self.max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k in (None, -1) else self.top_k,
            seed=self.seed,
            stop=() if self.stop is None else self.stop,
            ignore_eos=self.ignore_eos,
        )
        params.validate()
        return params

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: ``prompt`` is a string or a list of token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request (a list holding one prompt is accepted too)."""
        p = self.prompt
        if isinstance(p, str) or (p and all(isinstance(t, int) for t in p)):
            return p
        if len(p) == 1:
            return p[0]
        raise RequestError(
            f"exactly one prompt per request is supported, got a list of {len(p)} prompts", "prompt"
        )


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The message's text; content parts other than text are refused."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"unsupported content part {part.get('type')!r}: only text", "messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)

    def prompt_ids(self, tokenizer: Any) -> list[int]:
        """Render the messages with the tokenizer's chat template (``add_generation_prompt=True``) and
        tokenize the text as is: the template writes every special token itself. A model without a
        template, or messages its template refuses (e.g. roles that do not alternate), are a 400 on
        ``messages``."""
        if not getattr(tokenizer, "chat_template", None):
            raise RequestError("this model has no chat template; use /v1/completions", "messages")
        conversation = [{"role": m.role, "content": m.text()} for m in self.messages]
        try:
            text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # jinja2 TemplateError and the template's own raise_exception()
            raise RequestError(f"the chat template refused these messages: {exc}", "messages") from exc
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class LoadAdapterRequest(_Body):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadAdapterRequest(_Body):
    lora_name: str = Field(min_length=1)


def error_body(message: str, error_type: str, param: str | None = None, code: int | str | None = None) -> dict:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(out: RequestOutput) -> dict[str, int]:
    p, c = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


class ResponseBuilder:
    """Builds the JSON bodies of one completion or chat completion, whole or in chunks."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def full(self, out: RequestOutput) -> dict:
        """The non-streamed response for a finished request."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
                      "logprobs": None, "finish_reason": out.finish_reason}
            body = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason}
            body = self._envelope("text_completion", [choice])
        body["usage"] = usage(out)
        return body

    def chunk(self, text: str, finish_reason: str | None = None, first: bool = False) -> dict:
        """One streamed chunk carrying ``text`` (and the finish reason on the last one)."""
        if self.chat:
            delta: dict[str, str] = {"role": "assistant", "content": text} if first else {"content": text}
            if finish_reason is not None and not text:
                delta = {}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, out: RequestOutput) -> dict:
        """The extra last chunk sent when ``stream_options.include_usage`` is set."""
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage(out)
        return body
