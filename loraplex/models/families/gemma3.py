"""Gemma 3 text (``Gemma3ForCausalLM``: the 270M and 1B checkpoints) over a flat ragged batch.

Block: ``h = x + post_attention_norm(attn(input_norm(x)))``,
``out = h + post_feedforward_norm(down(gelu_tanh(gate(y)) * up(y)))`` with ``y = pre_feedforward_norm(h)``.
Every RMSNorm computes ``(1 + w) * x_normalised`` (``norm_offset``); embeddings are scaled by
``sqrt(hidden)``; attention has a per-head ``(1 + w)`` RMSNorm on q and k, the scale
``query_pre_attn_scalar ** -0.5``, and alternates local layers (sliding window, rope base
``rope_local_base_freq``) with global ones (full attention, base ``rope_theta``, their own scaling).
Final-logit soft-capping when the config sets it (released Gemma 3 configs do not):
``tanh(z / final_logit_softcapping) * final_logit_softcapping``. ``attn_logit_softcapping`` is read but, as in
HF transformers 5 (whose ``Gemma3Attention`` stores it and never passes it on), not applied to Gemma 3's
attention; Gemma 2 applies it (``attention_softcap``). The projections and PEFT target names are Llama's seven.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from loraplex.config import ModelConfig, RopeScaling
from loraplex.errors import ModelError
from loraplex.layers.attention import AttentionMetadata
from loraplex.layers.lora_linear import LoRALinear
from loraplex.layers.mlp import GatedMLP
from loraplex.layers.rotary import RotaryEmbedding
from loraplex.layers.self_attention import SelfAttention
from loraplex.layers.softcap import soft_cap
from loraplex.models.base import CausalLM
from loraplex.models.families.llama import LlamaForCausalLM
from loraplex.ops.lora_batch import LoRABatch

# What Gemma3TextConfig assumes for a key a config.json leaves out
_HF_DEFAULTS = {"hidden_activation": "gelu_pytorch_tanh", "head_dim": 256, "query_pre_attn_scalar": 256,
                "sliding_window": 4096, "sliding_window_pattern": 6, "tie_word_embeddings": True,
                "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "max_position_embeddings": 131_072}
_REFUSED = ("use_bidirectional_attention",)


def _softcap(raw: Mapping[str, Any], key: str) -> float | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ModelError(f"{key} must be a positive number or null, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Gemma3Config(ModelConfig):
    """``rope_theta``/``rope_scaling`` are the global layers'; the local layers have their own."""

    query_pre_attn_scalar: float = 256.0
    local_rope_theta: float = 10_000.0
    local_rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    @classmethod
    def normalise(cls, raw: Mapping[str, Any]) -> dict[str, Any]:
        for key in _REFUSED:
            if raw.get(key):
                raise ModelError(f"Gemma 3 with {key}={raw[key]!r} is not supported")
        raw = {**_HF_DEFAULTS, **raw}
        softcaps = {key: _softcap(raw, key) for key in ("attn_logit_softcapping", "final_logit_softcapping")}
        fields = super().normalise({**raw, "hidden_act": raw["hidden_activation"]})
        nested = raw.get("rope_parameters") or {}
        if "full_attention" in nested or "sliding_attention" in nested:  # transformers >= 5 writes these
            full, local = nested.get("full_attention") or {}, nested.get("sliding_attention") or {}
            global_theta = full.get("rope_theta") or raw["rope_theta"]
            local_theta = local.get("rope_theta") or raw["rope_local_base_freq"]
        else:  # older files: rope_scaling (if any) applies to the global layers only
            full, local = raw.get("rope_scaling") or {}, {}
            global_theta, local_theta = raw["rope_theta"], raw["rope_local_base_freq"]
        return {**fields, "rope_theta": float(global_theta), "rope_scaling": RopeScaling.from_hf(raw, full),
                "local_rope_theta": float(local_theta), "local_rope_scaling": RopeScaling.from_hf(raw, local),
                "query_pre_attn_scalar": float(raw["query_pre_attn_scalar"]), **softcaps}


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, model: Gemma3ForCausalLM, index: int) -> None:
        super().__init__()
        cfg: Gemma3Config = model.config
        self.layer_type = cfg.layer_types[index] if cfg.layer_types else "full_attention"
        self.input_layernorm = model.rms_norm(cfg.hidden_size)
        self.self_attn = SelfAttention(
            model.lora_linear("qkv_proj", cfg.hidden_size, bias=cfg.attention_bias),
            model.lora_linear("o_proj", cfg.num_heads * cfg.head_dim),
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, window=cfg.layer_window(index),
            scale=cfg.query_pre_attn_scalar**-0.5,
            qk_norms=(model.rms_norm(cfg.head_dim), model.rms_norm(cfg.head_dim)) if model.qk_norm else None,
            softcap=cfg.attn_logit_softcapping if model.attention_softcap else None,
        )
        self.post_attention_layernorm = model.rms_norm(cfg.hidden_size)
        self.pre_feedforward_layernorm = model.rms_norm(cfg.hidden_size)
        self.mlp = GatedMLP(model.lora_linear("gate_up_proj", cfg.hidden_size),
                            model.lora_linear("down_proj", cfg.intermediate_size), cfg.hidden_act)
        self.post_feedforward_layernorm = model.rms_norm(cfg.hidden_size)

    def adapted(self) -> tuple[LoRALinear, ...]:
        return (self.self_attn.qkv_proj, self.self_attn.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj)

    def forward(self, hidden: torch.Tensor, rope: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                attn: AttentionMetadata, kv_cache: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        cos, sin = rope[self.layer_type]
        attended = self.self_attn(self.input_layernorm(hidden), cos, sin, attn, kv_cache, lora)
        hidden = hidden + self.post_attention_layernorm(attended)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden), lora))


class Gemma3ForCausalLM(CausalLM):
    """Serves ``Gemma3ForCausalLM`` checkpoints (text only; the multimodal 4B+ ones are another class)."""

    config_class = Gemma3Config
    packed_projections = LlamaForCausalLM.packed_projections
    norm_offset = 1.0
    scale_embeddings = True
    qk_norm: ClassVar[bool] = True  # per-head (1 + w) RMSNorm on q and k (Gemma 2 has none)
    attention_softcap: ClassVar[bool] = False  # apply attn_logit_softcapping (Gemma 2; HF's Gemma 3 does not)

    def __init__(self, model_config: Gemma3Config, max_loras: int, max_lora_rank: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__(model_config, max_loras, max_lora_rank, dtype, device)
        local = (model_config.local_rope_theta, model_config.local_rope_scaling)
        self.local_rotary = (None if local == (model_config.rope_theta, model_config.rope_scaling)
                             else RotaryEmbedding(model_config, device, *local))  # None: the global one serves

    def make_layer(self, index: int) -> Gemma3DecoderLayer:
        return Gemma3DecoderLayer(self, index)

    def rope_tables(self, positions: torch.Tensor, seq_lens: torch.Tensor,
                    dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``(cos, sin)`` per layer type present: global layers use ``rotary``, local ones ``local_rotary``."""
        tables = {"full_attention": self.rotary.cos_sin(positions, seq_lens, dtype)}
        types = {layer.layer_type for layer in self.layers}
        if "sliding_attention" in types:
            tables["sliding_attention"] = (tables["full_attention"] if self.local_rotary is None
                                           else self.local_rotary.cos_sin(positions, seq_lens, dtype))
        return tables

    def logits(self, hidden: torch.Tensor, logits_rows: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        """``CausalLM.logits``, soft-capped when ``final_logit_softcapping`` is set."""
        logits = super().logits(hidden, logits_rows, lora)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else soft_cap(logits, cap)
