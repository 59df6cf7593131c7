"""PEFT adapters in the formats trainers emit, with random non-trivial weights: DoRA, LoRA on
``embed_tokens`` / ``lm_head``, ``modules_to_save``, trainable tokens, and added tokens (a resized
vocabulary with the adapter's own tokenizer). Weights are randomised inside the PEFT model, so tied
parameters stay tied in the saved files exactly as a trainer would save them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.fixtures import ALL_PROJECTIONS, PHI3_PROJECTIONS, projections_of

# name -> LoraConfig fields (rank 4 unless set); every one also adapts some projections
FORMATS: dict[str, dict[str, Any]] = {
    "dora": dict(target_modules=list(ALL_PROJECTIONS), use_dora=True, rank_pattern={"o_proj": 2, "down_proj": 8}),
    "embed_head": dict(target_modules=["q_proj", "embed_tokens", "lm_head"], r=6),
    "dora_embed_head": dict(target_modules=["v_proj", "embed_tokens", "lm_head"], use_dora=True),
    "saved": dict(target_modules=["q_proj"], modules_to_save=["embed_tokens", "lm_head"]),
    "tokens": dict(target_modules=["k_proj", "gate_proj"], trainable_token_indices=[3, 17, 400]),
}
ADDED_TOKENS = ("<|tool_call|>", "<|tool_result|>", "<|think|>")


def format_config(base: Path, name: str) -> dict[str, Any]:
    """``FORMATS[name]`` for ``base``'s family: Phi-3 fuses q/k/v and gate/up (PEFT names them so too)."""
    config = dict(FORMATS[name])
    if projections_of(base) == PHI3_PROJECTIONS:
        fused = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
                 "up_proj": "gate_up_proj"}
        config["target_modules"] = list(dict.fromkeys(fused.get(t, t) for t in config["target_modules"]))
    return config


def randomise(peft_model: torch.nn.Module, seed: int) -> None:
    """Non-zero LoRA B (and embedding A), magnitudes off their init, a few saved rows changed."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            elif "lora_embedding_A" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
            elif "lora_magnitude_vector" in name:
                p.mul_(0.5 + torch.rand(p.shape, generator=g))
            elif "modules_to_save" in name:
                rows = torch.randperm(p.shape[0], generator=g)[:40]
                p[rows] += torch.randn(len(rows), p.shape[1], generator=g) * 0.05
            elif "trainable_tokens_delta" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def write_format_adapter(base: Path, folder: Path, seed: int = 0, model: torch.nn.Module | None = None,
                         **config: Any) -> Path:
    """A PEFT adapter for ``base`` (or the already resized ``model``) with ``LoraConfig(**config)``."""
    torch.manual_seed(seed)
    model = model if model is not None else AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    rank = config.pop("r", 4)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                  task_type="CAUSAL_LM", **config))
    randomise(peft_model, seed)
    peft_model.save_pretrained(folder, safe_serialization=True)
    return folder


def resized_base(base: Path, vocab_size: int) -> torch.nn.Module:
    """The base model with its vocabulary resized as a trainer resizes it before training."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.resize_token_embeddings(vocab_size, mean_resizing=False)
    return model


def peft_model(base: Path, adapter: Path | None, vocab_size: int | None = None) -> torch.nn.Module:
    """A fresh reference model (PEFT's unload() does not restore a shared base after these formats)."""
    model = (resized_base(base, vocab_size) if vocab_size
             else AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32))
    return (model if adapter is None else PeftModel.from_pretrained(model, str(adapter))).eval()


def write_added_tokens_adapter(base: Path, folder: Path, layout: str, force_prompt: list[int], seed: int = 0,
                               chat_template: str | None = None) -> Path:
    """An adapter whose tokenizer adds ``ADDED_TOKENS`` and whose resized vocabulary rows ship with it:
    ``layout`` "saved" (modules_to_save), "tokens" (trainable_token_indices; needs a tied base) or
    "lora" (LoRA on both, which saves the resized base layers). The first added token's lm_head row is
    set so that greedy decoding of ``force_prompt`` emits it first (its embedding row then feeds the
    next step)."""
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.add_tokens(list(ADDED_TOKENS))
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    model = resized_base(base, len(tokenizer))
    new_ids = list(range(len(tokenizer) - len(ADDED_TOKENS), len(tokenizer)))
    config = {"saved": dict(target_modules=["q_proj"], modules_to_save=["embed_tokens", "lm_head"]),
              "tokens": dict(target_modules=["q_proj"], trainable_token_indices=[*new_ids, 5]),
              "lora": dict(target_modules=["q_proj", "embed_tokens", "lm_head"])}[layout]
    torch.manual_seed(seed)
    rank = 4
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                  task_type="CAUSAL_LM", **config))
    randomise(peft_model, seed)
    _force_first_token(peft_model, force_prompt, new_ids[0])
    peft_model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def _force_first_token(peft_model: torch.nn.Module, prompt: list[int], token: int) -> None:
    """Set the parameter row that serves ``token``'s logit to ``h * (max logit + 10) / |h|^2``."""
    captured = []
    head = peft_model.get_output_embeddings()
    hook = head.register_forward_pre_hook(lambda _m, args: captured.append(args[0][0, -1].detach().clone()))
    with torch.no_grad():
        top = peft_model(torch.tensor([prompt])).logits[0, -1].max()
    hook.remove()
    h = captured[0]
    params = dict(peft_model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, p in params.items():
            if name.endswith("lm_head.modules_to_save.default.weight") or name.endswith("lm_head.base_layer.weight"):
                p[token] = h * (top + 10) / h.dot(h)
                return
            if name.endswith("embed_tokens.token_adapter.trainable_tokens_delta.default"):
                indices = peft_model.get_input_embeddings().token_adapter.token_indices["default"]
                p[indices.index(token)] = h * (top + 10) / h.dot(h)
                return
    raise AssertionError("no parameter serves the lm_head row")
