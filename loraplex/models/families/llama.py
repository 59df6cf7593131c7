"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2) over a flat ragged batch; the base of the
pre-norm families that differ from it only in what they declare (Qwen3, Phi-3, SmolLM3, Granite).

Block: ``h = x + o_proj(attn(rope(qkv_proj(rms(x)))))``, ``out = h + down(act(gate(rms(h))) * up(rms(h)))``.
GQA with ``num_kv_heads`` K/V heads; Qwen2 adds q/k/v bias; embeddings tied or untied; layers with a
sliding window (Mistral, Qwen2 with ``use_sliding_window``) attend within it. The seven adapted
projections are packed into four ``LoRALinear`` layers (``qkv_proj``, ``o_proj``, ``gate_up_proj``,
``down_proj``); each reads the step's ``LoRABatch``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from loraplex.config import ModelConfig
from loraplex.layers.attention import AttentionMetadata
from loraplex.layers.mlp import GatedMLP
from loraplex.layers.self_attention import SelfAttention
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


class LlamaDecoderLayer(nn.Module):
    """A pre-norm block: ``h = x + m * attn(input_layernorm(x))``, ``out = h + m * mlp(post_attention_layernorm(h))``
    with ``m = model.residual_multiplier`` (None: no multiply; Granite's ``residual_multiplier``)."""

    def __init__(self, model: LlamaForCausalLM, index: int) -> None:
        super().__init__()
        cfg = model.config
        self.input_layernorm = model.rms_norm(cfg.hidden_size)
        self.self_attn = SelfAttention(
            model.lora_linear("qkv_proj", cfg.hidden_size, bias=cfg.attention_bias),
            model.lora_linear("o_proj", cfg.num_heads * cfg.head_dim),
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, window=cfg.layer_window(index),
            scale=model.attention_scale,
            qk_norms=(model.rms_norm(cfg.head_dim), model.rms_norm(cfg.head_dim)) if model.qk_norm else None,
            rotary_dim=cfg.rotary_dim if model.layer_uses_rope(index) else 0,
        )
        self.post_attention_layernorm = model.rms_norm(cfg.hidden_size)
        self.mlp_name = model.mlp_name
        self.add_module(self.mlp_name, model.make_mlp(index))
        self.residual_multiplier = model.residual_multiplier

    @property
    def mlp(self) -> nn.Module:
        """The block's MLP, registered under the checkpoint's name (``mlp``; GraniteMoE: ``block_sparse_moe``)."""
        if self.mlp_name not in self._modules:
            raise AttributeError("mlp")  # not registered yet (``add_module`` asks)
        return self._modules[self.mlp_name]

    def adapted(self) -> tuple[nn.Module, ...]:
        """The packed LoRA layers of this block, in ``packed_projections`` order."""
        return (self.self_attn.qkv_proj, self.self_attn.o_proj, *self.mlp.adapted())

    def forward(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn: AttentionMetadata,
                kv_cache: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        hidden, mlp_out = self.residual_forward(hidden, None, rope, attn, kv_cache, lora)
        return hidden + mlp_out

    def residual_forward(self, hidden: torch.Tensor, pending: torch.Tensor | None,
                         rope: tuple[torch.Tensor, torch.Tensor], attn: AttentionMetadata, kv_cache: torch.Tensor,
                         lora: LoRABatch | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The block with the last residual add left to the caller: the block's input is ``hidden + pending``
        (``hidden`` when ``pending`` is None; ``pending`` is given up: it may be overwritten), its output
        ``h + mlp_out`` for the returned ``(h, mlp_out)``. Each add runs fused with the norm after it."""
        if pending is None:
            normed = self.input_layernorm(hidden)
        else:
            hidden, normed = self.input_layernorm.add_and_norm(pending, hidden)
        attended = self.self_attn(normed, *rope, attn, kv_cache, lora)
        if self.residual_multiplier is not None:
            attended.mul_(self.residual_multiplier)  # HF: residual + out * m
        hidden, normed = self.post_attention_layernorm.add_and_norm(attended, hidden)
        mlp_out = self.mlp(normed, lora)
        if self.residual_multiplier is not None:
            mlp_out.mul_(self.residual_multiplier)
        return hidden, mlp_out


class LlamaForCausalLM(CausalLM):
    """Serves ``LlamaForCausalLM``, ``MistralForCausalLM`` and ``Qwen2ForCausalLM`` checkpoints."""

    config_class = LlamaFamilyConfig
    packed_projections = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("o_proj", ("o_proj",)),
                          ("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",)))
    qk_norm: ClassVar[bool] = False  # per-head RMSNorm on q and k before rope (Qwen3)
    attention_scale: float | None = None  # None: 1 / sqrt(head_dim) (Granite: attention_multiplier)
    residual_multiplier: float | None = None  # multiplies each block's attention and MLP output (Granite)
    mlp_name: ClassVar[str] = "mlp"  # the MLP's module name in the checkpoint

    def make_layer(self, index: int) -> LlamaDecoderLayer:
        return LlamaDecoderLayer(self, index)

    def make_mlp(self, index: int) -> GatedMLP:
        """Block ``index``'s MLP, called as ``mlp(x, lora)``; ``mlp.adapted()`` lists its packed LoRA layers
        (a mixture-of-experts family returns its sparse block here)."""
        cfg = self.config
        return GatedMLP(self.lora_linear("gate_up_proj", cfg.hidden_size),
                        self.lora_linear("down_proj", cfg.intermediate_size), cfg.hidden_act)

    def layer_uses_rope(self, index: int) -> bool:
        """Whether block ``index`` rotates q and k (SmolLM3's NoPE layers do not)."""
        return True

    def run_layers(self, hidden: torch.Tensor, rope: Any, attn: AttentionMetadata, kv_caches: Sequence[torch.Tensor],
                   lora: LoRABatch | None) -> torch.Tensor:
        """Each block's last residual add fused with the next block's first norm (``residual_forward``)."""
        pending = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, pending = layer.residual_forward(hidden, pending, rope, attn, kv_cache, lora)
        return hidden if pending is None else hidden + pending
