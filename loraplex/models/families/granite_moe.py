"""IBM GraniteMoE (``GraniteMoeForCausalLM``: granite-3.0/3.1 1b-a400m and 3b-a800m) over a flat ragged
batch: Granite's multipliers (``models.granite``) over Llama's attention, and a sparse mixture of experts in
every block.

Chosen as the second MoE family because its routing differs from Qwen3-MoE's in order, where OLMoE's is
Qwen3-MoE's code exactly (with ``norm_topk_prob`` false): the top-k is taken of the router *logits*, in
float32, and the softmax runs over those k only (``layers.moe``, "topk_softmax"). Its checkpoint also stores
the experts stacked (``block_sparse_moe.input_linear.weight [E, 2I, H]``, ``output_linear.weight [E, H, I]``,
router ``block_sparse_moe.router.layer.weight``) where Qwen3-MoE's stores one module per expert.

Adapters (PEFT 0.21 on transformers 5): LoRA on q/k/v/o through ``target_modules``, on the experts through
``target_parameters`` ``block_sparse_moe.experts.gate_up_proj`` / ``.down_proj`` (transformers 5's names for
``input_linear`` / ``output_linear``). The router is not adaptable here (PEFT's "all-linear" does not reach it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from loraplex.config import ExpertConfig, Projection
from loraplex.layers.moe import MoEExperts, SparseMoE
from loraplex.models.families.granite import GraniteConfig, GraniteMultipliers
from loraplex.models.families.llama import LlamaForCausalLM
from loraplex.models.families.qwen3_moe import attention_projections, expert_projections


@dataclass(frozen=True)
class GraniteMoeConfig(GraniteConfig):
    experts: ExpertConfig | None = None  # always set by normalise

    @classmethod
    def normalise(cls, raw: Mapping[str, Any]) -> dict[str, Any]:
        experts = ExpertConfig(num_experts=int(raw.get("num_local_experts", 8)),
                               top_k=int(raw.get("num_experts_per_tok", 2)),
                               intermediate_size=int(raw["intermediate_size"]), routing="topk_softmax")
        return {**super().normalise(raw), "experts": experts}

    def projections(self) -> dict[str, Projection]:
        return {**attention_projections(self), **expert_projections(self, self.experts, "block_sparse_moe.experts")}

    def parameter_targets(self) -> dict[str, tuple[tuple[str, str], ...]]:
        return {"block_sparse_moe.experts": (("gate_up_proj", "gate_up_proj"), ("down_proj", "down_proj"))}


class GraniteMoeRouter(nn.Module):
    """``logits = x W^T`` with W at ``router.layer.weight`` ``[E, H]`` (the checkpoint's name); not adaptable."""

    def __init__(self, hidden: int, num_experts: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.layer = nn.Linear(hidden, num_experts, bias=False, dtype=dtype, device=device)
        self.layer.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


class GraniteMoeForCausalLM(GraniteMultipliers, LlamaForCausalLM):
    """Serves ``GraniteMoeForCausalLM`` checkpoints: modules ``layers.N.block_sparse_moe.{router.layer,
    input_linear,output_linear}``."""

    config_class = GraniteMoeConfig
    packed_projections = (*LlamaForCausalLM.packed_projections[:2], ("experts", MoEExperts.names))
    mlp_name = "block_sparse_moe"

    def make_mlp(self, index: int) -> SparseMoE:
        cfg = self.config
        experts = MoEExperts(cfg.experts, cfg.hidden_size, cfg.hidden_act, self.max_loras, self.max_lora_rank,
                             self.dtype, self.device)
        input_linear, output_linear = experts.fused_checkpoint()
        return SparseMoE(cfg.experts, "router", GraniteMoeRouter(cfg.hidden_size, cfg.experts.num_experts,
                                                                 self.dtype, self.device),
                         experts, {"input_linear": input_linear, "output_linear": output_linear})
