"""Chat messages -> prompt token ids, through the tokenizer's own chat template."""

from __future__ import annotations

from typing import Any

from loraplex.errors import RequestError
from loraplex.server.protocol import ChatMessage


def chat_prompt_ids(tokenizer: Any, messages: list[ChatMessage]) -> list[int]:
    """Render ``messages`` with ``add_generation_prompt=True`` and tokenize the text as is.

    The template writes every special token itself, so tokenizing adds none. A model without a
    template, or messages its template refuses (e.g. roles that do not alternate), are a 400 on
    ``messages``.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError("this model has no chat template; use /v1/completions", "messages")
    conversation = [{"role": m.role, "content": m.text()} for m in messages]
    try:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # jinja2 TemplateError and the template's own raise_exception()
        raise RequestError(f"the chat template refused these messages: {exc}", "messages") from exc
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
