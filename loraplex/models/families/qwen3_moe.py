"""Qwen3-MoE (``Qwen3MoeForCausalLM``: Qwen3-30B-A3B, Qwen3-235B-A22B and smaller siblings) over a flat
ragged batch: Qwen3's attention (per-head q/k RMSNorm) and, in every block, a sparse mixture of experts.

MLP: router ``gate`` (``hidden -> E``), softmax over all E experts in float32, the top ``num_experts_per_tok``
probabilities renormalised to sum 1 when ``norm_topk_prob`` (true in the released configs), then SwiGLU
experts of width ``moe_intermediate_size`` (``layers.moe``). The checkpoint stores one module per expert
(``mlp.experts.N.{gate,up,down}_proj``, as transformers saves them).

Adapters (PEFT 0.21 on transformers 5): LoRA on q/k/v/o through ``target_modules``; on the experts through
``target_parameters`` on the stacked tensors ``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj`` (what
PEFT also writes when asked for ``target_modules`` gate_proj/up_proj/down_proj: gate and up become one
``gate_up_proj`` LoRA of twice the rank); on the router ``gate`` (``gate.weight`` under ``target_parameters``,
which "all-linear" adds). Dense MLP layers between sparse ones (``mlp_only_layers``, ``decoder_sparse_step``
> 1: no released Qwen3-MoE has them) are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from loraplex.config import ExpertConfig, ModelConfig, Projection
from loraplex.errors import ModelError
from loraplex.layers.moe import MoEExperts, SparseMoE
from loraplex.models.families.llama import LlamaForCausalLM
from loraplex.models.families.qwen3 import Qwen3ForCausalLM


def expert_projections(cfg: ModelConfig, experts: ExpertConfig, container: str) -> dict[str, Projection]:
    """The stacked expert parameters as adaptable projections (one LoRA pair per expert)."""
    h, i, e = cfg.hidden_size, experts.intermediate_size, experts.num_experts
    return {"gate_up_proj": Projection(container, h, 2 * i, experts=e),
            "down_proj": Projection(container, i, h, experts=e)}


def attention_projections(cfg: ModelConfig) -> dict[str, Projection]:
    return {name: p for name, p in ModelConfig.projections(cfg).items() if p.parent == "self_attn"}


@dataclass(frozen=True)
class Qwen3MoeConfig(ModelConfig):
    experts: ExpertConfig | None = None  # always set by normalise

    @classmethod
    def normalise(cls, raw: Mapping[str, Any]) -> dict[str, Any]:
        if raw.get("mlp_only_layers") or int(raw.get("decoder_sparse_step", 1)) != 1:
            raise ModelError(f"Qwen3MoeForCausalLM with dense MLP layers (mlp_only_layers="
                             f"{raw.get('mlp_only_layers')!r}, decoder_sparse_step={raw.get('decoder_sparse_step')!r})"
                             " is not supported: every layer must be sparse")
        experts = ExpertConfig(num_experts=int(raw.get("num_experts") or raw.get("num_local_experts") or 128),
                               top_k=int(raw.get("num_experts_per_tok", 8)),
                               intermediate_size=int(raw.get("moe_intermediate_size", 768)),
                               routing="softmax_topk", normalize_top_k=bool(raw.get("norm_topk_prob", False)))
        return {**super().normalise(raw), "experts": experts}

    def projections(self) -> dict[str, Projection]:
        return {**attention_projections(self), "gate": Projection("mlp", self.hidden_size, self.experts.num_experts),
                **expert_projections(self, self.experts, "mlp.experts")}

    def parameter_targets(self) -> dict[str, tuple[tuple[str, str], ...]]:
        return {"mlp.experts": (("gate_up_proj", "gate_up_proj"), ("down_proj", "down_proj")),
                "mlp.gate": (("weight", "gate"),)}


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Serves ``Qwen3MoeForCausalLM`` checkpoints: modules ``layers.N.mlp.gate`` and ``layers.N.mlp.experts.M.*``."""

    config_class = Qwen3MoeConfig
    packed_projections = (*LlamaForCausalLM.packed_projections[:2], ("gate", ("gate",)),
                          ("experts", MoEExperts.names))

    def make_mlp(self, index: int) -> SparseMoE:
        cfg = self.config
        experts = MoEExperts(cfg.experts, cfg.hidden_size, cfg.hidden_act, self.max_loras, self.max_lora_rank,
                             self.dtype, self.device)
        return SparseMoE(cfg.experts, "gate", self.lora_linear("gate", cfg.hidden_size), experts,
                         {"experts": experts.per_expert_checkpoint()})
