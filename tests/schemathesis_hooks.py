"""Schemathesis hooks for ``test_openapi.py``: positive cases skip bodies that break a cross-field rule JSON
Schema cannot state (each documented in the field's description and in docs/server.md, each answered with a
400 naming the field, tested in ``test_server_errors.py``): the prompt plus ``max_tokens`` must fit the
context, and ``top_logprobs`` needs ``logprobs: true``."""

from __future__ import annotations

import os

import schemathesis

MAX_MODEL_LEN = int(os.environ.get("LORAPLEX_TEST_MAX_MODEL_LEN", "64"))
CHAT_OVERHEAD = 40  # the template's default system prompt; tokens per message are counted below


def _bytes(text: object) -> int:
    return len(text.encode("utf-8", "surrogatepass")) if isinstance(text, str) else 0


def _prompt_tokens(body: dict) -> int:
    """An upper bound of the prompt's tokens: byte-level BPE never makes more tokens than bytes."""
    if "messages" in body:
        total = CHAT_OVERHEAD
        for m in body["messages"] if isinstance(body["messages"], list) else []:
            content = m.get("content") if isinstance(m, dict) else None
            parts = content if isinstance(content, list) else [{"text": content}]
            total += 8 + _bytes(m.get("role")) + _bytes(m.get("name")) + sum(
                _bytes(p.get("text")) for p in parts if isinstance(p, dict))
        return total
    prompt = body.get("prompt")
    prompts = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
    return max((len(p) if isinstance(p, list) else _bytes(p) for p in prompts), default=0)


@schemathesis.hook
def filter_body(ctx: schemathesis.HookContext, body: object) -> bool:
    if not isinstance(body, dict) or "model" not in body:
        return True
    limit = body.get("max_completion_tokens")
    limit = body.get("max_tokens") if limit is None else limit
    limit = (16 if "prompt" in body else 1) if limit is None else limit
    limit = int(limit) if isinstance(limit, float) and limit.is_integer() else limit
    if not isinstance(limit, int) or isinstance(limit, bool):
        return True  # a type error: schema-invalid anyway
    if body.get("top_logprobs") and body.get("logprobs") is not True:
        return False
    return _prompt_tokens(body) + limit <= MAX_MODEL_LEN
