"""Architecture name (``config.json``'s ``architectures[0]``) -> model class, imported lazily."""

from __future__ import annotations

import importlib

from torch import nn

from loraplex.errors import ModelError

# name -> "module:ClassName"; SmolLM2 checkpoints declare LlamaForCausalLM.
_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "loraplex.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "loraplex.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "loraplex.models.llama:LlamaForCausalLM",
}


def supported_architectures() -> tuple[str, ...]:
    return tuple(_ARCHITECTURES)


def model_class(architecture: str) -> type[nn.Module]:
    """The class serving ``architecture``; ``ModelError`` naming it if none does."""
    target = _ARCHITECTURES.get(architecture)
    if target is None:
        raise ModelError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(_ARCHITECTURES)}"
        )
    module_name, class_name = target.split(":")
    return getattr(importlib.import_module(module_name), class_name)
