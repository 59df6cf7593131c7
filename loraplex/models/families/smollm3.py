"""SmolLM3 (``SmolLM3ForCausalLM``: SmolLM3-3B) over a flat ragged batch: Llama's block in which some
layers use no positional encoding (NoPE): q and k are not rotated there.

``no_rope_layers[i]`` is 1 where block i uses rope, 0 where it does not; a config without the list gets
HF's rule, a NoPE layer every ``no_rope_layer_interval`` (4) layers (blocks 3, 7, 11, ...). With
``use_sliding_window`` (off in the released config) HF makes the NoPE layers the sliding ones.
Tied embeddings; the projections and PEFT target names are Llama's seven. ``attention_bias`` /
``mlp_bias`` (false in the released config) are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from loraplex.config import ModelConfig
from loraplex.errors import ModelError
from loraplex.models.families.llama import LlamaForCausalLM


@dataclass(frozen=True)
class SmolLM3Config(ModelConfig):
    rope_layers: tuple[bool, ...] = ()  # per block: rotates q and k (False = NoPE)

    @classmethod
    def normalise(cls, raw: Mapping[str, Any]) -> dict[str, Any]:
        for key in ("attention_bias", "mlp_bias"):
            if raw.get(key):
                raise ModelError(f"SmolLM3ForCausalLM with {key}=true is not supported")
        layers = int(raw["num_hidden_layers"])
        flags = raw.get("no_rope_layers")
        if flags is None:
            interval = int(raw.get("no_rope_layer_interval", 4))
            flags = [int((i + 1) % interval != 0) for i in range(layers)]
        if len(flags) != layers or any(f not in (0, 1) for f in flags):
            raise ModelError(f"no_rope_layers must hold one 0 or 1 per layer ({layers}), got {flags!r}")
        raw = dict(raw)
        if not raw.get("layer_types"):  # HF: with a window, the NoPE layers slide
            use = raw.get("use_sliding_window") and raw.get("sliding_window") is not None
            raw["layer_types"] = ["sliding_attention" if use and not f else "full_attention" for f in flags]
        return {**super().normalise(raw), "rope_layers": tuple(bool(f) for f in flags)}


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """Serves ``SmolLM3ForCausalLM`` checkpoints (module names as Llama's)."""

    config_class = SmolLM3Config

    def layer_uses_rope(self, index: int) -> bool:
        return self.config.rope_layers[index]
