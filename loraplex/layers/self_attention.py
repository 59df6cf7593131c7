"""A decoder block's attention: one packed (or fused) q/k/v projection, optional per-head q/k RMSNorm,
rotary embeddings (on every head dimension, the first ``rotary_dim`` of them, or none: NoPE layers),
paged attention (full or sliding-window, configurable scale, optional logit soft-capping) and the output
projection. Shared by every family; module names follow HF's (``qkv_proj``/``o_proj`` hold the
projections, ``q_norm``/``k_norm`` the per-head norms)."""

from __future__ import annotations

import torch
from torch import nn

from loraplex.layers.attention import AttentionMetadata, fused_decode_attention, paged_attention
from loraplex.layers.lora_linear import LoRALinear
from loraplex.layers.norms import RMSNorm
from loraplex.layers.rotary import apply_rotary
from loraplex.ops.lora_batch import LoRABatch


class SelfAttention(nn.Module):
    """Semantics: ``[q, k, v] = qkv_proj(x)`` split by heads; ``q, k = rope(q_norm(q)), rope(k_norm(k))``
    (norms per head over ``d``, when given; rope on the first ``rotary_dim`` dims of each head, the rest
    passed through, as HF's Phi-3 does; no rope when ``rotary_dim == 0``);
    ``y = o_proj(paged_attention(q, k, v, window, scale, softcap))``.
    Shapes: x ``[T, hidden]`` -> ``[T, hidden]``; ``qkv_proj`` is ``hidden -> (H + 2 KV) d``. A decode step
    on the CPU with plain full rope (no q/k norms, no soft-capping) takes rotary, the K/V write and
    attention from ``qkv`` in one kernel."""

    def __init__(self, qkv_proj: LoRALinear, o_proj: LoRALinear, num_heads: int, num_kv_heads: int,
                 head_dim: int, window: int | None = None, scale: float | None = None,
                 qk_norms: tuple[RMSNorm, RMSNorm] | None = None, rotary_dim: int | None = None,
                 softcap: float | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.window, self.scale, self.softcap = window, scale, softcap
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        self.qkv_proj, self.o_proj = qkv_proj, o_proj
        self.q_norm, self.k_norm = qk_norms if qk_norms is not None else (None, None)
        self.fused_decode = self.q_norm is None and softcap is None and self.rotary_dim == head_dim

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionMetadata,
                kv_cache: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        # x: [T, hidden]; cos/sin: [T, 1, rotary_dim]; kv_cache: this layer's paged cache
        t = x.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x, lora)  # [T, (H + 2KV) d]
        if self.fused_decode:
            out = fused_decode_attention(qkv, cos, sin, kv_cache, attn, h, self.window, self.scale)
            if out is not None:
                return self.o_proj(out, lora)
        qk = qkv[:, : (h + kvh) * d].view(t, h + kvh, d)  # [T, H + KV, d]
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :h]), self.k_norm(qk[:, h:])), dim=1)
        if self.rotary_dim == d:
            qk = apply_rotary(qk, cos, sin)
        elif self.rotary_dim:
            qk = torch.cat((apply_rotary(qk[..., : self.rotary_dim].contiguous(), cos, sin),
                            qk[..., self.rotary_dim :]), dim=-1)
        v = qkv[:, (h + kvh) * d :].view(t, kvh, d)  # [T, KV, d]
        out = paged_attention(qk[:, :h], qk[:, h:], v, kv_cache, attn, self.window, self.scale,
                              self.softcap)  # [T, H, d]
        return self.o_proj(out.reshape(t, h * d), lora)
