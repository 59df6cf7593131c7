"""Builders for tiny random checkpoints of every supported family and PEFT adapters (HF formats, real files)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma2Config,
    Gemma3TextConfig,
    GraniteConfig,
    GraniteMoeConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
    SmolLM3Config,
)

from loraplex.models.embedded import embedded_checkpoint

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Phi-3 fuses q/k/v and gate/up in the checkpoint and in PEFT target names
PHI3_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# MoE families: attention as Llama's, then what PEFT adapts on the experts (``target_parameters``, the
# parameter names of transformers 5's fused experts) and Qwen3-MoE's router ("gate", ``gate.weight``)
ATTENTION_PROJECTIONS = ALL_PROJECTIONS[:4]
EXPERT_PARAMETERS = {"Qwen3MoeForCausalLM": ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
                     "GraniteMoeForCausalLM": ("block_sparse_moe.experts.gate_up_proj",
                                               "block_sparse_moe.experts.down_proj")}
MOE_PROJECTIONS = {"Qwen3MoeForCausalLM": (*ATTENTION_PROJECTIONS, "gate", "gate_up_proj", "down_proj"),
                   "GraniteMoeForCausalLM": (*ATTENTION_PROJECTIONS, "gate_up_proj", "down_proj")}

# The tiny models share SmolLM2's tokenizer (copied into each folder) so text prompts work;
# hence its vocabulary size and special token ids.
_COMMON = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)
# Gemma 3's tiny window: prompts in the tests are longer, so prefill, chunks and decode all cross it
GEMMA3_SLIDING_WINDOW = 6
# Phi-3's LongRoPE switches from short to long factors once a sequence passes 32 positions
PHI3_ORIGINAL_MAX_POSITIONS = 32
NEW_FAMILIES = ("qwen3", "gemma3", "phi3")
# issue 34's families (tests/test_families.py runs them with NEW_FAMILIES)
DENSE_FAMILIES_34 = ("gemma2", "granite", "smollm3", "phi4mini")
MOE_FAMILIES = ("qwen3moe", "granitemoe")
FAMILIES_34 = (*DENSE_FAMILIES_34, *MOE_FAMILIES)
# the tiny MoE models: 8 experts, 2 per token (so a decode step leaves most experts without a token)
MOE_EXPERTS, MOE_TOP_K = 8, 2
# Gemma 2's soft-capping, low enough that the tiny model's scores and logits reach the tanh's bend
GEMMA2_SOFTCAPS = dict(attn_logit_softcapping=3.0, final_logit_softcapping=4.0)


def _phi3_longrope(head_dim: int) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"type": "longrope", "short_factor": (1 + 0.5 * torch.rand(head_dim // 2, generator=g)).tolist(),
            "long_factor": (1 + 7 * torch.rand(head_dim // 2, generator=g)).tolist()}


# Per family, what differs from _COMMON (overrides given to tiny_config win over both)
_FAMILY = {
    "llama": dict(tie_word_embeddings=True),
    "llama3": dict(tie_word_embeddings=False, rope_theta=500000.0,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 64}),
    "mistral": dict(tie_word_embeddings=False, sliding_window=8),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(tie_word_embeddings=True, head_dim=32),
    "gemma3": dict(num_hidden_layers=4, head_dim=16, sliding_window=GEMMA3_SLIDING_WINDOW, sliding_window_pattern=3,
                   query_pre_attn_scalar=24, rope_theta=50000.0, rope_local_base_freq=100.0),
    "phi3": dict(tie_word_embeddings=False, max_position_embeddings=128,
                 original_max_position_embeddings=PHI3_ORIGINAL_MAX_POSITIONS, rope_scaling=_phi3_longrope(16)),
    "gemma3capped": dict(num_hidden_layers=4, head_dim=16, sliding_window=GEMMA3_SLIDING_WINDOW,
                         sliding_window_pattern=3, query_pre_attn_scalar=24, rope_theta=50000.0,
                         rope_local_base_freq=100.0, **GEMMA2_SOFTCAPS),
    "gemma2": dict(num_hidden_layers=4, head_dim=16, sliding_window=GEMMA3_SLIDING_WINDOW, query_pre_attn_scalar=24,
                   rope_theta=5000.0, **GEMMA2_SOFTCAPS),
    "granite": dict(tie_word_embeddings=True, embedding_multiplier=6.0, residual_multiplier=0.3,
                    attention_multiplier=0.09, logits_scaling=2.5, rope_theta=50000.0),
    "smollm3": dict(num_hidden_layers=4, no_rope_layer_interval=2, rope_theta=20000.0, pad_token_id=0),
    # Phi-4-mini: rope on 12 of 16 dims per head (factor 0.75; LongRoPE's short factors for those 12: its switch
    # lies past the context, as Phi-4-mini's 4096 lies past most prompts, so prefix caching stays on), tied
    "phi4mini": dict(tie_word_embeddings=True, max_position_embeddings=128, partial_rotary_factor=0.75,
                     original_max_position_embeddings=128, rope_scaling=_phi3_longrope(12)),
    "qwen3moe": dict(tie_word_embeddings=False, head_dim=32, num_experts=MOE_EXPERTS, num_experts_per_tok=MOE_TOP_K,
                     moe_intermediate_size=48, norm_topk_prob=True),
    "granitemoe": dict(tie_word_embeddings=True, intermediate_size=48, num_local_experts=MOE_EXPERTS,
                       num_experts_per_tok=MOE_TOP_K, embedding_multiplier=6.0, residual_multiplier=0.3,
                       attention_multiplier=0.09, logits_scaling=2.5),
}
_CONFIGS = {"llama": LlamaConfig, "llama3": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config,
            "qwen3": Qwen3Config, "gemma3": Gemma3TextConfig, "phi3": Phi3Config, "gemma3capped": Gemma3TextConfig,
            "gemma2": Gemma2Config,
            "granite": GraniteConfig, "smollm3": SmolLM3Config, "phi4mini": Phi3Config, "qwen3moe": Qwen3MoeConfig,
            "granitemoe": GraniteMoeConfig}


def tiny_config(arch: str = "llama", **overrides):
    """A small HF config: ``arch`` is "llama", "llama3" (rope scaling, untied), "mistral" (sliding
    window 8), "qwen2", "qwen3" (head_dim 32 != hidden / heads), "gemma3" (4 layers, local-local-global-
    local, window 6, query_pre_attn_scalar 24), "gemma3capped" (that with soft-capping set: HF applies the
    final one only), "phi3" (LongRoPE over 32 of 128 positions, untied), "gemma2" (4 layers local-global,
    window 6, soft-capping 3 / 4), "granite" (every multiplier != 1), "smollm3" (4 layers, NoPE in blocks 1
    and 3), "phi4mini" (partial rotary 0.75 with LongRoPE, tied), "qwen3moe" (8 experts, top 2, normalised)
    or "granitemoe" (8 experts, top 2, multipliers)."""
    if arch not in _CONFIGS:
        raise ValueError(arch)
    return _CONFIGS[arch](**{**_COMMON, **_FAMILY[arch], **overrides})


def write_tiny_model(folder: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Write a random checkpoint (config.json, model.safetensors, tokenizer) to ``folder``; return it."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif arch in (*NEW_FAMILIES, *FAMILIES_34, "gemma3capped") and "norm" in name:
                p.add_(torch.randn_like(p), alpha=0.2)  # Gemma's are zeros, others ones: perturb them
            elif arch in MOE_FAMILIES and name.endswith(("mlp.gate.weight", "router.weight")):
                p.normal_(0.0, 0.5)  # decisive routing: the top-k never hinges on float rounding
    model.save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(embedded_checkpoint()).save_pretrained(folder)
    return folder


def projections_of(base_folder: Path) -> tuple[str, ...]:
    """The PEFT target names of every adaptable projection of the checkpoint's family."""
    arch = json.loads((base_folder / "config.json").read_text())["architectures"][0]
    if arch in MOE_PROJECTIONS:
        return MOE_PROJECTIONS[arch]
    return PHI3_PROJECTIONS if arch == "Phi3ForCausalLM" else ALL_PROJECTIONS


def write_peft_adapter(
    base_folder: Path,
    folder: Path,
    rank: int = 8,
    alpha: float = 16.0,
    target_modules: Sequence[str] | str | None = None,
    seed: int = 0,
    b_std: float = 0.2,
    use_rslora: bool = False,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
    target_parameters: Sequence[str] | None = None,
) -> Path:
    """Create a PEFT LoRA adapter with random non-zero B for the model in ``base_folder`` (default
    targets: every projection of its family; ``target_parameters``: PEFT's, e.g. MoE expert tensors)."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    if target_modules is None:
        target_modules = projections_of(base_folder)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(target_modules) if not isinstance(target_modules, str) else target_modules,
        target_parameters=list(target_parameters) if target_parameters else None,
        lora_dropout=0.0,
        bias="none",
        use_rslora=use_rslora,
        rank_pattern=rank_pattern or {},
        alpha_pattern=alpha_pattern or {},
        task_type="CAUSAL_LM",
    )
    return save_with_random_b(get_peft_model(base, config), folder, b_std)


def write_embedding_adapter(base_folder: Path, folder: Path, rank: int = 8, seed: int = 0,
                            target_modules: Sequence[str] = ALL_PROJECTIONS, b_std: float = 0.2) -> Path:
    """A PEFT ``FEATURE_EXTRACTION`` LoRA adapter (what an embedder fine-tune saves: on ``AutoModel``, the
    decoder without its lm_head, so tensor names lack CAUSAL_LM's ``model.``) with random non-zero B."""
    from transformers import AutoModel

    torch.manual_seed(seed)
    base = AutoModel.from_pretrained(base_folder, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(target_modules), lora_dropout=0.0,
                        bias="none", task_type="FEATURE_EXTRACTION")
    return save_with_random_b(get_peft_model(base, config), folder, b_std)


def save_with_random_b(peft_model: torch.nn.Module, folder: Path, b_std: float) -> Path:
    """Draw every ``lora_B`` from N(0, b_std) (PEFT initialises B to zero: a no-op adapter) and save."""
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, b_std)
    peft_model.save_pretrained(folder, safe_serialization=True)
    return folder
