"""The offline API: ``LLM(...).generate(prompts, SamplingParams, adapters=[...])``."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from loraplex.adapters.info import AdapterInfo
from loraplex.config import EngineConfig
from loraplex.engine.engine import Engine
from loraplex.engine.request import RequestOutput, SamplingParams
from loraplex.engine.stats import EngineStats


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

    @property
    def tokenizer(self):  # noqa: ANN201 - a transformers tokenizer
        return self.engine.tokenizer

    def load_adapter(self, name: str, path: str | Path) -> AdapterInfo:
        """Validate and register a PEFT adapter folder; raises ``loraplex.AdapterError`` subclasses."""
        return self.engine.load_adapter(name, path)

    def unload_adapter(self, name: str) -> None:
        self.engine.unload_adapter(name)

    def list_adapters(self) -> list[AdapterInfo]:
        return self.engine.list_adapters()

    def stats(self) -> EngineStats:
        """The engine's counters: queue, slots, KV blocks, adapter tiers, prefix-cache hits."""
        return self.engine.stats()

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        adapters: str | None | Sequence[str | None] = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; one output per prompt, in prompt order. ``adapters[i]`` names
        prompt i's adapter (None = base model); one name or None applies to all. Every request is
        validated before any is queued, so a bad one raises without running the others; all are queued
        together. With ``n > 1`` each choice runs as its own request: ``outs[i]`` is prompt i's first
        choice and ``outs[i].outputs`` holds all ``n`` (vLLM's shape; also filled for ``n == 1``)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = self._per_prompt(sampling_params or SamplingParams(), len(prompts), "sampling_params")
        names = self._per_prompt(adapters, len(prompts), "adapters")
        for name in set(names) - {None}:
            self.engine.adapters.resolve(name)
        token_ids = [self.engine.tokenize(p, a) for p, a in zip(prompts, names, strict=True)]  # type: ignore[arg-type]
        items = [(None, t, choice, a) for t, p, a in zip(token_ids, params, names, strict=True)
                 for choice in p.choices()]
        ids = self.engine.add_requests(items)  # validates every choice before queuing any
        results: dict[str, RequestOutput] = {}
        generated = 0
        start = time.perf_counter()
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm or len(ids) < 2) as bar:
            while len(results) < len(ids):
                for out in self.engine.step():
                    generated += 1
                    if out.finished:
                        results[out.request_id] = out
                        bar.update()
                bar.set_postfix(tok_s=f"{generated / max(time.perf_counter() - start, 1e-9):.1f}")
        grouped, at = [], 0
        for p in params:
            choices = [replace(results[i], index=j) for j, i in enumerate(ids[at : at + p.n])]
            grouped.append(replace(choices[0], outputs=choices))
            at += p.n
        return grouped

    @staticmethod
    def _per_prompt(value: Any, n: int, name: str) -> list[Any]:
        if value is None or isinstance(value, (str, SamplingParams)):
            return [value] * n
        values = list(value)
        if len(values) != n:
            raise ValueError(f"{name} has {len(values)} entries for {n} prompts")
        return values
