"""Driving an ``Engine`` directly, as a frontend does: route the adapter name to its current version once,
tokenize a text prompt with that version's tokenizer, submit token ids and the version id; collect the
engine's outputs (new token ids per step) into each request's whole progress."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from loraplex.engine.engine import Engine
from loraplex.engine.request import NO_TAGS, EngineOutput, RequestTags, SamplingParams
from loraplex.errors import LoraplexError


def add(engine: Engine, request_id: str | None, prompt: str | list[int], params: SamplingParams,
        adapter: str | None = None, tags: RequestTags = NO_TAGS) -> str:
    """``engine.add_request`` for ``adapter``'s current version (None: the base model)."""
    version_id = engine.adapters.resolve(adapter) if adapter is not None else None
    if isinstance(prompt, str):
        prompt = engine.tokenizer_of(version_id).encode(prompt, add_special_tokens=False)
    return engine.add_request(request_id, prompt, params, version_id, tags)


@dataclass
class Progress:
    """One request's outputs so far, accumulated."""

    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    error: LoraplexError | None = None


def gather(outputs: Iterable[EngineOutput], results: dict[str, Progress]) -> list[EngineOutput]:
    """Fold ``outputs`` into ``results``; returns them."""
    outputs = list(outputs)
    for out in outputs:
        progress = results.setdefault(out.request_id, Progress())
        progress.token_ids += out.new_token_ids
        progress.finished, progress.finish_reason, progress.error = out.finished, out.finish_reason, out.error
    return outputs


def run_to_end(engine: Engine, results: dict[str, Progress]) -> None:
    while engine.has_unfinished_requests():
        gather(engine.step(), results)


def capture_step_logits(engine: Engine) -> list[torch.Tensor]:
    """Record every step's logits (``[R, vocab]``, in step order) from now on: the returned list fills as the
    engine steps."""
    captured: list[torch.Tensor] = []
    execute = engine.runner.execute
    engine.runner.execute = lambda entries, lora: captured.append(execute(entries, lora)) or captured[-1]
    return captured
