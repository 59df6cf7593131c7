"""Architecture name (``config.json``'s ``architectures[0]``) -> model family, imported lazily.

Adding a family is one file in ``models/families/`` plus one line here (see ``docs/adding-a-model.md``).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from loraplex.config import ModelConfig, read_hf_config
from loraplex.errors import ModelError
from loraplex.models.base import CausalLM
from loraplex.models.gguf.source import find_gguf

# name -> "module:ClassName"; SmolLM2 checkpoints declare LlamaForCausalLM.
_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "loraplex.models.families.llama:LlamaForCausalLM",
    "MistralForCausalLM": "loraplex.models.families.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "loraplex.models.families.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "loraplex.models.families.qwen3:Qwen3ForCausalLM",
    "Gemma3ForCausalLM": "loraplex.models.families.gemma3:Gemma3ForCausalLM",
    "Phi3ForCausalLM": "loraplex.models.families.phi3:Phi3ForCausalLM",
    "Gemma2ForCausalLM": "loraplex.models.families.gemma2:Gemma2ForCausalLM",
    "GraniteForCausalLM": "loraplex.models.families.granite:GraniteForCausalLM",
    "SmolLM3ForCausalLM": "loraplex.models.families.smollm3:SmolLM3ForCausalLM",
    "Qwen3MoeForCausalLM": "loraplex.models.families.qwen3_moe:Qwen3MoeForCausalLM",
    "GraniteMoeForCausalLM": "loraplex.models.families.granite_moe:GraniteMoeForCausalLM",
}


def supported_architectures() -> tuple[str, ...]:
    return tuple(_ARCHITECTURES)


def model_class(architecture: str) -> type[CausalLM]:
    """The class serving ``architecture``; ``ModelError`` naming it if none does."""
    target = _ARCHITECTURES.get(architecture)
    if target is None:
        raise ModelError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(_ARCHITECTURES)}"
        )
    module_name, class_name = target.split(":")
    return getattr(importlib.import_module(module_name), class_name)


def model_config(source: str | Path | Mapping[str, Any]) -> ModelConfig:
    """``config.json`` (a dict, a file or a folder holding one; or a GGUF model's metadata) normalised by its
    family's config class;
    ``ModelError`` for an unsupported architecture."""
    if not isinstance(source, Mapping) and (gguf := find_gguf(source)) is not None:
        from loraplex.models.gguf.metadata import hf_config

        source = hf_config(gguf)
    raw = read_hf_config(source)
    architecture = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
    return model_class(architecture).config_class.from_hf(raw)
