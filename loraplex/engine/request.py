"""Requests, their sampling parameters and their outputs."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from loraplex.errors import LoraplexError, RequestError

if TYPE_CHECKING:
    from loraplex.engine.detokenizer import IncrementalDetokenizer


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. ``temperature == 0`` is greedy; ``top_k == 0`` is off."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Accept a single string or any sequence for the tuple fields.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self) -> None:
        """Raise ``RequestError`` naming the first invalid field."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}", "max_tokens")
        if not math.isfinite(self.temperature) or not 0.0 <= self.temperature <= 2.0:
            raise RequestError(f"temperature must be in [0, 2], got {self.temperature!r}", "temperature")
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise RequestError(f"top_k must be 0 (off) or a positive integer, got {self.top_k!r}", "top_k")
        if self.seed is not None and (not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**64):
            raise RequestError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}", "seed")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError("stop must be non-empty strings", "stop")


@dataclass
class RequestOutput:
    """One request's state after a step; ``delta_text`` is what is new since its previous output."""

    request_id: str
    adapter: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    delta_text: str
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: LoraplexError | None = None


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Engine-side state of one request. ``adapter_id`` is the adapter *version* it resolved to."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: str | None
    adapter_id: int | None
    generator: torch.Generator | None
    detokenizer: IncrementalDetokenizer | None = None  # None: no stop strings, no text (token ids only)
    arrival_step: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V sit in the cache
    block_table: list[int] = field(default_factory=list)
    pinned: bool = False  # holds a pin on its adapter's slot
    finish_reason: str | None = None
    error: LoraplexError | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
