"""IBM Granite 3.x dense (``GraniteForCausalLM``: 2B, 8B) over a flat ragged batch: Llama's block with
four multipliers from the config.

- embeddings times ``embedding_multiplier`` (12 in the released configs);
- attention scale ``attention_multiplier`` (1/64 released; not ``1 / sqrt(head_dim)``);
- each block's attention and MLP outputs times ``residual_multiplier`` before the residual add (0.22);
- logits divided by ``logits_scaling`` (8).

HF's defaults are 1.0 for each. The projections and PEFT target names are Llama's seven (IBM's task
adapters target them). ``attention_bias`` / ``mlp_bias`` (false in every released config) are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from loraplex.config import ModelConfig
from loraplex.errors import ModelError
from loraplex.models.families.llama import LlamaForCausalLM
from loraplex.ops.lora_batch import LoRABatch

MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")


def granite_fields(raw: Mapping[str, Any], family: str) -> dict[str, float]:
    """The four multipliers (HF's default 1.0 each); ``ModelError`` for the biases no released config sets."""
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key):
            raise ModelError(f"{family} with {key}=true is not supported (no released checkpoint sets it)")
    out = {}
    for key in MULTIPLIERS:
        value = raw.get(key, 1.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value == 0:
            raise ModelError(f"{family}: {key} must be a non-zero number, got {value!r}")
        out[key] = float(value)
    return out


@dataclass(frozen=True)
class GraniteConfig(ModelConfig):
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    logits_scaling: float = 1.0

    @classmethod
    def normalise(cls, raw: Mapping[str, Any]) -> dict[str, Any]:
        fields = super().normalise(raw)
        return {**fields, **granite_fields(raw, fields["architecture"])}


class GraniteMultipliers:
    """Granite's embedding, residual, attention and logits multipliers over a Llama-style model (mixed into
    ``GraniteForCausalLM`` and ``GraniteMoeForCausalLM``; ``self.config`` carries the four fields)."""

    config: GraniteConfig

    @property
    def attention_scale(self) -> float:
        return self.config.attention_multiplier

    @property
    def residual_multiplier(self) -> float | None:
        return None if self.config.residual_multiplier == 1.0 else self.config.residual_multiplier

    def embed(self, input_ids: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        """``CausalLM.embed`` times ``embedding_multiplier`` (HF: ``inputs_embeds * embedding_multiplier``)."""
        return super().embed(input_ids, lora) * self.config.embedding_multiplier

    def logits(self, hidden: torch.Tensor, logits_rows: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        """``CausalLM.logits`` divided by ``logits_scaling`` (HF divides; -inf padding stays -inf)."""
        return super().logits(hidden, logits_rows, lora) / self.config.logits_scaling


class GraniteForCausalLM(GraniteMultipliers, LlamaForCausalLM):
    """Serves ``GraniteForCausalLM`` checkpoints (module names as Llama's)."""

    config_class = GraniteConfig
