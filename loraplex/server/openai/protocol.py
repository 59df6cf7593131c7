"""OpenAI-compatible request bodies (pydantic) and their translation into ``SamplingParams``.

Request models check types; ranges (temperature in [0, 2], ...) are checked once, by
``SamplingParams.validate``, so the offline API and the server reject the same values with the same
messages; the OpenAPI schema publishes the same ranges (``json_schema_extra``, from the limits in
``engine/sampling/params.py``). A declared field is implemented; any other field is accepted only
with a neutral value (``strict_fields.py``), so nothing a client asks for is silently dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from loraplex.adapters.names import ADAPTER_NAME_PATTERN
from loraplex.engine.sampling.params import (
    LOGIT_BIAS_RANGE,
    MAX_LOGPROBS,
    MAX_N,
    PENALTY_RANGE,
    TEMPERATURE_MAX,
    SamplingParams,
)
from loraplex.engine.sampling.structured.params import StructuredOutputsParams
from loraplex.errors import RequestError
from loraplex.server.openai.strict_fields import (
    CHAT_UNIMPLEMENTED,
    COMPLETION_UNIMPLEMENTED,
    MESSAGE_UNIMPLEMENTED,
    VLLM_DEFAULTS,
    check_extra_fields,
)
from loraplex.server.openai.structured import StructuredFields
from loraplex.server.openai.tools import MessageToolCall, ToolFields


def _integral(value: Any) -> Any:
    """JSON Schema's integers include 12.0: accept an integral float as that int (nothing else is coerced)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_integral)]  # a JSON integer: no strings, no booleans, no 1.5


def ranged(**bounds: float) -> Any:
    """An optional field whose range the schema publishes and ``SamplingParams.validate`` enforces."""
    return Field(None, json_schema_extra=bounds)


NonEmptyText = Field(json_schema_extra={"minLength": 1})


class _Body(BaseModel):
    """Undeclared fields are kept in ``model_extra`` and must be neutral for them (``unimplemented``)."""

    model_config = ConfigDict(extra="allow", strict=True)  # JSON types as the schema states them: "1" is no int
    unimplemented: ClassVar[Mapping[str, tuple[tuple[Any, ...], str]]] = {}
    where: ClassVar[str] = ""

    @model_validator(mode="after")
    def _nothing_dropped(self) -> _Body:
        check_extra_fields(self.model_extra or {}, self.unimplemented, self.where)
        return self


class StreamOptions(_Body):
    include_usage: bool | None = False


class AdapterMixEntry(_Body):
    """One adapter of an ``adapter_mix``: its name and the scale of its delta."""

    where: ClassVar[str] = "adapter_mix"
    name: str
    scale: float = Field(1.0, json_schema_extra={"minimum": 0})


class _SamplingFields(StructuredFields, _Body):
    """Fields shared by completions and chat completions (vLLM's extensions included)."""

    model: str
    max_tokens: Int | None = ranged(minimum=0)  # None: the endpoint's default
    temperature: float | None = ranged(minimum=0, maximum=TEMPERATURE_MAX)  # None: 1.0, as OpenAI
    top_p: float | None = ranged(exclusiveMinimum=0, maximum=1)
    seed: Int | None = None  # any integer (see SamplingParams.torch_seed)
    stop: str | list[str] | None = Field(None, json_schema_extra={"items": {"minLength": 1}, "minLength": 1})
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: Int | None = ranged(minimum=1, maximum=MAX_N)
    presence_penalty: float | None = ranged(minimum=PENALTY_RANGE[0], maximum=PENALTY_RANGE[1])
    frequency_penalty: float | None = ranged(minimum=PENALTY_RANGE[0], maximum=PENALTY_RANGE[1])
    logit_bias: dict[str, float] | None = Field(None, json_schema_extra={"additionalProperties": {
        "type": "number", "minimum": LOGIT_BIAS_RANGE[0], "maximum": LOGIT_BIAS_RANGE[1]}})
    user: str | None = None  # accepted and kept (metrics, tenancy)
    # vLLM extensions
    top_k: Int | None = ranged(minimum=-1)  # 0 or -1 = off
    min_p: float | None = ranged(minimum=0, maximum=1)
    repetition_penalty: float | None = ranged(exclusiveMinimum=0)
    min_tokens: Int | None = ranged(minimum=0)
    ignore_eos: bool | None = False
    stop_token_ids: list[Int] | None = None
    prompt_logprobs: Int | None = ranged(minimum=0, maximum=MAX_LOGPROBS)
    priority: Int | None = None  # lower is admitted first, within the caller's tenant (fair share across)
    # per-request LoRA plans (client/adapter_mix.py): the named adapter's delta times lora_scale (None: 1), or, with
    # ``model`` the base model's name, the sum of every listed adapter's delta times its scale
    lora_scale: float | None = Field(None, json_schema_extra={"minimum": 0}, description=(
        "Scales the delta of the adapter named by model (default 1); 400 with the base model as model."))
    adapter_mix: list[AdapterMixEntry] | None = Field(None, json_schema_extra={"minItems": 1}, description=(
        "Blends loaded adapters, each delta times its scale, with model the base model's name: at most "
        "--max-adapters-per-request entries sharing one tokenizer (400 otherwise; 404 for an unknown name)."))
    # loraplex: false opts this request out of the server's speculative decoding (--speculative-config)
    speculative_decoding: bool | None = Field(None, description=(
        "false: decode this request one token per step even when the server runs speculative decoding "
        "(--speculative-config); outputs are the same either way (greedy: identical; sampled: the same "
        "distribution). Default true."))

    def _params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
        """The body's ``SamplingParams``; their ranges are checked once, by the engine, when the request is
        submitted (its ``RequestError`` names the engine's field: ``field_of`` maps it to the body's)."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k in (None, -1) else self.top_k,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            stop=() if self.stop is None else self.stop,
            stop_token_ids=self.stop_token_ids or (),
            ignore_eos=bool(self.ignore_eos),
            n=1 if self.n is None else self.n,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=_token_keys(self.logit_bias or {}),
            min_tokens=self.min_tokens or 0,
            structured_outputs=self.constraint(),
            speculative_decoding=self.speculative_decoding is not False,
        )

    def mix(self) -> list[tuple[str, float]] | None:
        """``adapter_mix`` as (name, scale) pairs, None without one."""
        return None if self.adapter_mix is None else [(e.name, e.scale) for e in self.adapter_mix]

    def field_of(self, param: str | None) -> str | None:
        """The body field an engine refusal's ``param`` stands for."""
        return param

    def constraint(self) -> StructuredOutputsParams | None:
        """What the output must match (``structured.py``; chat adds its tool choice)."""
        return self.structured_constraint()

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)


def _token_keys(bias: dict[str, float]) -> dict[int, float]:
    try:
        return {int(key): value for key, value in bias.items()}
    except ValueError as exc:
        raise RequestError(f"logit_bias keys must be token ids, got {list(bias)!r}", "logit_bias") from exc


Prompt = str | list[Int] | list[str] | list[list[Int]]


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: ``prompt`` is a string, token ids, or a list of either (one choice group per
    prompt, indexed ``prompt_index * n + j``)."""

    unimplemented: ClassVar = {**COMPLETION_UNIMPLEMENTED, **VLLM_DEFAULTS}
    prompt: Prompt = Field(json_schema_extra={"minLength": 1, "minItems": 1, "items": {"minLength": 1, "minItems": 1}})
    echo: bool | None = False
    logprobs: Int | None = ranged(minimum=0, maximum=MAX_LOGPROBS)

    def prompts(self) -> list[str | list[int]]:
        return prompt_list(self.prompt, "prompt")

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """Echo with logprobs scores the prompt too (its first token's logprob is null)."""
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo and self.logprobs is not None:
            prompt_logprobs = self.logprobs
        max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        return self._params(max_tokens, self.logprobs, prompt_logprobs)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


def _text_parts_only(content: Any) -> Any:
    """A content part that is not text (``image_url``, ``input_audio``, ``file``...) is refused by name."""
    if isinstance(content, list):
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if isinstance(kind, str) and kind != "text":
                raise ValueError(f"content part {i} has type {kind!r}: only text content parts are supported")
    return content


class ChatMessage(_Body):
    unimplemented: ClassVar = MESSAGE_UNIMPLEMENTED
    where: ClassVar[str] = "messages"
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Annotated[str | list[TextPart] | None, BeforeValidator(_text_parts_only)] = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    reasoning_content: str | None = None  # an assistant turn's reasoning, as a response gave it

    def template_message(self) -> dict[str, Any]:
        """The message as the chat template sees it (text parts joined, tool calls' arguments as mappings)."""
        content = self.content
        text = "".join(part.text for part in content) if isinstance(content, list) else content or ""
        extra: dict[str, Any] = {k: v for k in ("name", "tool_call_id", "reasoning_content")
                                 if (v := getattr(self, k)) is not None}
        if self.tool_calls:
            extra["tool_calls"] = [call.template_call() for call in self.tool_calls]
        return {"role": self.role, "content": text, **extra}


class ChatCompletionRequest(ToolFields, _SamplingFields):
    """``POST /v1/chat/completions``."""

    unimplemented: ClassVar = {**CHAT_UNIMPLEMENTED, **VLLM_DEFAULTS}
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = ranged(minimum=0)  # wins over max_tokens
    logprobs: bool | None = False
    top_logprobs: Int | None = ranged(minimum=0, maximum=MAX_LOGPROBS)
    safety_identifier: str | None = None  # accepted and kept, as ``user``
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the chat template (enable_thinking)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None  # for templates reading it

    @model_validator(mode="after")
    def _template_kwargs_are_free(self) -> ChatCompletionRequest:
        taken = sorted(set(self.chat_template_kwargs or ()) & TEMPLATE_ARGUMENTS)
        if taken:
            raise RequestError(f"chat_template_kwargs may not set {', '.join(taken)}: loraplex sets it",
                               "chat_template_kwargs")
        return self

    def template_kwargs(self, tokenizer: Any) -> dict[str, Any]:
        """The chat template's extra variables: ``chat_template_kwargs``, and ``reasoning_effort`` for a template
        that reads it (any other effort than "none" is a 400 for one that does not, as OpenAI answers for
        models that do not reason)."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            if "reasoning_effort" in (getattr(tokenizer, "chat_template", None) or ""):
                kwargs["reasoning_effort"] = self.reasoning_effort
            elif self.reasoning_effort != "none":
                raise RequestError(f"reasoning_effort {self.reasoning_effort!r} is not supported with this model: "
                                   "its chat template does not read reasoning_effort", "reasoning_effort")
        return kwargs

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.top_logprobs and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.max_tokens is not None and limit is not self.max_tokens:  # overridden, still checked
            SamplingParams(max_tokens=self.max_tokens).validate()
        return self._params(default_max_tokens if limit is None else limit,
                            (self.top_logprobs or 0) if self.logprobs else None, self.prompt_logprobs)

    def field_of(self, param: str | None) -> str | None:
        """Name the chat field the client sent."""
        renamed = {"prompt": "messages", "logprobs": "top_logprobs",
                   "max_tokens": "max_completion_tokens" if self.max_completion_tokens is not None else None}
        return renamed.get(param or "") or param

    def constraint(self) -> StructuredOutputsParams | None:
        """The output's constraint. A forced tool call (``required`` or named) wins over a structured-output
        field, as on OpenAI: this turn's output is the call, and the format shapes the final message of a
        later turn (agent loops send both and reset ``tool_choice`` after the call)."""
        structured, tools = self.structured_constraint(), self.tool_constraint()  # both checked: a bad schema is a 400
        return tools if tools is not None else structured

    def prompt_text(self, tokenizer: Any) -> str:
        """The messages rendered with the tokenizer's chat template (see ``chat_text``)."""
        conversation = self.with_tool_prompt([m.template_message() for m in self.messages],
                                             getattr(tokenizer, "chat_template", None))
        return chat_text(tokenizer, conversation, self.template_tools(), self.template_kwargs(tokenizer))

    def prompt_ids(self, tokenizer: Any) -> list[int]:
        return list(tokenizer(self.prompt_text(tokenizer), add_special_tokens=False)["input_ids"])


# apply_chat_template's own arguments: chat_template_kwargs may not set them
TEMPLATE_ARGUMENTS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                                "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
                                "padding", "truncation", "max_length", "return_assistant_tokens_mask",
                                "tokenizer_kwargs"})


def chat_text(tokenizer: Any, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
              template_kwargs: dict[str, Any] | None = None) -> str:
    """Render messages with the tokenizer's chat template (``add_generation_prompt=True``). A model without
    a template, or messages its template refuses (e.g. roles that do not alternate), are a 400 on
    ``messages``. ``template_kwargs``: more variables for the template (``chat_template_kwargs``)."""
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError("this model has no chat template; use /v1/completions", "messages")
    try:
        return tokenizer.apply_chat_template(conversation, tools=tools, add_generation_prompt=True,
                                             tokenize=False, **(template_kwargs or {}))
    except Exception as exc:  # jinja2 TemplateError and the template's own raise_exception()
        raise RequestError(f"the chat template refused these messages: {exc}", "messages") from exc


def render_chat(tokenizer: Any, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
                ) -> list[int]:
    """``chat_text`` tokenized as is: the template writes every special token itself."""
    return list(tokenizer(chat_text(tokenizer, conversation, tools), add_special_tokens=False)["input_ids"])


_NAME_SCHEMA = {"pattern": ADAPTER_NAME_PATTERN}  # documented; checked by the routes (a 400 naming the pattern)


class LoadAdapterRequest(_Body):
    lora_name: str = Field(min_length=1, json_schema_extra=_NAME_SCHEMA)
    lora_path: str = Field(min_length=1)
    version: Literal["new"] | None = None  # "new": a loaded name gets a new version and moves to it


class UnloadAdapterRequest(_Body):
    lora_name: str = Field(min_length=1, json_schema_extra=_NAME_SCHEMA)


class TokenizeCompletionRequest(BaseModel):
    """``POST /tokenize`` with a prompt (vLLM's shape: no ``model`` means the base model, as lm-eval's remote
    tokenizer sends it)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(BaseModel):
    """``POST /tokenize`` with chat messages, rendered as ``/v1/chat/completions`` renders them."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None  # the base model
    messages: list[ChatMessage] = Field(min_length=1)
    return_token_strs: bool | None = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None  # the base model, as on /tokenize
    tokens: list[Int]


def prompt_list(given: str | list[int] | list[str] | list[list[int]], field: str) -> list[str | list[int]]:
    """One entry per prompt of a ``prompt`` / ``input`` field: a text or token ids alone is one prompt, a list of
    them is several; empty is a 400 on ``field``."""
    if isinstance(given, str) or (given and all(isinstance(t, int) for t in given)):
        return [given]
    if not given:
        raise RequestError(f"{field} is empty", field)
    return list(given)
