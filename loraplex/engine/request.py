"""Requests, their sampling parameters and their outputs."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from loraplex.engine.logprobs import TokenLogprob
from loraplex.engine.sampling_params import SamplingParams
from loraplex.errors import LoraplexError, RequestError

if TYPE_CHECKING:
    from loraplex.engine.detokenizer import IncrementalDetokenizer
    from loraplex.engine.logits_processors import ProcessorState
    from loraplex.engine.structured.masks import GrammarState

__all__ = ["NO_TAGS", "Request", "RequestOutput", "RequestStatus", "RequestTags", "SamplingParams", "TokenLogprob",
           "check_context_length"]


@dataclass
class RequestOutput:
    """One request's state after a step; ``delta_text`` is what is new since its previous output.

    ``logprobs`` (when the request asked) has one entry per ``token_ids`` entry; ``prompt_logprobs`` one
    per prompt token, the first None. ``LLM.generate`` returns one output per prompt: its first choice,
    with every choice (``n`` of them, vLLM's shape) in ``outputs``, each with its ``index``.
    """

    request_id: str
    adapter: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    delta_text: str
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: LoraplexError | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    index: int = 0  # which choice of its prompt this is
    outputs: list[RequestOutput] = field(default_factory=list)


@dataclass(frozen=True)
class RequestTags:
    """How the engine orders and routes a submitted request (``Engine.add_requests``): ``tenant`` (fair share),
    ``priority`` (vLLM's: lower first within its tenant), ``adapter_version`` (a held version of its adapter,
    from ``EngineClient.route_adapter``; None: the engine routes)."""

    tenant: str | None = None
    priority: int = 0
    adapter_version: int | None = None

    def kwargs(self) -> dict[str, Any]:
        return {"tenant": self.tenant, "priority": self.priority, "adapter_version": self.adapter_version}


NO_TAGS = RequestTags()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Engine-side state of one request. ``version_id`` is the adapter *version* it resolved to."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: str | None
    version_id: int | None
    generator: torch.Generator | None
    detokenizer: IncrementalDetokenizer | None = None  # None: no stop strings, no text (token ids only)
    arrival_step: int = 0
    tenant: str | None = None  # who is served (fair share per tenant); None: the anonymous tenant
    priority: int = 0  # vLLM's request priority: lower is admitted first within its tenant
    charged_tokens: int = 0  # positions already charged to its tenant's fair-share counter
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V sit in the cache
    block_table: list[int] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full blocks (block_hash)
    pinned: bool = False  # holds a pin on its adapter's slot
    holds_version: bool = False  # holds its adapter version (AdapterManager.hold) until it finishes
    finish_reason: str | None = None
    error: LoraplexError | None = None
    logprobs: list[TokenLogprob] | None = None  # per generated token, when params.logprobs is set
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token so far, when asked
    processor_state: ProcessorState | None = None  # the logits processors' tensors, built on first use
    grammar: GrammarState | None = None  # its structured-output constraint (params.structured_outputs)

    def __post_init__(self) -> None:
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]  # the first prompt token has no context to score it

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def output(self) -> RequestOutput:
        """Its state now as a ``RequestOutput`` (takes the text added since the previous output)."""
        detok = self.detokenizer
        return RequestOutput(
            request_id=self.request_id, adapter=self.adapter,
            prompt_token_ids=self.prompt_token_ids, token_ids=list(self.output_token_ids),
            text=detok.text if detok else "", delta_text=detok.pop_delta(self.finished) if detok else "",
            finished=self.finished, finish_reason=self.finish_reason, error=self.error,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs))


def check_context_length(num_prompt_tokens: int, max_tokens: int, max_model_len: int, prompt_note: str = "") -> None:
    """Raise ``RequestError`` (on ``prompt``, or on ``max_tokens`` when the prompt alone fits) unless
    the prompt's tokens plus ``max_tokens`` fit ``max_model_len``. ``prompt_note`` qualifies the count
    (e.g. "at least ..." when it is a lower bound). An empty prompt is refused too."""
    if num_prompt_tokens == 0:
        raise RequestError("prompt is empty", "prompt")
    if num_prompt_tokens + max_tokens > max_model_len:
        param = "prompt" if num_prompt_tokens >= max_model_len else "max_tokens"
        raise RequestError(f"prompt ({prompt_note}{num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the "
                           f"maximum context length of {max_model_len} tokens", param)
