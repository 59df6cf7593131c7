"""The offline API: ``LLM(...).generate(prompts, SamplingParams, adapters=[...])``."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from tqdm import tqdm

from loraplex.adapters.info import AdapterInfo
from loraplex.config import EngineConfig
from loraplex.engine.engine import Engine
from loraplex.engine.request import RequestOutput, SamplingParams


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

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        adapters: str | None | Sequence[str | None] = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order. ``adapters[i]`` names prompt i's
        adapter (None = base model); one name or None applies to all. Every request is validated
        before any is queued, so a bad one raises without running the others."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        n = len(prompts)
        params = self._per_prompt(sampling_params or SamplingParams(), n, "sampling_params")
        names = self._per_prompt(adapters, n, "adapters")
        for name in set(names) - {None}:
            self.engine.adapters.resolve(name)
        token_ids = [self.engine.tokenize(p, a) for p, a in zip(prompts, names, strict=True)]  # type: ignore[arg-type]
        for p in params:
            p.validate()
        ids = [self.engine.add_request(None, t, p, a) for t, p, a in zip(token_ids, params, names, strict=True)]
        results: dict[str, RequestOutput] = {}
        generated = 0
        start = time.perf_counter()
        with tqdm(total=n, desc="generate", unit="req", disable=not use_tqdm or n < 2) as bar:
            while len(results) < n:
                for out in self.engine.step():
                    generated += 1
                    if out.finished:
                        results[out.request_id] = out
                        bar.update()
                bar.set_postfix(tok_s=f"{generated / max(time.perf_counter() - start, 1e-9):.1f}")
        return [results[i] for i in ids]

    @staticmethod
    def _per_prompt(value: Any, n: int, name: str) -> list[Any]:
        if value is None or isinstance(value, (str, SamplingParams)):
            return [value] * n
        values = list(value)
        if len(values) != n:
            raise ValueError(f"{name} has {len(values)} entries for {n} prompts")
        return values
