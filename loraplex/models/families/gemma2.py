"""Gemma 2 (``Gemma2ForCausalLM``: 2B, 9B, 27B) over a flat ragged batch: Gemma 3's block without the
q/k norms, one rope base, and logit soft-capping on by default.

Block: ``h = x + post_attention_norm(attn(input_norm(x)))``,
``out = h + post_feedforward_norm(down(gelu_tanh(gate(y)) * up(y)))`` with ``y = pre_feedforward_norm(h)``;
``(1 + w)`` RMSNorms, embeddings times ``sqrt(hidden)``, attention scale ``query_pre_attn_scalar ** -0.5``,
attention scores ``tanh(s / attn_logit_softcapping) * attn_logit_softcapping`` (50 in the released
configs) before the mask, final logits ``tanh(z / final_logit_softcapping) * final_logit_softcapping``
(30). Layers alternate sliding-window (even indices, window 4096 released) and full attention, as HF's
config derives ``layer_types`` when the file has none. The projections and PEFT target names are Llama's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from loraplex.models.families.gemma3 import Gemma3Config, Gemma3ForCausalLM

# What Gemma2Config assumes for a key a config.json leaves out (layers alternate: sliding first)
_HF_DEFAULTS = {"hidden_activation": "gelu_pytorch_tanh", "head_dim": 256, "query_pre_attn_scalar": 256,
                "sliding_window": 4096, "tie_word_embeddings": True, "rope_theta": 10_000.0,
                "max_position_embeddings": 8192, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}


@dataclass(frozen=True)
class Gemma2Config(Gemma3Config):
    """Gemma 3's fields; the local layers share the global rope (``local_rope_*`` equal ``rope_*``)."""

    @classmethod
    def normalise(cls, raw: Mapping[str, Any]) -> dict[str, Any]:
        raw = {**_HF_DEFAULTS, **raw}
        if not raw.get("layer_types"):
            raw["sliding_window_pattern"] = 2  # HF: "sliding_attention" if (i + 1) % 2 else "full_attention"
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        # one rotary for every layer: Gemma 3's parser reads it as the global one and the local one alike
        raw["rope_parameters"] = {"full_attention": rope, "sliding_attention": rope}
        raw["rope_local_base_freq"] = rope.get("rope_theta") or raw["rope_theta"]
        return super().normalise(raw)


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Serves ``Gemma2ForCausalLM`` checkpoints (modules as Gemma 3's, without ``q_norm`` / ``k_norm``)."""

    config_class = Gemma2Config
    qk_norm = False
    attention_softcap = True
