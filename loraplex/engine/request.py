"""The engine core's requests: what it takes (``NewRequest``), what it keeps (``Request``) and what each
step gives back (``EngineOutput``: token ids only; text is the frontend's)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from loraplex.engine.pooling.pooler import PoolState
from loraplex.engine.sampling.logprobs import TokenLogprob
from loraplex.engine.sampling.params import SamplingParams
from loraplex.errors import LoraplexError, RequestError

if TYPE_CHECKING:
    from loraplex.engine.sampling.logits_processors import ProcessorState
    from loraplex.engine.sampling.structured.masks import GrammarState
    from loraplex.engine.speculative.speculator import DraftState

__all__ = ["NO_TAGS", "EngineOutput", "EngineTimes", "NewRequest", "Plan", "Request", "RequestStatus", "RequestTags",
           "SamplingParams", "TokenLogprob", "check_context_length"]

Plan = tuple[tuple[int, float], ...]  # a LoRA plan: (adapter version id, scale) per delta, in order
KVOwner = int | Plan | None  # what a sequence's K/V is computed with besides its tokens (``scheduler/block_hash.py``)


class NewRequest(NamedTuple):
    """One request as the engine core takes it: token ids, one choice (``params.n == 1``) and the adapter
    version its frontend routed it to (None: the base model). ``plan``, when given, is its LoRA plan instead:
    ``((version_id, scale),)`` for one adapter at a scale (``version_id`` is then that version), or an adapter
    mix of several entries (``version_id`` None), each version routed once by the frontend; every row of it
    computes ``W x + sum_k scale_k * B_k A_k x``. Stop strings in ``params.stop`` are the frontend's
    (``client/output.py``); the engine stops on token ids, EOS and lengths only."""

    request_id: str | None  # None: the engine names it ("req-N")
    prompt_token_ids: list[int]
    params: SamplingParams
    version_id: int | None = None
    plan: Plan | None = None


@dataclass(frozen=True)
class EngineTimes:
    """When one request's life in the engine passed each point: Unix seconds (``time.time()`` in the engine's
    process, so they hold across the process boundary), and how many prompt tokens' K/V came from the prefix
    cache at its admission. Sent with a request's first output and with its last."""

    arrival: float  # added to the scheduler's queue
    scheduled: float | None = None  # first admitted (its adapter pinned in a slot, its blocks allocated)
    first_token: float | None = None  # its first token was drawn (the prefill is done)
    prefix_cached_tokens: int = 0


@dataclass
class EngineOutput:
    """What one step produced for one request: its *new* token ids (and their logprobs) since its previous
    output, never text. Prompt logprobs (complete once its prefill is) come with its first output only.
    The frontend's ``OutputProcessor`` turns these into ``RequestOutput`` s (``client/output.py``)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: LoraplexError | None = None
    new_logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked
    prompt_logprobs: list[TokenLogprob | None] | None = None
    times: EngineTimes | None = None  # with its first output and its last
    embedding: list[float] | None = None  # a pooling request's vector (``params.pooling``), with its last output


@dataclass(frozen=True)
class RequestTags:
    """How the engine orders a submitted group of requests (``Engine.add_requests``): ``tenant`` (fair
    share) and ``priority`` (vLLM's: lower first within its tenant)."""

    tenant: str | None = None
    priority: int = 0


NO_TAGS = RequestTags()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Engine-side state of one request: ``version_id`` is the adapter version it holds (``adapter`` is that
    version's name, for the per-adapter counters); with a ``plan`` (``NewRequest``) it holds every member."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: str | None
    version_id: int | None
    generator: torch.Generator | None
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
    draft_state: DraftState | None = None  # its speculative drafting state, built on its first draft
    num_emitted: int = 0  # output tokens already handed out in an ``EngineOutput``
    prompt_logprobs_sent: bool = False
    arrival_time: float = 0.0  # EngineTimes' instants, set by the scheduler
    scheduled_time: float | None = None
    first_token_time: float | None = None
    prefix_cached_tokens: int = 0
    plan: Plan | None = None  # its LoRA plan when it is not ``version_id`` at scale 1 (``NewRequest.plan``)
    alora_start: int | None = None  # an aLoRA adapter's invocation point: positions before it use the base weights

    def base_blocks(self, block_size: int) -> int:
        """How many leading KV blocks hold base-model K/V only (every position before the aLoRA invocation point):
        they key and are shared as the base model's (``block_hash``); 0 without an aLoRA adapter."""
        return 0 if self.alora_start is None else self.alora_start // block_size

    @property
    def members(self) -> tuple[int, ...]:
        """Every adapter version it reads, in plan order: each is held for its life and pinned while it runs."""
        if self.plan is not None:
            return tuple(v for v, _ in self.plan)
        return () if self.version_id is None else (self.version_id,)

    @property
    def kv_owner(self) -> KVOwner:
        """What its K/V is computed with (``block_hash``): its version for one adapter at scale 1 (or the base
        model's None), else the whole plan."""
        if self.plan is None or self.plan == ((self.version_id, 1.0),):
            return self.version_id
        return self.plan
    pool: PoolState | None = None  # a pooling request's pool so far (``engine/pooling/pooler.py``)

    def __post_init__(self) -> None:
        if self.params.pooling is not None and self.pool is None:
            self.pool = PoolState()
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

    def output(self) -> EngineOutput:
        """What is new since its previous output, as an ``EngineOutput`` (marks it handed out)."""
        new = slice(self.num_emitted, len(self.output_token_ids))
        times = None
        if self.num_emitted == 0 or self.finished:
            times = EngineTimes(self.arrival_time, self.scheduled_time, self.first_token_time,
                                self.prefix_cached_tokens)
        self.num_emitted = len(self.output_token_ids)
        prompt_logprobs = None  # complete by its first output (outputs start once its prefill is done)
        if self.prompt_logprobs is not None and not self.prompt_logprobs_sent:
            prompt_logprobs, self.prompt_logprobs_sent = list(self.prompt_logprobs), True
        return EngineOutput(
            request_id=self.request_id, new_token_ids=self.output_token_ids[new], finished=self.finished,
            finish_reason=self.finish_reason, error=self.error,
            new_logprobs=None if self.logprobs is None else self.logprobs[new], prompt_logprobs=prompt_logprobs,
            times=times, embedding=self._embedding())

    def _embedding(self) -> list[float] | None:
        """A pooling request's vector once it finished with its whole prompt computed (not aborted or failed)."""
        if self.pool is None or not self.finished or self.finish_reason != "length" or self.error is not None:
            return None
        assert self.params.pooling is not None
        return self.pool.vector(self.params.pooling)


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
