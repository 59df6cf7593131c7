"""What a request-preparation worker does (``RequestPreparer`` runs it in threads or processes), in two
phases around the one routing decision that the event loop makes between them:

1. ``parse_completion`` / ``parse_chat``: parse and validate a generation body and check its limits;
   nothing here depends on an adapter. A process worker hands back the body *light* (its prompt or
   messages emptied) and the second phase parses the raw bytes again, so the event loop never pickles a
   huge body (a 100k-message chat) on its way back into a worker; a thread worker shares the whole body.
2. ``completion`` / ``chat`` (with the ``Version`` the request was routed to): render the chat template
   and tokenize with that version's tokenizer (its own if its folder ships one, else the base model's),
   after refusing a prompt whose character count alone proves it cannot fit the context
   (``PromptBound``, per tokenizer); also ``/tokenize`` and ``/detokenize``.

A thread worker gets the version's tokenizer object with the job; a process worker gets the portable
``Version`` and reads the tokenizer once per version (``VersionTokenizers``). Token ids, the context
length and the sampling parameters are checked once, by the engine, when the request is submitted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from loraplex.client.directory import Version
from loraplex.client.tokenizers import VersionTokenizers
from loraplex.engine.request import check_context_length
from loraplex.errors import RequestError
from loraplex.server.limits import check_stop
from loraplex.server.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeChatRequest,
    render_chat,
)
from loraplex.server.openai.scoring import POOLING_BODIES, PoolingBody, input_field, pooled_inputs
from loraplex.server.prepare.prompt_bound import PromptBound


@dataclass(frozen=True)
class PrepareConfig:
    tokenizer_path: str | None  # the model folder; None: the model has no tokenizer (token ids only)
    max_model_len: int


@dataclass(frozen=True)
class Parsed:
    """A parsed generation body: ``body`` (light, in a process pool: see the module docstring) and the raw
    bytes the second phase parses again when it needs the prompt."""

    body: Any  # CompletionRequest | ChatCompletionRequest | EmbeddingRequest
    raw: bytes
    light: bool


@dataclass(frozen=True)
class Prepared:
    prompt_token_ids: list[list[int]]  # per prompt (chat: one)
    prompt_texts: list[str]  # per prompt, its text, when a completion asks for ``echo`` (else empty)


class InvalidBody(Exception):
    """A body that does not parse or validate; ``errors`` as FastAPI's ``RequestValidationError`` has them."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__(errors)
        self.errors = errors


class PrepareWorker:
    _MAX_BOUNDS = 64  # tokenizers whose PromptBound is kept

    def __init__(self, config: PrepareConfig, tokenizers: VersionTokenizers) -> None:
        self.config = config
        self.tokenizers = tokenizers
        self._bounds: dict[int, tuple[Any, PromptBound | None]] = {}  # id(tokenizer) -> (it, its bound)

    def warm_up(self) -> None:
        """Compute the base tokenizer's ``PromptBound`` (it reads the whole vocabulary) before requests."""
        if self.tokenizers.base is not None:
            self.bound(self.tokenizers.base)

    def parse_completion(self, raw: bytes, light: bool) -> CompletionRequest:
        body = _parse(CompletionRequest, raw)
        return body.model_copy(update={"prompt": ""}) if light else body

    def parse_chat(self, raw: bytes, light: bool) -> ChatCompletionRequest:
        body = _parse(ChatCompletionRequest, raw)
        return body.model_copy(update={"messages": []}) if light else body

    def completion(self, parsed: Parsed, version: Version, default_max_tokens: int) -> Prepared:
        body = _parse(CompletionRequest, parsed.raw) if parsed.light else parsed.body
        tokenizer = self.tokenizers.tokenizer_for(version)
        reserve = _reserve(body.max_tokens, default_max_tokens)
        prompts = body.prompts()
        ids = [self.token_ids(tokenizer, prompt, reserve, "prompt") for prompt in prompts]
        texts = [self._text(tokenizer, prompt, body.model) for prompt in prompts] if body.echo else []
        return Prepared(ids, texts)

    def chat(self, parsed: Parsed, version: Version) -> Prepared:
        body = _parse(ChatCompletionRequest, parsed.raw) if parsed.light else parsed.body
        tokenizer = self.tokenizers.tokenizer_for(version)  # its chat template too
        if tokenizer is None:
            raise RequestError("this model has no tokenizer; use /v1/completions with token ids", "messages")
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return Prepared([self.token_ids(tokenizer, body.prompt_text(tokenizer), _reserve(limit, 1), "messages")], [])

    def parse_pooling(self, raw: bytes, light: bool, task: str) -> PoolingBody:
        """Parse the body of pooling route ``task`` (``POOLING_BODIES``); light: its inputs emptied."""
        body = _parse(POOLING_BODIES[task], raw)
        return body.light() if light else body

    def pooling(self, parsed: Parsed, version: Version, task: str) -> Prepared:
        """A pooling body's inputs (``pooled_inputs``) as token ids: texts tokenized as sentence-transformers
        does (with the tokenizer's special tokens), a pair as HF's sentence-pair encoding, token ids as given."""
        body = _parse(POOLING_BODIES[task], parsed.raw) if parsed.light else parsed.body
        tokenizer = self.tokenizers.tokenizer_for(version)
        inputs = pooled_inputs(body, version.class_labels is not None)
        field = input_field(body)
        check_unicode([list(x) if isinstance(x, tuple) else x for x in inputs], field)
        return Prepared([self.pair_ids(tokenizer, x, field) if isinstance(x, tuple) else
                         self.token_ids(tokenizer, x, 0, field, special_tokens=True) for x in inputs], [])

    def pair_ids(self, tokenizer: Any, pair: tuple[str, str], param: str) -> list[int]:
        """``tokenizer(text_1, text_2)``'s ids (HF's sentence-pair encoding, special tokens included), refused
        (on ``param``) before it is tokenized when its characters alone cannot fit the context."""
        if tokenizer is None:
            raise RequestError("this model has no tokenizer: pass token ids", param)
        self.check_characters(tokenizer, len(pair[0]) + len(pair[1]), 0, param)
        return list(tokenizer(pair[0], pair[1], add_special_tokens=True)["input_ids"])

    def tokenize(self, body: Any, version: Version) -> tuple[list[int], list[str] | None]:
        """``/tokenize``: (token ids, their strings when asked) of a prompt or of rendered chat messages."""
        tokenizer = self.tokenizers.tokenizer_for(version)
        if isinstance(body, TokenizeChatRequest):
            messages = [m.template_message() for m in body.messages]
            check_unicode(messages, "messages")
            ids = render_chat(tokenizer, messages)
        else:
            check_unicode(body.prompt, "prompt")
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return ids, tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None

    def detokenize(self, tokens: list[int], version: Version) -> str:
        return self.tokenizers.tokenizer_for(version).decode(tokens)

    def token_ids(self, tokenizer: Any, prompt: str | list[int], reserve: int, param: str,
                  special_tokens: bool = False) -> list[int]:
        """The prompt's token ids (with the tokenizer's special tokens when ``special_tokens``); a text that
        cannot fit the context with ``reserve`` new tokens is refused (``RequestError`` on ``param``) before it
        is tokenized."""
        if not isinstance(prompt, str):
            return list(prompt)
        if tokenizer is None:
            raise RequestError("this model has no tokenizer: pass token ids", param)
        self.check_characters(tokenizer, len(prompt), reserve, param)
        return tokenizer.encode(prompt, add_special_tokens=special_tokens)

    def check_characters(self, tokenizer: Any, characters: int, reserve: int, param: str) -> None:
        """``RequestError`` on ``param`` when a text of ``characters`` characters has, by the tokenizer's
        ``PromptBound``, too many tokens to fit the context with ``reserve`` new tokens."""
        bound = self.bound(tokenizer)
        if bound is not None and bound.min_tokens(characters) + reserve > self.config.max_model_len:
            try:
                check_context_length(bound.min_tokens(characters), reserve, self.config.max_model_len,
                                     f"{characters} characters: at least ")
            except RequestError as exc:
                exc.param = param if exc.param == "prompt" else exc.param
                raise

    def bound(self, tokenizer: Any) -> PromptBound | None:
        """``tokenizer``'s ``PromptBound``, computed once per tokenizer."""
        entry = self._bounds.get(id(tokenizer))
        if entry is None or entry[0] is not tokenizer:
            if len(self._bounds) >= self._MAX_BOUNDS:
                self._bounds.clear()
            entry = self._bounds[id(tokenizer)] = (tokenizer, PromptBound.for_tokenizer(tokenizer))
        return entry[1]

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


def check_unicode(value: object, param: str) -> None:
    """``RequestError`` on ``param`` if a string in ``value`` (nested lists and dicts too) is not valid Unicode
    text: a lone surrogate (JSON ``"\\ud800"``) cannot be encoded, so no tokenizer can read it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise RequestError(f"{param} holds a lone surrogate ({value[exc.start]!r} at character {exc.start}): "
                               "not valid Unicode text", param) from None
    elif isinstance(value, dict):
        for item in value.values():
            check_unicode(item, param)
    elif isinstance(value, list):
        for item in value:
            check_unicode(item, param)


def _parse(model: type[BaseModel], raw: bytes) -> Any:
    try:
        body = model.model_validate_json(raw)
    except ValidationError as exc:
        raise InvalidBody([_portable_error(e) for e in exc.errors(include_url=False, include_input=False)]) from None
    check_stop(getattr(body, "stop", None))
    return body


def _portable_error(error: Any) -> dict[str, Any]:
    """A pydantic error as plain data (it crosses a process boundary), located in the body as FastAPI does."""
    out = {"type": error["type"], "loc": ("body", *error["loc"]), "msg": error["msg"]}
    if "ctx" in error:
        out["ctx"] = {key: str(value) for key, value in error["ctx"].items()}
    return out
