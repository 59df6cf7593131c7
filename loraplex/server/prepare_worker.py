"""What a request-preparation worker does (``RequestPreparer`` runs it in threads or processes):
parse and validate a generation body, check its limits, render the chat template, check each prompt's
context length, tokenize; and ``/tokenize`` / ``/detokenize``'s encoding and decoding.

Each request is tokenized, and its chat template rendered, with the tokenizer of its adapter's live
version (its own if its folder ships one, else the base model's), as ``Engine.add_request`` would:
``tokenizer_for(table, adapter)`` is the engine client's lookup in a thread, a ``TokenizerCache`` over
the job's ``TokenizerTable`` in a worker process (``engine/tokenizers.py``). A prompt whose character
count alone proves it cannot fit the context (``PromptBound``, per tokenizer) is refused before it is
tokenized. Token ids are checked against the version's vocabulary by the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from loraplex.engine.request import check_context_length
from loraplex.engine.tokenizers import TokenizerTable
from loraplex.errors import RequestError
from loraplex.server.limits import check_stop
from loraplex.server.prompt_bound import PromptBound
from loraplex.server.protocol import ChatCompletionRequest, CompletionRequest, TokenizeChatRequest, render_chat


@dataclass(frozen=True)
class PrepareConfig:
    tokenizer_path: str | None  # the model folder; None: the model has no tokenizer (token ids only)
    max_model_len: int
    base_names: frozenset[str] = frozenset()  # the base model's names in the API; any other names an adapter


@dataclass(frozen=True)
class Prepared:
    body: Any  # the parsed CompletionRequest / ChatCompletionRequest
    prompt_token_ids: list[list[int]]  # per prompt (chat: one)
    prompt_texts: list[str]  # per prompt, its text, when a completion asks for ``echo`` (else empty)


class InvalidBody(Exception):
    """A body that does not parse or validate; ``errors`` as FastAPI's ``RequestValidationError`` has them."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__(errors)
        self.errors = errors


TokenizerLookup = Callable[[TokenizerTable, "str | None"], Any]  # (table, adapter) -> its version's tokenizer


class PrepareWorker:
    _MAX_BOUNDS = 64  # tokenizers whose PromptBound is kept

    def __init__(self, config: PrepareConfig, tokenizer_for: TokenizerLookup) -> None:
        self.config = config
        self.tokenizer_for = tokenizer_for
        self._bounds: dict[int, tuple[Any, PromptBound | None]] = {}  # id(tokenizer) -> (it, its bound)

    def warm_up(self, table: TokenizerTable) -> None:
        """Compute the base tokenizer's ``PromptBound`` (it reads the whole vocabulary) before requests."""
        tokenizer = self.tokenizer_for(table, None)
        if tokenizer is not None:
            self.bound(tokenizer)

    def completion(self, raw: bytes, default_max_tokens: int, table: TokenizerTable) -> Prepared:
        body = _parse(CompletionRequest, raw)
        tokenizer = self.tokenizer_for(table, self._adapter(body.model))
        reserve = _reserve(body.max_tokens, default_max_tokens)
        prompts = body.prompts()
        ids = [self.token_ids(tokenizer, prompt, reserve, "prompt") for prompt in prompts]
        texts = [self._text(tokenizer, prompt, body.model) for prompt in prompts] if body.echo else []
        return Prepared(body, ids, texts)

    def chat(self, raw: bytes, table: TokenizerTable) -> Prepared:
        body = _parse(ChatCompletionRequest, raw)
        tokenizer = self.tokenizer_for(table, self._adapter(body.model))  # its chat template too
        if tokenizer is None:
            raise RequestError("this model has no tokenizer; use /v1/completions with token ids", "messages")
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return Prepared(body, [self.token_ids(tokenizer, body.prompt_text(tokenizer), _reserve(limit, 1),
                                              "messages")], [])

    def tokenize(self, body: Any, adapter: str | None, table: TokenizerTable) -> tuple[list[int], list[str] | None]:
        """``/tokenize``: (token ids, their strings when asked) of a prompt or of rendered chat messages."""
        tokenizer = self.tokenizer_for(table, adapter)
        if isinstance(body, TokenizeChatRequest):
            ids = render_chat(tokenizer, [m.template_message() for m in body.messages])
        else:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return ids, tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None

    def detokenize(self, tokens: list[int], adapter: str | None, table: TokenizerTable) -> str:
        return self.tokenizer_for(table, adapter).decode(tokens)

    def token_ids(self, tokenizer: Any, prompt: str | list[int], reserve: int, param: str) -> list[int]:
        """The prompt's token ids; ``RequestError`` on ``param`` if they cannot fit the context with
        ``reserve`` new tokens."""
        limit = self.config.max_model_len
        if isinstance(prompt, str):
            if tokenizer is None:
                raise RequestError("this model has no tokenizer: pass token ids", param)
            bound = self.bound(tokenizer)
            if bound is not None and bound.min_tokens(len(prompt)) + reserve > limit:
                _check_context(bound.min_tokens(len(prompt)), reserve, limit, param,
                               f"{len(prompt)} characters: at least ")
            ids = tokenizer.encode(prompt, add_special_tokens=False)
        else:
            ids = list(prompt)
        _check_context(len(ids), reserve, limit, param)
        return ids

    def bound(self, tokenizer: Any) -> PromptBound | None:
        """``tokenizer``'s ``PromptBound``, computed once per tokenizer."""
        entry = self._bounds.get(id(tokenizer))
        if entry is None or entry[0] is not tokenizer:
            if len(self._bounds) >= self._MAX_BOUNDS:
                self._bounds.clear()
            entry = self._bounds[id(tokenizer)] = (tokenizer, PromptBound.for_tokenizer(tokenizer))
        return entry[1]

    def _adapter(self, model: str) -> str | None:
        return None if model in self.config.base_names else model

    @staticmethod
    def _text(tokenizer: Any, prompt: str | list[int], model: str) -> str:
        """A prompt's text, for ``echo``."""
        if isinstance(prompt, str):
            return prompt
        if tokenizer is None:
            raise RequestError(f"model {model!r} has no tokenizer", "model")
        return tokenizer.decode(prompt)


def _reserve(max_tokens: Any, default: int) -> int:
    """New tokens the prompt must leave room for (an invalid ``max_tokens`` is reported later)."""
    return max_tokens if isinstance(max_tokens, int) and max_tokens >= 0 else default


def _check_context(num_tokens: int, reserve: int, limit: int, param: str, note: str = "") -> None:
    try:
        check_context_length(num_tokens, reserve, limit, note)
    except RequestError as exc:
        exc.param = param if exc.param == "prompt" else exc.param
        raise


def _parse(model: type[BaseModel], raw: bytes) -> Any:
    try:
        body = model.model_validate_json(raw)
    except ValidationError as exc:
        raise InvalidBody([_portable_error(e) for e in exc.errors(include_url=False, include_input=False)]) from None
    check_stop(body.stop)
    return body


def _portable_error(error: Any) -> dict[str, Any]:
    """A pydantic error as plain data (it crosses a process boundary), located in the body as FastAPI does."""
    out = {"type": error["type"], "loc": ("body", *error["loc"]), "msg": error["msg"]}
    if "ctx" in error:
        out["ctx"] = {key: str(value) for key, value in error["ctx"].items()}
    return out
