"""Builders for tiny random Llama-family checkpoints and PEFT adapters (HF formats, real files)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, MistralConfig, Qwen2Config

from loraplex.models.embedded import embedded_checkpoint

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

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


def tiny_config(arch: str = "llama", **overrides):
    """A small HF config: ``arch`` is "llama", "llama3" (rope scaling, untied), "mistral" or "qwen2"."""
    kw = dict(_COMMON, **overrides)
    if arch == "llama":
        return LlamaConfig(tie_word_embeddings=True, **kw)
    if arch == "llama3":
        return LlamaConfig(
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
            **kw,
        )
    if arch == "mistral":
        return MistralConfig(tie_word_embeddings=False, sliding_window=None, **kw)
    if arch == "qwen2":
        return Qwen2Config(tie_word_embeddings=True, **kw)
    raise ValueError(arch)


def write_tiny_model(folder: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Write a random checkpoint (config.json, model.safetensors, tokenizer) to ``folder``; return it."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(embedded_checkpoint()).save_pretrained(folder)
    return folder


def write_peft_adapter(
    base_folder: Path,
    folder: Path,
    rank: int = 8,
    alpha: float = 16.0,
    target_modules: Sequence[str] | str = ALL_PROJECTIONS,
    seed: int = 0,
    b_std: float = 0.2,
    use_rslora: bool = False,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
) -> Path:
    """Create a PEFT LoRA adapter with random non-zero B for the model in ``base_folder``."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
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
