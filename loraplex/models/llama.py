"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over a flat ragged batch.

Block: ``h = x + o_proj(attn(rope(qkv_proj(rms(x)))))``, ``out = h + down(silu(gate(rms(h))) * up(rms(h)))``.
GQA with ``num_kv_heads`` K/V heads; Qwen2 adds q/k/v bias; embeddings tied or untied. The seven
adapted projections are packed into four ``LoRALinear`` layers (``qkv_proj``, ``o_proj``,
``gate_up_proj``, ``down_proj``); each reads the step's ``LoRABatch``. Module names follow HF's
(``embed_tokens``, ``layers.N.self_attn``, ``layers.N.mlp``, ``norm``, ``lm_head``) so the loader maps
checkpoint tensors by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.adapters.batch_indices import LoRABatch
from loraplex.config import ModelConfig
from loraplex.engine.kv_cache import KVCache
from loraplex.layers.lora_linear import LoRALinear
from loraplex.models.adapter_slots import AdapterModules, write_adapter_slot
from loraplex.models.attention import AttentionMetadata, paged_attention
from loraplex.models.rotary import RotaryEmbedding, apply_rotary
from loraplex.ops.dense import dense_linear, pack_weight


class RMSNorm(nn.Module):
    """``y = weight * (x / sqrt(mean(x^2, -1) + eps))``, computed in float32 as HF does; x ``[T, hidden]``."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # no copy for float32
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, max_loras: int, max_lora_rank: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        shapes = cfg.projection_shapes()
        self.qkv_proj = LoRALinear(
            cfg.hidden_size, (shapes["q_proj"][1], shapes["k_proj"][1], shapes["v_proj"][1]),
            ("q_proj", "k_proj", "v_proj"), max_loras, max_lora_rank, bias=cfg.attention_bias,
            dtype=dtype, device=device,
        )
        self.o_proj = LoRALinear(shapes["o_proj"][0], (cfg.hidden_size,), ("o_proj",), max_loras,
                                 max_lora_rank, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionMetadata,
                kv_cache: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        # x: [T, hidden]; cos/sin: [T, 1, d]; kv_cache: [slots, 2, KV, d]
        t = x.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x, lora)  # [T, (H + 2KV) d]
        qk = apply_rotary(qkv[:, : (h + kvh) * d].view(t, h + kvh, d), cos, sin)  # [T, H + KV, d]
        v = qkv[:, (h + kvh) * d :].view(t, kvh, d)  # [T, KV, d]
        out = paged_attention(qk[:, :h], qk[:, h:], v, kv_cache, attn)  # [T, H, d]
        return self.o_proj(out.reshape(t, h * d), lora)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, max_loras: int, max_lora_rank: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = LoRALinear(cfg.hidden_size, (cfg.intermediate_size, cfg.intermediate_size),
                                       ("gate_proj", "up_proj"), max_loras, max_lora_rank,
                                       dtype=dtype, device=device)
        self.down_proj = LoRALinear(cfg.intermediate_size, (cfg.hidden_size,), ("down_proj",), max_loras,
                                    max_lora_rank, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, lora)  # [T, 2I]
        return self.down_proj(F.silu(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate :], lora)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, max_loras: int, max_lora_rank: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = LlamaAttention(cfg, max_loras, max_lora_rank, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = LlamaMLP(cfg, max_loras, max_lora_rank, dtype, device)

    def adapted(self) -> tuple[LoRALinear, ...]:
        """The packed LoRA layers of this block."""
        return (self.self_attn.qkv_proj, self.self_attn.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj)


class LlamaForCausalLM(nn.Module):
    """Serves ``LlamaForCausalLM``, ``MistralForCausalLM`` and ``Qwen2ForCausalLM`` checkpoints.

    Parameters are allocated uninitialised; ``loraplex.models.loader.load_model`` fills them.
    """

    def __init__(self, model_config: ModelConfig, max_loras: int, max_lora_rank: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        cfg = model_config
        self.config = cfg
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, max_loras, max_lora_rank, dtype, device) for _ in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, device=device))
        if self.lm_head is not None:
            self.lm_head.weight.requires_grad_(False)
        self.rotary = RotaryEmbedding(cfg, device)
        # oneDNN-packed lm_head once ``pack_dense()`` ran; the plain one stays (tied: the embedding reads it)
        self.lm_head_packed: torch.Tensor | None = None

    def pack_dense(self) -> None:
        """Pack every base matmul's weight for the CPU GEMM library (``loraplex.ops.dense``); idempotent."""
        for layer in self.layers:
            for linear in layer.adapted():
                linear.pack_dense()
        if self.lm_head_packed is None:
            self.lm_head_packed = pack_weight(self.lm_head_weight)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight  # [vocab, hidden]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv: KVCache, lora: LoRABatch | None, logits_rows: torch.Tensor) -> torch.Tensor:
        """Run a flat ragged batch; return float32 logits ``[S, vocab]`` of the rows ``logits_rows [S]``.

        ``input_ids [T]`` and ``positions [T]`` (int64) list every entry's tokens back to back; the new
        K/V are written into ``kv`` at ``attn.write_rows``; ``lora`` (token order = flat order) is
        passed to every adapted projection.
        """
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary.cos_sin(positions, attn.seq_lens, hidden.dtype)  # [T, 1, d] each
        for i, layer in enumerate(self.layers):
            hidden = hidden + layer.self_attn(layer.input_layernorm(hidden), cos, sin, attn, kv.kv[i], lora)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden), lora)
        last = self.norm(hidden.index_select(0, logits_rows))  # [S, hidden]
        return dense_linear(last, self.lm_head_weight, self.lm_head_packed).float()  # [S, vocab]

    def set_slot(self, slot: int, weights: AdapterModules) -> None:
        """Write an adapter (duck-typed ``AdapterWeights``: ``.modules[(layer, proj)] = (A, B)``) into
        ``slot`` of every adapted layer; validates everything before writing anything."""
        write_adapter_slot(self, slot, weights)

    def clear_slot(self, slot: int) -> None:
        """Zero ``slot`` in every adapted layer (its tokens would then get a zero delta)."""
        if not 0 <= slot < self.max_loras:
            raise IndexError(f"slot {slot} out of range [0, {self.max_loras})")
        for layer in self.layers:
            for linear in layer.adapted():
                linear.clear_slot(slot)
