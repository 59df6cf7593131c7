"""Schemathesis hooks for ``test_openapi.py``: positive cases skip bodies that break a cross-field rule JSON
Schema cannot state (each documented in the field's description and in docs/server.md, each answered with a
400 naming the field, tested in ``test_server_errors.py``): the prompt plus ``max_tokens`` must fit the
context, the choices of one prompt may generate at most 16 contexts together (``n x max_tokens``, the
request bound's default), ``top_logprobs`` needs ``logprobs: true``, ``reasoning_effort`` needs a chat
template that reads it, ``lora_scale`` (other than 1) needs ``model`` to be an adapter and ``adapter_mix``
loaded adapters' names with ``model`` the base model's, and a structured-output or tool constraint must be one,
valid (a schema, regex or grammar that compiles; a tool_choice naming a tool) and not combined with
``ignore_eos`` / ``min_tokens`` (checked with the server's own request models). Prompts are counted
exactly, with the served model's tokenizer and the server's own chat rendering (``LORAPLEX_TEST_MODEL``,
``LORAPLEX_TEST_MAX_MODEL_LEN``); ``/v1/embeddings``' and ``/classify``'s inputs must each fit the context alike,
and so must every text and every pair (``tokenizer(text_1, text_2)``, a cross-encoder's input) of ``/score`` and
``/rerank``; ``/score``'s two lists, when neither is one text, must be of one length."""

from __future__ import annotations

import functools
import json
import os
from collections import Counter
from typing import Any

import schemathesis
from transformers import AutoTokenizer

from loraplex.errors import RequestError
from loraplex.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from loraplex.server.openai.responses_api.request import ResponsesRequest

MAX_MODEL_LEN = int(os.environ.get("LORAPLEX_TEST_MAX_MODEL_LEN", "64"))
REQUEST_OUTPUT_TOKENS = 16 * MAX_MODEL_LEN  # EngineConfig.max_request_output_tokens' default


@functools.cache
def _tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(os.environ["LORAPLEX_TEST_MODEL"])


def _prompt_tokens(body: dict) -> int | None:
    """The prompt's tokens as the server counts them (the longest prompt of a list); None when the prompt
    is invalid anyway (the server answers 400 whatever the limit)."""
    if "messages" in body:
        try:  # with the tools in the system prompt when the template does not render them
            return len(ChatCompletionRequest.model_validate(body).prompt_ids(_tokenizer()))
        except (ValueError, TypeError, RequestError):  # pydantic's ValidationError is a ValueError
            return None
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not isinstance(prompt, list):
        return None
    counts = [len(p) if isinstance(p, list) else len(_tokenizer().encode(p, add_special_tokens=False))
              for p in prompt if isinstance(p, (list, str))]
    return max(counts, default=None)


CONSTRAINT_FIELDS = {"response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar", "tools", "tool_choice", "ignore_eos", "min_tokens"}


def _bad_constraint(body: dict) -> bool:
    """Whether the server refuses ``body`` for a constraint rule JSON Schema cannot state."""
    model = ChatCompletionRequest if "messages" in body else CompletionRequest
    try:
        model.model_validate(body).sampling_params(1)
    except RequestError as exc:
        return exc.param in CONSTRAINT_FIELDS
    except (ValueError, TypeError):  # schema-invalid anyway (pydantic's ValidationError is a ValueError)
        return False
    return False


def _unread_effort(body: dict) -> bool:
    """A ``reasoning_effort`` the model's chat template does not read: 400 (as OpenAI, for models that do not
    reason)."""
    return body.get("reasoning_effort") not in (None, "none") and "reasoning_effort" not in (
        _tokenizer().chat_template or "")


def _as_chat(body: dict) -> dict | None:
    """A ``/v1/responses`` body as the chat body it runs as; None when it breaks a cross-field rule of its own
    (an input message without a role, a json_schema format without a schema, ...: 400s naming the field)."""
    try:
        return ResponsesRequest.model_validate(body).chat_body([])
    except (ValueError, TypeError, RequestError):
        return None


@schemathesis.hook
def filter_body(ctx: schemathesis.HookContext, body: object) -> bool:
    return _acceptable(ctx.operation.path if ctx.operation is not None else "", body)


@schemathesis.hook
def filter_case(ctx: schemathesis.HookContext, case: Any) -> bool:
    """The coverage phase applies case filters only: its positive cases skip what ``filter_body`` skips."""
    operation = ctx.operation.path if ctx.operation is not None else ""
    meta = getattr(case, "meta", None)
    negative = meta is not None and getattr(meta.generation.mode, "value", "") == "negative"
    if operation == "/v1/adapters/{name}" and case.method.upper() == "PUT":
        return negative or case.body == _adapter_upload()  # see map_body
    return negative or _acceptable(operation, case.body)


def _acceptable(operation: str, body: object) -> bool:
    """Whether a generation ``body`` keeps every cross-field rule (module docstring); other bodies always."""
    if operation in ("/v1/embeddings", "/classify") and isinstance(body, dict):
        return _embedding_inputs_fit(body)
    if operation in ("/score", "/rerank") and isinstance(body, dict):
        return _pairs_fit(body)
    if operation == "/v1/responses" and isinstance(body, dict):
        chat = _as_chat(body)
        if chat is None:
            return False
        body = chat
    elif not operation.endswith("completions") or not isinstance(body, dict):
        return True  # only generation has cross-field rules
    limit = body.get("max_completion_tokens")
    limit = body.get("max_tokens") if limit is None else limit
    given = limit is not None
    limit = (16 if "prompt" in body else 1) if limit is None else limit
    limit = int(limit) if isinstance(limit, float) and limit.is_integer() else limit
    if not isinstance(limit, int) or isinstance(limit, bool):
        return True  # a type error: schema-invalid anyway
    if body.get("top_logprobs") and body.get("logprobs") is not True:
        return False
    if _unread_effort(body) or _bad_constraint(body):
        return False
    if body.get("lora_scale") not in (None, 1) or body.get("adapter_mix") is not None:
        return False  # a per-request LoRA plan needs loaded adapters' names (the served one has none)
    tokens = _prompt_tokens(body)
    if tokens is None:
        return True
    # without max_tokens a chat choice may run to the end of the context (the server's default)
    per_choice = limit if given or "prompt" in body else MAX_MODEL_LEN - tokens
    return tokens + limit <= MAX_MODEL_LEN and _choices(body) * per_choice <= REQUEST_OUTPUT_TOKENS


def _pairs_fit(body: dict) -> bool:
    """Whether every text and every pair of a ``/score`` or ``/rerank`` body fits the context (pairs as a
    one-text side pairs with each of the other's); a body that is schema-invalid anyway passes."""
    if "query" in body:
        first, second = [body.get("query")], body.get("documents")
    else:
        first, second = body.get("text_1"), body.get("text_2")
    first, second = ([x] if isinstance(x, str) else x for x in (first, second))
    if not (isinstance(first, list) and isinstance(second, list) and all(
            isinstance(t, str) for t in [*first, *second])):
        return True
    if len(first) > 1 and len(second) > 1 and len(first) != len(second):
        return False  # two lists pair up one to one
    tokenizer = _tokenizer()
    texts = max((len(tokenizer.encode(t)) for t in [*first, *second]), default=0)
    pairs = max((len(tokenizer(a, b)["input_ids"]) for a in first for b in second), default=0)
    return max(texts, pairs) <= MAX_MODEL_LEN


def _embedding_inputs_fit(body: dict) -> bool:
    """Whether every ``/v1/embeddings`` input's tokens (texts with the tokenizer's special tokens, as the server
    encodes them) fit the context; a body that is schema-invalid anyway passes."""
    given = body.get("input")
    if isinstance(given, str) or (isinstance(given, list) and given and isinstance(given[0], int)):
        given = [given]
    if not isinstance(given, list):
        return True
    counts = [len(p) if isinstance(p, list) else len(_tokenizer().encode(p)) for p in given
              if isinstance(p, (list, str))]
    return max(counts, default=0) <= MAX_MODEL_LEN


def _choices(body: dict) -> int:
    """Choices of one prompt: ``n`` times the most repeats of one prompt in a prompt list (repeats count as
    choices of it: docs/server.md, Request bounds)."""
    n = body.get("n")
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or not prompt or isinstance(prompt[0], int):
        return n
    return n * max(Counter(json.dumps(p) for p in prompt).values())


@functools.cache
def _adapter_upload() -> bytes:
    """A valid ``PUT /v1/adapters/{name}`` body for the served model: a rank-1 LoRA on layer 0's q_proj."""
    import safetensors.torch
    import torch

    from loraplex.config import ModelConfig

    q_proj = ModelConfig.from_hf(os.environ["LORAPLEX_TEST_MODEL"]).projections()["q_proj"]
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    tensors = {f"{prefix}.lora_A.weight": torch.full((1, q_proj.in_features), 0.01),
               f"{prefix}.lora_B.weight": torch.full((q_proj.out_features, 1), 0.01)}
    config = {"peft_type": "LORA", "r": 1, "lora_alpha": 1, "target_modules": ["q_proj"]}
    return safetensors.torch.save(tensors, metadata={"adapter_config": json.dumps(config)})


@schemathesis.hook
def map_body(ctx: schemathesis.HookContext, body: object) -> object:
    """Any string is schema-valid for an adapter upload, but only a safetensors adapter is one (its hostile
    bodies are tested in ``test_live_adapters.py``): uploads carry a valid adapter."""
    operation = ctx.operation
    if operation is not None and operation.method.upper() == "PUT" and operation.path == "/v1/adapters/{name}":
        return _adapter_upload()
    return body
