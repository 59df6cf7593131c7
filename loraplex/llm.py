"""The offline API: ``LLM(...).generate(prompts, SamplingParams, adapters=[...])``.

A frontend like the server's clients, driving the engine's ``step()`` itself: each prompt's adapter name
is routed to a version once, first (``AdapterDirectory``), the prompt is tokenized with that version's
tokenizer, every choice is queued in one ``Engine.add_requests`` call (token ids and version ids), and
the engine's outputs go through the same ``OutputProcessor`` (detokenization, stop strings) as the
server's; a stop string found there aborts its request in the engine before the next step.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from loraplex.adapters.info import AdapterInfo
from loraplex.client.adapter_mix import AdapterMix, mixed
from loraplex.client.directory import Version
from loraplex.client.inproc import engine_directory, sync_directory
from loraplex.client.output import ClassificationOutput, EmbeddingOutput, OutputProcessor, RequestOutput
from loraplex.config import EngineConfig
from loraplex.engine.engine import Engine
from loraplex.engine.pooling.params import CLASSIFICATION, PoolingParams
from loraplex.engine.request import NewRequest, SamplingParams
from loraplex.engine.stats import EngineStats
from loraplex.errors import RequestError
from loraplex.models.pooling_config import model_pooling


class LLM:
    """A base model plus runtime-loaded LoRA adapters, driven through the same ``step()`` a server uses.

    ``LLM(model="smollm2-135m-instruct", max_loras=4, max_cpu_loras=16, max_lora_rank=16)``; any
    other ``EngineConfig`` field may be passed by name.
    """

    def __init__(self, model: str = EngineConfig.model, **kwargs: Any) -> None:
        known = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown LLM option(s) {unknown}; valid: {sorted(known)}")
        self.engine = Engine(EngineConfig(model=model, **kwargs))
        self.directory = engine_directory(self.engine)
        self._ids = itertools.count()

    @property
    def tokenizer(self):  # noqa: ANN201 - a transformers tokenizer
        return self.engine.tokenizer

    def load_adapter(self, name: str, path: str | Path | None = None, *,
                     tensors: Mapping[str, torch.Tensor] | None = None, config: Mapping | str | None = None,
                     new_version: bool = False) -> AdapterInfo:
        """Validate and register a PEFT adapter: the folder ``path``, or ``tensors`` (PEFT state-dict keys, as in
        ``adapter_model.safetensors``) with ``config`` (``adapter_config.json``'s content as a dict): exactly
        one of the two. Raises ``loraplex.AdapterError`` subclasses. ``new_version``: a loaded ``name`` moves
        to the new version (requests in flight keep theirs)."""
        return self.engine.load_adapter(name, path, tensors=tensors, config=config, new_version=new_version)

    def unload_adapter(self, name: str) -> None:
        self.engine.unload_adapter(name)

    def pin_adapter(self, name: str) -> None:
        """Keep ``name``'s current version in a device slot and its host copy until ``unpin_adapter`` or unload;
        at most ``max_loras - 1`` names may be pinned (``AdapterPinLimit`` past that)."""
        self.engine.pin_adapter(name)

    def unpin_adapter(self, name: str) -> None:
        self.engine.unpin_adapter(name)

    def list_adapters(self) -> list[AdapterInfo]:
        return self.engine.list_adapters()

    def stats(self) -> EngineStats:
        """The engine's counters: queue, slots, KV blocks, adapter tiers, prefix-cache hits."""
        return self.engine.stats()

    def current_version(self, adapter: str | None) -> Version:
        """The version ``adapter`` serves now (its tokenizer and chat template included), without routing."""
        sync_directory(self.directory, self.engine)
        return self.directory.current(adapter)

    def tokenize(self, prompt: str | list[int], adapter: str | None = None) -> list[int]:
        """Token ids of ``prompt`` as ``adapter``'s requests see them now (its current version's tokenizer)."""
        return _token_ids(prompt, self.current_version(adapter), self.engine.model_name)

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        adapters: str | AdapterMix | None | Sequence[str | AdapterMix | None] = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; one output per prompt, in prompt order. ``adapters[i]`` names
        prompt i's adapter (None = base model), or an ``AdapterMix`` blending several at their scales (one entry:
        one adapter at a scale); one name, mix or None applies to all. Every request is
        validated before any is queued, so a bad one raises without running the others; all are queued
        together. With ``n > 1`` each choice runs as its own request: ``outs[i]`` is prompt i's first
        choice and ``outs[i].outputs`` holds all ``n`` (vLLM's shape; also filled for ``n == 1``)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = _per_prompt(sampling_params or SamplingParams(), len(prompts), "sampling_params")
        names = _per_prompt(adapters, len(prompts), "adapters")
        sync_directory(self.directory, self.engine)
        versions = [self._route(name) for name in names]  # once per prompt, first
        return self._generate_on(prompts, params, versions, use_tqdm)

    def _generate_on(self, prompts: Sequence[str | list[int]], params: Sequence[SamplingParams],
                     versions: Sequence[Version], use_tqdm: bool) -> list[RequestOutput]:
        """``generate`` of prompts already routed: prompt i runs on ``versions[i]``."""
        processor = OutputProcessor()
        items, ids = [], []
        for prompt, p, version in zip(prompts, params, versions, strict=True):
            token_ids = _token_ids(prompt, version, self.engine.model_name)  # type: ignore[arg-type]
            for choice in p.choices():
                request_id = f"gen-{next(self._ids)}"
                processor.add(request_id, token_ids, choice, version.tokenizer, version.name)
                items.append(NewRequest(request_id, token_ids, choice, version.version_id, version.plan))
                ids.append(request_id)
        self.engine.add_requests(items)  # validates every choice before queuing any
        results = self._run(processor, len(ids), use_tqdm)
        grouped, at = [], 0
        for p in params:
            choices = [replace(results[i], index=j) for j, i in enumerate(ids[at : at + p.n])]
            grouped.append(replace(choices[0], outputs=choices))
            at += p.n
        return grouped

    def _route(self, adapter: str | AdapterMix | None) -> Version:
        """``adapter``'s version: a name's (or the base's), or a mix's, each of its names routed once."""
        if not isinstance(adapter, AdapterMix):
            return self.directory.route(adapter)
        return mixed([self.directory.route(name) for name in adapter.names], [s for _, s in adapter.entries])

    def embed(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        pooling: PoolingParams | None = None,
        adapters: str | None | Sequence[str | None] = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingOutput]:
        """One embedding per prompt, in prompt order: each prompt runs as a prefill-only pooling request
        (``SamplingParams(max_tokens=0, pooling=...)``; default: the model's pooling and normalization, from its
        sentence-transformers config, else last token, normalized) of its adapter, batched with whatever else
        the engine runs. Raises the first request's error."""
        if pooling is None:
            default = model_pooling(self.engine.model_path)
            pooling = PoolingParams(default.pooling_type or "last", default.normalize)
        params = SamplingParams(max_tokens=0, pooling=pooling)
        return [EmbeddingOutput.of(out) for out in self.generate(prompts, params, adapters, use_tqdm)]

    def classify(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        adapters: str | Sequence[str] = (),
        use_tqdm: bool = True,
    ) -> list[ClassificationOutput]:
        """One classification per prompt, in prompt order, by its adapter's classification head (a PEFT
        ``SEQ_CLS`` adapter: ``PoolingParams(classify=True)``, a prefill-only row batched with whatever else runs):
        its logits, softmax probabilities and most probable class name, all of the version it was routed to
        once. Raises ``RequestError`` for an adapter without a head, else the first request's error."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        names = _per_prompt(adapters, len(prompts), "adapters")
        sync_directory(self.directory, self.engine)
        versions = [self._route(name) for name in names]  # once per prompt: its head's labels are that version's
        for name, version in zip(names, versions, strict=True):
            if version.class_labels is None:
                raise RequestError(f"adapter {name!r} has no classification head (a PEFT SEQ_CLS adapter saves "
                                   "'score' or 'classifier' in modules_to_save)", "adapters")
        params = SamplingParams(max_tokens=0, pooling=CLASSIFICATION)
        outs = self._generate_on(prompts, [params] * len(prompts), versions, use_tqdm)  # type: ignore[arg-type]
        return [ClassificationOutput.of(out, version.class_labels or ())
                for out, version in zip(outs, versions, strict=True)]

    def _run(self, processor: OutputProcessor, total: int, use_tqdm: bool) -> dict[str, RequestOutput]:
        """Step until ``total`` requests finished; their final outputs by id."""
        results: dict[str, RequestOutput] = {}
        generated, start = 0, time.perf_counter()
        with tqdm(total=total, desc="generate", unit="req", disable=not use_tqdm or total < 2) as bar:
            while len(results) < total:
                outputs, stopped = processor.process(self.engine.step())
                for request_id in stopped:
                    self.engine.abort_request(request_id)
                for out in outputs:
                    generated += 1
                    if out.finished:
                        results[out.request_id] = out
                        bar.update()
                bar.set_postfix(tok_s=f"{generated / max(time.perf_counter() - start, 1e-9):.1f}")
        return results


def _token_ids(prompt: str | list[int], version: Version, model_name: str) -> list[int]:
    if not isinstance(prompt, str):
        return list(prompt)
    if version.tokenizer is None:
        raise RequestError(f"model {model_name} has no tokenizer: pass token ids", "prompt")
    return version.tokenizer.encode(prompt, add_special_tokens=False)


def _per_prompt(value: Any, n: int, name: str) -> list[Any]:
    if value is None or isinstance(value, (str, SamplingParams, AdapterMix)):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} entries for {n} prompts")
    return values
