"""``RequestIntake``: from a ``NewRequest`` to a ``Request`` the engine can queue (any thread).

Per request: *hold* exactly the adapter version its frontend routed it to (``AdapterManager.hold``:
accepted means served, so the version outlives an unload until the request ends; a version that is no
longer held is refused), then validate the sampling parameters and the prompt's token ids against that
version's vocabulary, check the context length, and attach a structured-output grammar built for that
version's tokenizer. A request that fails any check releases its hold before the error is raised;
``make_all`` is all or nothing.

Per call (``make_all``: the requests of one ``add_requests``, i.e. one API request), the work it may ask for
is bounded (``RequestBounds``): the choices of one prompt (the requests with the same prompt token ids and
version) may generate ``max_request_output_tokens`` together, ``n x max_tokens`` with each choice's real
maximum (the server sets ``max_tokens`` to the rest of the context when the client gives none); and a
request may ask prompt logprobs of at most ``max_prompt_logprobs_tokens`` prompt tokens.

The engine core never sees text: tokenizing and detokenizing are the frontend's (``loraplex/client/``).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from loraplex.adapters.info import AdapterInfo
from loraplex.adapters.manager import AdapterManager
from loraplex.adapters.reading.weights import ScoreHead
from loraplex.config import EngineConfig
from loraplex.engine.lora_plan import check_members, check_plan
from loraplex.engine.request import KVOwner, NewRequest, Request, RequestTags, check_context_length
from loraplex.engine.sampling.structured.compiler import GrammarCompilers
from loraplex.errors import RequestError


@dataclass(frozen=True)
class RequestBounds:
    """The work one call may ask for, resolved from ``EngineConfig`` (None there: the defaults below)."""

    max_request_output_tokens: int  # n x max_tokens of one prompt's choices; default 16 x max_model_len
    max_prompt_logprobs_tokens: int  # prompt tokens one request may ask logprobs of; default max_model_len
    max_plan_entries: int = 4  # entries of one LoRA plan: max_adapters_per_request, at most max_loras

    @classmethod
    def of(cls, config: EngineConfig, max_model_len: int) -> RequestBounds:
        output, logprobs = config.max_request_output_tokens, config.max_prompt_logprobs_tokens
        return cls(16 * max_model_len if output is None else output, max_model_len if logprobs is None else logprobs,
                   min(config.max_adapters_per_request, config.max_loras))

    def check(self, requests: Sequence[Request]) -> None:
        """``RequestError`` ("n" / "max_tokens", "prompt_logprobs") naming the bound ``requests`` go past."""
        per_prompt: Counter[tuple[KVOwner, tuple[int, ...]]] = Counter()
        choices: Counter[tuple[KVOwner, tuple[int, ...]]] = Counter()
        for request in requests:
            prompt = (request.kv_owner, tuple(request.prompt_token_ids))
            per_prompt[prompt] += request.params.max_tokens
            choices[prompt] += 1
            if request.params.prompt_logprobs is not None and (
                    len(request.prompt_token_ids) > self.max_prompt_logprobs_tokens):
                raise RequestError(f"prompt_logprobs of a {len(request.prompt_token_ids)}-token prompt: past the "
                                   f"limit of {self.max_prompt_logprobs_tokens} prompt tokens "
                                   "(--max-prompt-logprobs-tokens)", "prompt_logprobs")
        for prompt, total in per_prompt.items():
            if total > self.max_request_output_tokens:
                n = choices[prompt]
                raise RequestError(f"{n} choice(s) of one prompt may generate {total} tokens together (n x max_tokens; "
                                   f"without max_tokens a choice may run to the end of the context): past the limit "
                                   f"of {self.max_request_output_tokens} (--max-request-output-tokens); ask fewer "
                                   "choices or set max_tokens",
                                   "n" if n > 1 else "max_tokens")


class RequestIntake:
    def __init__(self, adapters: AdapterManager, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int,
                 max_model_len: int, grammars: GrammarCompilers, seed: int, bounds: RequestBounds,
                 hidden_size: int | None = None) -> None:
        self.adapters, self.tokenizer, self.vocab_size = adapters, tokenizer, vocab_size
        self.hidden_size = hidden_size  # what a pooling request's ``dimensions`` may keep at most
        self.max_model_len, self.grammars, self.bounds = max_model_len, grammars, bounds
        self._generator = torch.Generator().manual_seed(seed)
        self._ids = itertools.count()

    def version(self, version_id: int | None) -> tuple[PreTrainedTokenizerBase | None, int]:
        """(tokenizer, vocabulary size) of ``version_id`` (None: the base model): its own tokenizer if it
        ships one (the structured-output grammars are built for it), else the base model's."""
        info = self.adapters.info(version_id) if version_id is not None else None
        tokenizer = info.tokenizer if info is not None and info.tokenizer is not None else self.tokenizer
        return tokenizer, (info.vocab_size if info is not None and info.vocab_size else self.vocab_size)

    def make_all(self, items: Sequence[NewRequest], tags: RequestTags) -> list[Request]:
        """A request per item, each holding its version; if any item is refused, the holds of the others are
        released and the error raised. The group counts once as served on each version it uses."""
        requests: list[Request] = []
        try:
            for item in items:
                requests.append(self.make(item, tags))
            self.bounds.check(requests)
        except BaseException:
            for request in requests:
                self.release(request)
            raise
        for version_id in {v for r in requests for v in r.members}:
            self.adapters.count_served(version_id)
        return requests

    def make(self, item: NewRequest, tags: RequestTags) -> Request:
        """Hold every version the item reads (its version, or each member of its plan), then build it; on any
        refusal the holds taken are released and the error raised."""
        if item.plan is not None:
            item = item._replace(plan=check_plan(item.plan, item.version_id, self.bounds.max_plan_entries))
        members = [item.version_id] if item.version_id is not None else []
        if item.plan is not None:
            members = [v for v, _ in item.plan]
        held: list[AdapterInfo] = []
        request: Request | None = None
        try:
            for version_id in members:
                held.append(self.adapters.hold(version_id))
            if item.plan is not None:
                check_members(item.plan, held)
            request = self._build(item, "+".join(info.name for info in held) or None, members[0] if members else None,
                                  tags.tenant)
            if held and held[0].alora_invocation_tokens is not None:
                request.alora_start = self._invocation_point(held[0], request.prompt_token_ids)
            if request.pool is not None and request.params.pooling.classify:
                request.pool.head = self._head(item, held)
        except BaseException:
            if request is not None and request.grammar is not None:
                request.grammar.abandon()
            for info in held:
                self.adapters.release_hold(info.version_id)
            raise
        request.holds_version = bool(held)
        request.tenant, request.priority = tags.tenant, tags.priority
        return request

    @staticmethod
    def _head(item: NewRequest, held: list[AdapterInfo]) -> ScoreHead:
        """The classification head a classifying request reads: its one version's (held: it stays this version's
        for the request's life); ``RequestError`` on ``model`` for the base model, a blend or a scaled adapter,
        or a version without one."""
        if item.plan is not None or len(held) != 1:
            raise RequestError("classification reads one adapter's classification head: name a SEQ_CLS adapter "
                               "as the model (not the base model, a lora_scale or an adapter_mix)", "model")
        if held[0].score_head is None:
            raise RequestError(f"adapter {held[0].name!r} has no classification head (a PEFT SEQ_CLS adapter saves "
                               "'score' or 'classifier' in modules_to_save)", "model")
        return held[0].score_head

    @staticmethod
    def _invocation_point(info: AdapterInfo, token_ids: list[int]) -> int:
        """Where an aLoRA adapter's delta starts in a prompt: the start of the last occurrence of its invocation
        tokens (PEFT's rule); ``RequestError`` on the prompt when they do not occur."""
        tokens = info.alora_invocation_tokens or ()
        for start in range(len(token_ids) - len(tokens), -1, -1):
            if token_ids[start] == tokens[0] and token_ids[start:start + len(tokens)] == list(tokens):
                return start
        raise RequestError(f"adapter {info.name!r} is an activated LoRA: its prompt must contain its invocation "
                           f"sequence (alora_invocation_tokens {list(tokens)[:16]}), which it does not", "prompt")

    def release(self, request: Request) -> None:
        """Release the holds (and abandon the grammar compile) of a request that will never be queued."""
        if request.grammar is not None:
            request.grammar.abandon()
        if request.holds_version:
            for version_id in request.members:
                self.adapters.release_hold(version_id)
            request.holds_version = False

    def _build(self, item: NewRequest, adapter: str | None, tokenizer_of: int | None, tenant: str | None) -> Request:
        tokenizer, vocab_size = self.version(tokenizer_of)
        params = item.params
        params.validate(vocab_size)
        if params.pooling is not None:
            params.pooling.validate(self.hidden_size)
        if params.n != 1:
            raise RequestError(f"an engine request is one choice, got n={params.n}: submit params.choices() "
                               "(LLM.generate and the server do)", "n")
        token_ids = item.prompt_token_ids
        if not isinstance(token_ids, list) or any(
                isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in token_ids):
            raise RequestError(f"prompt token ids must be a list of ints in [0, {vocab_size})", "prompt")
        check_context_length(len(token_ids), params.max_tokens, self.max_model_len)
        generator = self._generator if params.seed is None else torch.Generator().manual_seed(params.torch_seed)
        request_id = item.request_id if item.request_id is not None else f"req-{next(self._ids)}"
        grammar = self.grammars.state_for(params.structured_outputs, tokenizer, vocab_size, tenant)  # off the loop
        return Request(request_id, list(token_ids), params, adapter, item.version_id, generator, grammar=grammar,
                       plan=item.plan)
