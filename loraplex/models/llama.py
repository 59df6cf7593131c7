"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2) over a flat ragged batch.

Block: ``h = x + o_proj(attn(rope(qkv_proj(rms(x)))))``, ``out = h + down(silu(gate(rms(h))) * up(rms(h)))``.
GQA with ``num_kv_heads`` K/V heads; Qwen2 adds q/k/v bias; embeddings tied or untied. The seven
adapted projections are packed into four ``LoRALinear`` layers (``qkv_proj``, ``o_proj``,
``gate_up_proj``, ``down_proj``); each reads the step's ``LoRABatch``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.config import ModelConfig
from loraplex.layers.attention import AttentionMetadata, paged_attention
from loraplex.layers.lora_linear import LoRALinear
from loraplex.layers.norms import RMSNorm
from loraplex.layers.rotary import RotaryEmbedding, apply_rotary
from loraplex.models.base import CausalLM
from loraplex.ops.lora_batch import LoRABatch


@dataclass(frozen=True)
class LlamaFamilyConfig(ModelConfig):
    """Qwen2's config has no ``attention_bias``: its q/k/v projections always carry a bias."""

    @classmethod
    def normalise(cls, raw: Mapping[str, Any]) -> dict[str, Any]:
        fields = super().normalise(raw)
        if "attention_bias" not in raw:
            fields["attention_bias"] = fields["architecture"] == "Qwen2ForCausalLM"
        return fields


class LlamaAttention(nn.Module):
    def __init__(self, model: CausalLM) -> None:
        super().__init__()
        cfg = model.config
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = model.lora_linear("qkv_proj", cfg.hidden_size, bias=cfg.attention_bias)
        self.o_proj = model.lora_linear("o_proj", cfg.num_heads * cfg.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionMetadata,
                kv_cache: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        # x: [T, hidden]; cos/sin: [T, 1, d]; kv_cache: one layer's paged cache
        t = x.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x, lora)  # [T, (H + 2KV) d]
        qk = apply_rotary(qkv[:, : (h + kvh) * d].view(t, h + kvh, d), cos, sin)  # [T, H + KV, d]
        v = qkv[:, (h + kvh) * d :].view(t, kvh, d)  # [T, KV, d]
        out = paged_attention(qk[:, :h], qk[:, h:], v, kv_cache, attn)  # [T, H, d]
        return self.o_proj(out.reshape(t, h * d), lora)


class LlamaMLP(nn.Module):
    def __init__(self, model: CausalLM) -> None:
        super().__init__()
        cfg = model.config
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = model.lora_linear("gate_up_proj", cfg.hidden_size)
        self.down_proj = model.lora_linear("down_proj", cfg.intermediate_size)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, lora)  # [T, 2I]
        return self.down_proj(F.silu(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate :], lora)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, model: CausalLM) -> None:
        super().__init__()
        cfg = model.config
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, model.dtype, model.device)
        self.self_attn = LlamaAttention(model)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, model.dtype, model.device)
        self.mlp = LlamaMLP(model)

    def adapted(self) -> tuple[LoRALinear, ...]:
        """The packed LoRA layers of this block, in ``packed_projections`` order."""
        return (self.self_attn.qkv_proj, self.self_attn.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionMetadata,
                kv_cache: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, attn, kv_cache, lora)
        return hidden + self.mlp(self.post_attention_layernorm(hidden), lora)


class LlamaForCausalLM(CausalLM):
    """Serves ``LlamaForCausalLM``, ``MistralForCausalLM`` and ``Qwen2ForCausalLM`` checkpoints."""

    config_class = LlamaFamilyConfig
    packed_projections = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("o_proj", ("o_proj",)),
                          ("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",)))

    def __init__(self, model_config: ModelConfig, max_loras: int, max_lora_rank: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__(model_config, max_loras, max_lora_rank, dtype, device)
        self.rotary = RotaryEmbedding(model_config, device)

    def make_layer(self, index: int) -> LlamaDecoderLayer:
        return LlamaDecoderLayer(self)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_caches: Sequence[torch.Tensor], lora: LoRABatch | None,
                logits_rows: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary.cos_sin(positions, attn.seq_lens, hidden.dtype)  # [T, 1, d] each
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, cos, sin, attn, kv_cache, lora)
        return self.logits(hidden, logits_rows)
