"""``SamplingParams``: how one request picks its tokens, with vLLM's field names, and its limits.

The limits below are the single source of truth: ``SamplingParams.validate`` enforces them (the
offline API and the server reject the same values with the same messages) and the server's OpenAPI
schema publishes them.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from loraplex.engine.pooling.params import PoolingParams
from loraplex.engine.sampling.structured.params import StructuredOutputsParams
from loraplex.errors import RequestError

MAX_LOGPROBS = 20  # top-k alternatives per position (OpenAI's limit)
MAX_N = 128  # choices per prompt (OpenAI's limit)
TEMPERATURE_MAX = 2.0
PENALTY_RANGE = (-2.0, 2.0)  # presence_penalty, frequency_penalty (OpenAI)
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI
TORCH_SEEDS = (-(2**63), 2**64)  # [lo, hi): what torch.Generator.manual_seed takes


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token (vLLM's names and meanings).

    - ``temperature == 0`` (or ``top_k == 1``) is greedy; ``top_k == 0`` is off; ``min_p == 0`` is off.
    - ``max_tokens == 0`` computes the prompt only (score it with ``prompt_logprobs``).
    - ``seed``: any integer (outside [-2**63, 2**64) it is reduced modulo 2**64); None draws from the
      engine's generator.
    - ``n``: choices per prompt. ``LLM.generate`` and the server run each choice as its own engine
      request (``choices()``); the engine itself runs one choice per request.
    - ``logprobs``: per generated token, its log-probability and the ``logprobs`` most likely
      alternatives (0 = the sampled token's only); ``prompt_logprobs`` the same for every prompt token
      but the first. Both are the log-softmax of the model's raw logits for the request's adapter,
      before penalties, bias, temperature and top-k/p (vLLM's ``logprobs_mode="raw_logprobs"``).
    - ``presence_penalty`` / ``frequency_penalty``: OpenAI's, over generated tokens:
      ``logit[t] -= frequency * count[t] + presence * (count[t] > 0)``.
    - ``repetition_penalty``: HF's, over prompt and generated tokens: a seen token's logit is divided
      by it when positive, multiplied when negative (1 = off).
    - ``logit_bias``: token id -> value added to its logit. ``min_tokens``: EOS and ``stop_token_ids``
      are masked until that many tokens were generated (beyond ``max_tokens`` it changes nothing more).
    - ``structured_outputs``: the output must match a JSON schema, a regex, one of a list of choices or a
      grammar (``StructuredOutputsParams``, vLLM's). The tokens the grammar does not allow next are masked
      before everything above; for such a request ``logprobs`` are those of the constrained distribution
      (the raw logits with the disallowed tokens at -inf). It cannot be combined with ``ignore_eos`` or
      ``min_tokens`` (the grammar decides where the output ends).
    - ``speculative_decoding``: False opts this request out of the engine's speculative decoding (when the
      engine has a ``speculative_config``; it never changes a greedy output, only how fast it comes).
    - ``pooling``: the request returns one vector pooled from its prompt's final hidden states
      (``PoolingParams``: an embedding) instead of tokens; it needs ``max_tokens == 0`` and no logprobs,
      choices or structured outputs.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    structured_outputs: StructuredOutputsParams | None = None
    speculative_decoding: bool = True
    pooling: PoolingParams | None = None

    def __post_init__(self) -> None:
        # Accept a single string or any sequence for the tuple fields, and any mapping for logit_bias.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", dict(self.logit_bias or {}))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def torch_seed(self) -> int | None:
        """The seed for ``torch.Generator.manual_seed``: any integer seed is accepted; one outside torch's
        range [-2**63, 2**64) is reduced modulo 2**64."""
        if self.seed is None or TORCH_SEEDS[0] <= self.seed < TORCH_SEEDS[1]:
            return self.seed
        return self.seed % 2**64

    @property
    def has_penalties(self) -> bool:
        """Whether any logits processor (penalty, bias, min_tokens) applies to this request."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)

    def choices(self) -> list[SamplingParams]:
        """The ``n`` one-choice params a request fans out into. Choice 0 keeps the request's seed (so a
        seeded ``n=1`` request and choice 0 of ``n>1`` draw the same tokens); choice j > 0 gets a seed
        derived deterministically from it. Prompt logprobs are asked of choice 0 only (same prompt).
        ``RequestError`` on ``n`` unless it is an integer in [1, ``MAX_N``] (the choices' own ``n`` is 1, so
        this is where it is checked)."""
        self._check_n()
        if self.n == 1:
            return [self]
        return [replace(self, n=1, seed=self.seed if j == 0 or self.seed is None else _derived_seed(self.seed, j),
                        prompt_logprobs=self.prompt_logprobs if j == 0 else None) for j in range(self.n)]

    def _check_n(self) -> None:
        if not _integer(self.n) or not 1 <= self.n <= MAX_N:
            raise RequestError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}", "n")

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ``RequestError`` naming the first invalid field; token ids are checked against
        ``vocab_size`` when it is given (the engine gives it)."""
        if not _integer(self.max_tokens) or self.max_tokens < 0:
            raise RequestError(f"max_tokens must be a non-negative integer (0: score the prompt only), got "
                               f"{self.max_tokens!r}", "max_tokens")
        if not _number(self.temperature) or not 0.0 <= self.temperature <= TEMPERATURE_MAX:
            raise RequestError(f"temperature must be in [0, {TEMPERATURE_MAX:g}], got {self.temperature!r}",
                               "temperature")
        if not _number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not _integer(self.top_k) or self.top_k < 0:
            raise RequestError(f"top_k must be 0 (off) or a positive integer, got {self.top_k!r}", "top_k")
        if not _number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p!r}", "min_p")
        if self.seed is not None and not _integer(self.seed):
            raise RequestError(f"seed must be an integer or null, got {self.seed!r}", "seed")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError("stop must be non-empty strings", "stop")
        self._check_n()
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _integer(value) or not 0 <= value <= MAX_LOGPROBS):
                raise RequestError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or null, got {value!r}", name)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _number(value) or not PENALTY_RANGE[0] <= value <= PENALTY_RANGE[1]:
                raise RequestError(f"{name} must be in [-2, 2], got {value!r}", name)
        if not _number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise RequestError(f"repetition_penalty must be a number > 0 (1 = off), got {self.repetition_penalty!r}",
                               "repetition_penalty")
        if not _integer(self.min_tokens) or self.min_tokens < 0:
            raise RequestError(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}", "min_tokens")
        if not isinstance(self.speculative_decoding, bool):
            raise RequestError(f"speculative_decoding must be a boolean, got {self.speculative_decoding!r}",
                               "speculative_decoding")
        self._validate_token_ids(vocab_size)
        self._validate_structured()
        self._validate_pooling()

    def _validate_pooling(self) -> None:
        if self.pooling is None:
            return
        if not isinstance(self.pooling, PoolingParams):
            raise RequestError("pooling must be a PoolingParams", "pooling")
        if self.max_tokens != 0:
            raise RequestError(f"a pooling request computes its prompt only: max_tokens must be 0, got "
                               f"{self.max_tokens!r}", "max_tokens")
        for name in ("logprobs", "prompt_logprobs", "structured_outputs"):
            if getattr(self, name) is not None:
                raise RequestError(f"{name} cannot be combined with pooling", name)
        if self.n != 1:
            raise RequestError(f"a pooling request has one output: n must be 1, got {self.n!r}", "n")
        self.pooling.validate()

    def _validate_structured(self) -> None:
        if self.structured_outputs is None:
            return
        if not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise RequestError("structured_outputs must be a StructuredOutputsParams", "structured_outputs")
        for name in ("ignore_eos", "min_tokens"):
            if getattr(self, name):
                raise RequestError(f"{name} cannot be combined with structured outputs: the grammar decides where "
                                   "the output ends", name)
        self.structured_outputs.validate()

    def _validate_token_ids(self, vocab_size: int | None) -> None:
        limit = f"[0, {vocab_size})" if vocab_size is not None else "[0, vocab size)"

        def valid(token: object) -> bool:
            return _integer(token) and token >= 0 and (vocab_size is None or token < vocab_size)

        if not all(valid(t) for t in self.stop_token_ids):
            raise RequestError(f"stop_token_ids must be token ids in {limit}", "stop_token_ids")
        for token, bias in self.logit_bias.items():
            if not valid(token):
                raise RequestError(f"logit_bias keys must be token ids in {limit}, got {token!r}", "logit_bias")
            if not _number(bias) or not LOGIT_BIAS_RANGE[0] <= bias <= LOGIT_BIAS_RANGE[1]:
                raise RequestError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {token}",
                                   "logit_bias")


def _derived_seed(seed: int, choice: int) -> int:
    """A seed in [0, 2**63) for choice ``choice`` of a request seeded with ``seed``."""
    digest = hashlib.sha256(f"loraplex-choice:{seed}:{choice}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
