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
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

from loraplex.models.embedded import embedded_checkpoint

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Phi-3 fuses q/k/v and gate/up in the checkpoint and in PEFT target names
PHI3_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

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
}
_CONFIGS = {"llama": LlamaConfig, "llama3": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config,
            "qwen3": Qwen3Config, "gemma3": Gemma3TextConfig, "phi3": Phi3Config}


def tiny_config(arch: str = "llama", **overrides):
    """A small HF config: ``arch`` is "llama", "llama3" (rope scaling, untied), "mistral" (sliding
    window 8), "qwen2", "qwen3" (head_dim 32 != hidden / heads), "gemma3" (4 layers, local-local-global-
    local, window 6, query_pre_attn_scalar 24) or "phi3" (LongRoPE over 32 of 128 positions, untied)."""
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
            elif arch in NEW_FAMILIES and "norm" in name:  # Gemma's are zeros, others ones: perturb them
                p.add_(torch.randn_like(p), alpha=0.2)
    model.save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(embedded_checkpoint()).save_pretrained(folder)
    return folder


def projections_of(base_folder: Path) -> tuple[str, ...]:
    """The PEFT target names of every adaptable projection of the checkpoint's family."""
    arch = json.loads((base_folder / "config.json").read_text())["architectures"][0]
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
) -> Path:
    """Create a PEFT LoRA adapter with random non-zero B for the model in ``base_folder`` (default
    targets: every projection of its family)."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    if target_modules is None:
        target_modules = projections_of(base_folder)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(target_modules) if not isinstance(target_modules, str) else target_modules,
        lora_dropout=0.0,
        bias="none",
        use_rslora=use_rslora,
        rank_pattern=rank_pattern or {},
        alpha_pattern=alpha_pattern or {},
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, b_std)
    peft_model.save_pretrained(folder, safe_serialization=True)
    return folder
