"""The engine: one ``step()`` = drain the inbox → schedule → run → sample → ``scheduler.update``.

Thread model: any thread may call ``add_request``, ``abort_request``, ``load_adapter`` and ``unload_adapter``;
they validate in the caller's thread (adapter files are read outside the manager's lock) and hand work to the
step loop through a thread-safe inbox. ``step()`` is driven by one loop thread or by ``LLM.generate``.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from loraplex.adapters.info import AdapterInfo
from loraplex.adapters.manager import AdapterManager
from loraplex.adapters.versions import VersionView
from loraplex.config import EngineConfig
from loraplex.engine.checks.faults import install_faults
from loraplex.engine.checks.invariants import check_right_kv, check_right_weights, keys_hold_all_kv_inputs
from loraplex.engine.intake import RequestBounds, RequestIntake
from loraplex.engine.kv_cache import KVCache
from loraplex.engine.memory import release_free_memory
from loraplex.engine.pooling.pooler import PoolingPlan
from loraplex.engine.request import NO_TAGS, EngineOutput, NewRequest, Plan, Request, RequestTags, SamplingParams
from loraplex.engine.runner import ModelRunner, StepEntry
from loraplex.engine.sampling.logprobs import add_prompt_logprobs, needs_prompt_rows
from loraplex.engine.sampling.sampler import nonfinite_rows, sample_rows
from loraplex.engine.sampling.structured.compiler import GrammarCompilers
from loraplex.engine.sampling.structured.waiting import GrammarWaitlist
from loraplex.engine.scheduler.admission import WaitingBound
from loraplex.engine.scheduler.block_manager import BlockManager
from loraplex.engine.scheduler.scheduler import ScheduledRequest, Scheduler, step_mapping
from loraplex.engine.speculative.verify import accept_drafts
from loraplex.engine.stats import EngineStats, collect_stats
from loraplex.engine.wire import EngineInfo
from loraplex.errors import EngineStepFailed, LoraplexError
from loraplex.layers.lora_linear import use_lora_dtype, use_lora_kernels
from loraplex.models.embedded import resolve_model
from loraplex.models.fingerprint import checkpoint_fingerprint
from loraplex.models.loader import load_model
from loraplex.models.registry import model_config
from loraplex.models.tokenizer_source import model_tokenizer
from loraplex.ops.lora import resolve_lora_kernels

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Retire:
    """Inbox item: an adapter version was dropped (no request holds it); its cached blocks are freed."""

    version_id: int


def _pick_device(config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto"
                          else config.device)
    if config.dtype == "auto":
        return device, torch.float32 if device.type == "cpu" else torch.bfloat16
    return device, getattr(torch, config.dtype)


# Tests only, no flag: each step that runs a batch sleeps this many seconds first, so a test can keep the engine
# busy for a known time whatever the machine's speed (tests/test_backpressure.py, tests/test_graceful_shutdown.py).
STEP_DELAY_ENV = "LORAPLEX_TEST_STEP_DELAY"


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._step_delay = float(os.environ.get(STEP_DELAY_ENV, "0"))
        folder = resolve_model(config.model)
        self.model_path = folder
        self.model_name = config.model if not Path(config.model).exists() else Path(config.model).name
        self.model_config = model_config(folder)
        self.device, self.dtype = _pick_device(config)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.model = load_model(folder, self.model_config, config.max_loras, config.max_lora_rank,
                                self.dtype, self.device)
        if config.quantization == "int8":
            self.model.quantize_int8()
        self.lora_kernels = resolve_lora_kernels(config.lora_kernels, self.device)
        use_lora_kernels(self.model, self.lora_kernels, config.max_num_batched_tokens)
        use_lora_dtype(self.model, torch.bfloat16 if config.lora_dtype == "bfloat16" else self.dtype)
        self.tokenizer: PreTrainedTokenizerBase | None = model_tokenizer(folder)
        block_bytes = KVCache.bytes_per_block(self.model_config, config.block_size, self.dtype)
        num_blocks = config.kv_cache_blocks or max(1, config.kv_cache_bytes // block_bytes)
        self.kv_cache = KVCache(self.model_config, num_blocks, config.block_size, self.dtype, self.device)
        self.runner = ModelRunner(self.model, self.kv_cache, config.block_size)
        self.adapters = AdapterManager(self.model_config, config.max_loras, config.max_cpu_loras,
                                       config.max_lora_rank, writer=self.model,
                                       allow_pickle=config.allow_pickle_adapters,
                                       saved_rows_budget=config.saved_rows_budget_bytes, base_tokenizer=self.tokenizer,
                                       first_version_id=config.first_version_id)
        self.max_model_len = min(self.model_config.max_position_embeddings, num_blocks * config.block_size)
        caching = config.enable_prefix_caching and keys_hold_all_kv_inputs(self.model, self.max_model_len)
        self.allocator = BlockManager(num_blocks, config.block_size, caching)
        self.scheduler = Scheduler(config, self.allocator, self.adapters, self.model_config.eos_token_ids,
                                   self.max_model_len)
        self._inbox: queue.SimpleQueue[list[Request] | str | _Retire] = queue.SimpleQueue()
        self._requests: dict[str, Request] = {}
        self.grammars = GrammarCompilers(self.model_config.eos_token_ids, workers=config.grammar_compile_workers,
                                         timeout_s=config.grammar_compile_timeout_s)  # structured outputs' grammars
        if config.grammar_compile_warm:
            self.grammars.start(self.tokenizer, self.model_config.vocab_size)
        self._compiling = GrammarWaitlist()  # requests waiting for their grammar, outside the scheduler
        self.waiting_bound = WaitingBound(config, self.scheduler, self._compiling)  # 503 past max_waiting_requests
        self.intake = RequestIntake(self.adapters, self.tokenizer, self.model_config.vocab_size,
                                    self.max_model_len, self.grammars, config.seed,
                                    RequestBounds.of(config, self.max_model_len), self.model_config.hidden_size)
        self._fingerprint: str | None = None
        self.step_failures, self.last_step_error = 0, ""  # steps that raised and failed their requests (_fail_step)
        self._fingerprint_lock = threading.Lock()
        logger.info("model %s (%s, %s on %s): %d layers; %d LoRA slots, host tier %d, max rank %d, %s LoRA "
                    "kernels; KV cache %d blocks x %d tokens (%.1f MiB)", self.model_name,
                    self.model_config.architecture, self.dtype, self.device, self.model_config.num_layers,
                    config.max_loras, config.max_cpu_loras, config.max_lora_rank, self.lora_kernels, num_blocks,
                    config.block_size, num_blocks * block_bytes / 2**20)
        row_bytes = self.model_config.hidden_size * self.model.embed_tokens.weight.element_size()
        logger.info("%s", self.adapters.budget.describe(row_bytes * self.model_config.vocab_size, row_bytes))
        install_faults(self)  # tests only: nothing unless LORAPLEX_TEST_FAULTS is set (engine/checks/faults.py)

    # ---- adapters (any thread) ----
    def load_adapter(self, name: str, path: str | Path | None = None, *,
                     tensors: Mapping[str, torch.Tensor] | None = None, config: Mapping | str | None = None,
                     new_version: bool = False,
                     roots: Sequence[str] | None = None) -> AdapterInfo:
        """A new version of ``name`` from the PEFT folder ``path``, or from ``tensors`` (PEFT state-dict keys ->
        tensors) and ``config`` (``adapter_config.json``'s content): exactly one of the two, validated alike
        (the same typed errors). ``new_version`` promotes a loaded name (in-flight keep theirs). ``roots``:
        every file a folder load reads must resolve inside one of these folders (``ForbiddenAdapterPath``)."""
        if (path is None) == (tensors is None) or (tensors is None) != (config is None) or (roots and tensors):
            raise ValueError("load_adapter takes exactly one of path (a folder, with optional roots) and "
                             "tensors (with config)")
        if tensors is not None:
            info = self.adapters.load_tensors(name, tensors, config, new_version)
        else:
            info = self.adapters.load(name, str(path), new_version, roots)
        self._retire_dropped()
        return info

    def unload_adapter(self, name: str) -> None:
        """Retire every version of ``name``: new requests of it fail at once; accepted ones (queued or running)
        finish on theirs, which is freed when the last one ends. Reloading makes a new version."""
        self.adapters.unload(name)
        self._retire_dropped()

    def _retire_dropped(self) -> None:
        """Versions dropped (unloaded and their last request ended): their cached KV blocks are freed next step."""
        for version_id in self.adapters.drain_dropped():
            self._inbox.put(_Retire(version_id))

    def pin_adapter(self, name: str) -> None:
        """Keep ``name``'s current version in a device slot and host memory until ``unpin_adapter`` or unload
        (``AdapterManager.pin``; ``AdapterPinLimit`` past ``max_loras - 1`` pinned names)."""
        self.adapters.pin(name)

    def unpin_adapter(self, name: str) -> None:
        self.adapters.unpin(name)

    def rollback_adapter(self, name: str) -> AdapterInfo:
        """Move ``name`` back to the held version before its current one (else ``AdapterVersionConflict``)."""
        return self.adapters.with_versions(lambda versions: versions.rollback(name))

    def split_adapter(self, name: str, weights: dict[int, float]) -> None:
        """Route ``name``'s new requests among its held versions by ``weights`` (version id -> share)."""
        self.adapters.with_versions(lambda versions: versions.set_split(name, weights))

    def adapter_versions(self) -> list[dict[str, Any]]:
        """Names -> held versions (id, content hash, path, loaded at, requests served), as plain data."""
        return self.adapters.with_versions(lambda versions: versions.listing())

    def base_fingerprint(self) -> str:
        """The base checkpoint's fingerprint (``checkpoint_fingerprint``), computed on first call."""
        with self._fingerprint_lock:
            if self._fingerprint is None:
                self._fingerprint = checkpoint_fingerprint(self.model_path)
            return self._fingerprint

    def list_adapters(self) -> list[AdapterInfo]:
        return self.adapters.list()

    def adapter_snapshot(self) -> dict[str, Any]:
        """The adapter tiers at one instant, JSON-serialisable (``GET /v1/slots``; ``adapters/snapshot.py``)."""
        return self.adapters.snapshot()

    def info(self) -> EngineInfo:
        """The served model, as a frontend needs it (plain data)."""
        return EngineInfo(model_name=self.model_name, model_path=str(self.model_path),
                          max_model_len=self.max_model_len, vocab_size=self.model_config.vocab_size,
                          dtype=str(self.dtype), device=str(self.device), has_tokenizer=self.tokenizer is not None)

    def version_view(self) -> VersionView:
        """The adapter version table as plain data: what a frontend routes names with (``client/directory.py``)."""
        return self.adapters.version_view()

    def tokenizer_of(self, version_id: int | None) -> PreTrainedTokenizerBase | None:
        """The tokenizer of adapter version ``version_id`` (its own if it ships one, else the base model's)."""
        return self.intake.version(version_id)[0]

    # ---- requests (any thread) ----
    def add_request(self, request_id: str | None, prompt_token_ids: list[int], params: SamplingParams,
                    version_id: int | None = None, tags: RequestTags = NO_TAGS, plan: Plan | None = None) -> str:
        """Validate and queue one request (``add_requests`` of one; ``plan``: ``NewRequest.plan``); returns its id."""
        return self.add_requests([NewRequest(request_id, prompt_token_ids, params, version_id, plan)], tags)[0]

    def add_requests(self, items: Sequence[NewRequest], tags: RequestTags = NO_TAGS) -> list[str]:
        """Validate every ``NewRequest``, then queue them all at once, so they are admitted together (the
        choices of an ``n > 1`` request, the prompts of a prompt list); raises before anything is queued
        (``UnknownAdapter`` for a version no longer held, ``RequestError`` naming the field, ``QueueFull``
        past ``max_waiting_requests``). Each request is one choice (fan out with ``params.choices()``) and
        holds its adapter version until it finishes (``intake.py``), even if unloaded meanwhile. ``tags``:
        admission order (``scheduler/fair_share.py``). Returns their ids."""
        with self.waiting_bound.admitting(len(items)):  # QueueFull before anything is held; undone on error
            requests = self.intake.make_all(items, tags)
        self._inbox.put(requests)
        return [r.request_id for r in requests]

    def abort_request(self, request_id: str) -> None:
        self._inbox.put(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or not self._inbox.empty() or len(self._compiling) > 0

    def stats(self) -> EngineStats:
        return collect_stats(self.config, self.scheduler, self.allocator, self.adapters, self.step_failures)

    # ---- the step loop (one thread) ----
    def step(self) -> list[EngineOutput]:
        outputs = self._drain_inbox()
        outputs += self._fail_broken_adapters()
        batch = self.scheduler.schedule()
        if not batch:
            return outputs
        if self._step_delay:
            time.sleep(self._step_delay)
        try:
            kept, tokens = self._run(batch, outputs)
        except BaseException as exc:
            self.scheduler.undo(batch)  # nothing of this step may be reused or counted
            if isinstance(exc, AssertionError) or not isinstance(exc, Exception):
                raise  # a debug check caught an engine bug, or the thread is being stopped
            return outputs + self._fail_step(batch, exc)
        for request in self.scheduler.update(kept, tokens):
            if request.finished:
                self._requests.pop(request.request_id, None)
            outputs.append(request.output())
        self._retire_dropped()
        return outputs

    def _run(self, batch: list[ScheduledRequest], outputs: list[EngineOutput]) -> tuple[list[ScheduledRequest],
                                                                                         list[int | list[int]]]:
        """Run ``batch``'s forward pass and draw its tokens. A row whose logits are not finite fails its request
        alone (appended to ``outputs``); returns the rest of the batch and what they drew, in order: a token,
        or for a row that verified a draft its accepted run (``accept_drafts``). A draft's tokens run after the
        row's own, under the row's adapter, and every one of its positions gets a logits row."""
        entries = [StepEntry(tuple(s.request.all_token_ids[s.start:s.start + s.num_tokens]) + s.draft, s.start,
                             tuple(s.request.block_table),
                             bool(s.draft) or needs_prompt_rows(s.request, s.start, s.num_tokens),
                             pooled=s.request.pool is not None)
                   for s in batch]
        mapping = step_mapping(batch)
        lora = self.adapters.lora_batch(mapping)
        if self.config.debug_checks:
            check_right_weights(self.adapters, mapping, lora)
            check_right_kv(self.allocator, self.scheduler.running, [s.request for s in batch])
        pooling = PoolingPlan.of([(s.request.params.pooling, s.start, s.num_tokens, len(s.request.prompt_token_ids),
                                   len(e.token_ids)) for s, e in zip(batch, entries, strict=True)])  # None: none pools
        with torch.inference_mode():
            if pooling is None:
                logits = self.runner.execute(entries, lora)  # [R, vocab]
            else:
                logits, hidden = self.runner.execute_pooled(entries, lora, pooling.rows)  # [R, vocab], [H, hidden]
            ends = list(itertools.accumulate(e.num_logits for e in entries))  # logits row after each entry's
            bad = self._nonfinite_entries(logits, entries, ends)
            if pooling is not None:
                bad |= pooling.nonfinite(hidden)
                pooling.accumulate(hidden, [None if i in bad else s.request.pool for i, s in enumerate(batch)])
            outputs += self._fail_rows(batch, bad)
            kept = [i for i in range(len(batch)) if i not in bad]
            for i in (i for i in kept if entries[i].all_logits and not batch[i].draft):
                add_prompt_logprobs(batch[i].request, batch[i].start, logits[ends[i] - entries[i].num_logits : ends[i]])
            drawing = [i for i in kept if batch[i].draws]
            plain = [i for i in drawing if not batch[i].draft]
            drafted = [i for i in drawing if batch[i].draft]
            drawn: dict[int, int | list[int]] = dict(zip(plain, sample_rows(
                logits, [ends[i] - 1 for i in plain], [batch[i].request for i in plain],
                self.model_config.eos_token_ids), strict=True))
            drawn.update(zip(drafted, accept_drafts(logits, [ends[i] - entries[i].num_logits for i in drafted],
                                                    [batch[i].draft for i in drafted],
                                                    [batch[i].request for i in drafted]), strict=True))
        return [batch[i] for i in kept], [drawn[i] for i in drawing]

    @staticmethod
    def _nonfinite_entries(logits: torch.Tensor, entries: list[StepEntry], ends: list[int]) -> set[int]:
        """The entries with a NaN or +inf in any of their logits rows (``nonfinite_rows``; one check per step)."""
        rows = nonfinite_rows(logits)  # [R]
        if not bool(rows.any()):
            return set()
        return {i for i, e in enumerate(entries) if bool(rows[ends[i] - e.num_logits : ends[i]].any())}

    def _fail_rows(self, batch: list[ScheduledRequest], bad: set[int]) -> list[EngineOutput]:
        """The rows ``bad`` of ``batch`` computed NaN or inf: their requests fail alone (``EngineStepFailed``; the
        keys the step entered for their blocks are forgotten, their blocks and pins returned); the step's other
        rows are committed. Counted in ``step_failures``."""
        outputs = []
        for i in sorted(bad):
            request = batch[i].request
            whose = "the base model's" if request.version_id is None else f"adapter version {request.version_id}'s"
            self.last_step_error = (f"non-finite logits (NaN or inf) in this request's row: {whose} values "
                                    "overflowed float32 on this input, or its weights are broken")
            logger.error("engine step: request %s failed alone: %s", request.request_id, self.last_step_error)
            self.scheduler.forget_step_keys(request)
            outputs.append(self._finish(request, "error", EngineStepFailed(
                f"{self.last_step_error}; the step's other requests were served")))
        self.step_failures += bool(bad)
        return outputs

    def _drain_inbox(self) -> list[EngineOutput]:
        outputs = []
        while not self._inbox.empty():
            item = self._inbox.get()
            if isinstance(item, list):  # requests submitted together
                self.waiting_bound.drained(len(item))
                self._requests.update((request.request_id, request) for request in item)
                for request in self._compiling.hold(item):
                    self.scheduler.add(request)
            elif isinstance(item, _Retire):
                self.allocator.retire(item.version_id)
                if self.scheduler.speculator is not None:
                    self.scheduler.speculator.retire(item.version_id)
                release_free_memory()  # its weights were freed: hand the pages back (engine/memory.py)
            elif (request := self._requests.get(item)) is not None:
                self._compiling.remove(request)
                outputs.append(self._finish(request, "abort"))
        ready, failed = self._compiling.released()
        for request in (r for group in ready for r in group):
            self.scheduler.add(request)
        return outputs + [self._finish(request, "error", error) for request, error in failed]

    def _fail_broken_adapters(self) -> list[EngineOutput]:
        """Requests whose adapter version can no longer be served (e.g. its files changed) fail alone."""
        outputs = []
        for request in list(self.scheduler.waiting):
            if request.pinned:  # a pinned version stays servable
                continue
            error = next(filter(None, map(self.adapters.failure, request.members)), None)
            if error is not None:
                outputs.append(self._finish(request, "error", error))
        return outputs

    def _fail_step(self, batch: list[ScheduledRequest], exc: Exception) -> list[EngineOutput]:
        """The step of ``batch`` raised (after ``undo``): its requests fail with ``EngineStepFailed``; their
        blocks and pins are returned and every other request keeps running. Counted in ``step_failures``."""
        self.step_failures += 1
        self.last_step_error = f"{type(exc).__name__}: {exc}"
        logger.error("engine step failed; failing its %d requests: %s", len(batch), self.last_step_error,
                     exc_info=exc)
        error = EngineStepFailed(f"the engine step running this request failed ({self.last_step_error}); "
                                 "other requests keep running")
        return [self._finish(s.request, "error", error) for s in batch if not s.request.finished]

    def _finish(self, request: Request, reason: str, error: LoraplexError | None = None) -> EngineOutput:
        """End a request outside the step's own bookkeeping (abort, broken adapter)."""
        self.scheduler.finish(request, reason)
        request.error = error
        self._requests.pop(request.request_id, None)
        return request.output()
