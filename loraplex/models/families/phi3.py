"""Phi-3 / Phi-3.5-mini / Phi-4-mini (``Phi3ForCausalLM``): a Llama-style block whose projections are fused.

The checkpoint stores ``self_attn.qkv_proj`` (``hidden -> (H + 2 KV) d``, rows q then k then v) and
``mlp.gate_up_proj`` (``hidden -> 2 I``, gate rows then up rows), and PEFT adapters target those
fused names, so the four adaptable projections are ``qkv_proj``, ``o_proj``, ``gate_up_proj`` and
``down_proj``, each its own ``LoRALinear`` (an adapter on ``qkv_proj`` has one A and one B spanning
q, k and v). Rotary: default or LongRoPE (``rope_scaling.type == "longrope"``, short/long factors and
the attention factor; the 128k and 3.5 checkpoints); a ``sliding_window`` (Phi-3-mini-4k: 2047) applies
to every layer, as in HF. Phi-4-mini sets ``partial_rotary_factor`` 0.75: rope (and LongRoPE's factors, 48
of them) covers the first ``int(head_dim * 0.75)`` = 96 of each head's 128 dimensions, the rest pass
through unrotated (HF's Phi-3 ``apply_rotary_pos_emb``).
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.config import ModelConfig, Projection
from loraplex.models.families.llama import LlamaForCausalLM


@dataclass(frozen=True)
class Phi3Config(ModelConfig):
    """Fused projections (``partial_rotary_factor`` is read by ``ModelConfig``)."""

    def projections(self) -> dict[str, Projection]:
        q_out = self.num_heads * self.head_dim
        kv_out = self.num_kv_heads * self.head_dim
        h, i = self.hidden_size, self.intermediate_size
        return {
            "qkv_proj": Projection("self_attn", h, q_out + 2 * kv_out),
            "o_proj": Projection("self_attn", q_out, h),
            "gate_up_proj": Projection("mlp", h, 2 * i),
            "down_proj": Projection("mlp", i, h),
        }


class Phi3ForCausalLM(LlamaForCausalLM):
    """Serves ``Phi3ForCausalLM`` checkpoints: ``layers.N.self_attn.qkv_proj`` and ``layers.N.mlp.gate_up_proj``."""

    config_class = Phi3Config
    packed_projections = (("qkv_proj", ("qkv_proj",)), ("o_proj", ("o_proj",)),
                          ("gate_up_proj", ("gate_up_proj",)), ("down_proj", ("down_proj",)))
