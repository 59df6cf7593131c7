"""The model-size axis of ``benchmarks/scaling.py``: SmolLM2-135M (the embedded checkpoint, real weights) and
random-weight checkpoints with the published shapes of SmolLM2-360M / 1.7B and Qwen3-0.6B / 1.7B.

A random checkpoint is written the way ``tests/fixtures.write_tiny_model`` writes its tiny ones (an HF
config, ``model.safetensors``, the embedded tokenizer), but tensor by tensor from the shapes of a model
built on the ``meta`` device, so a 1.7B checkpoint never needs a second float32 copy in memory:
weights ~ N(0, 0.02^2), norms ones. Prompts are token ids below 49,152, valid for both vocabularies.
Checkpoints are cached in ``$LORAPLEX_HOME/bench/scaling-models/<name>``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PretrainedConfig, Qwen3Config

from benchmarks.peers.shared import bench_home
from loraplex.models.embedded import embedded_checkpoint


@dataclass(frozen=True)
class ModelSpec:
    """One point of the model axis: the HF config (None: the embedded checkpoint) and the weight format
    loraplex serves it in (``None`` = float32, ``"int8"`` = weight-only int8)."""

    name: str
    config: PretrainedConfig | None
    quantization: str | None = None


def _smollm2(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=49152, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=8192,
                       rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1,
                       eos_token_id=2, architectures=["LlamaForCausalLM"])


def _qwen3(hidden: int, layers: int, intermediate: int) -> Qwen3Config:
    return Qwen3Config(vocab_size=151936, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, bos_token_id=151643,
                       eos_token_id=151645, architectures=["Qwen3ForCausalLM"])


MODELS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec("smollm2-135m", None),
    "smollm2-135m-int8": ModelSpec("smollm2-135m-int8", None, "int8"),
    "smollm2-360m": ModelSpec("smollm2-360m", _smollm2(960, 32, 15, 5, 2560)),
    "qwen3-0.6b": ModelSpec("qwen3-0.6b", _qwen3(1024, 28, 3072)),
    "smollm2-1.7b-int8": ModelSpec("smollm2-1.7b-int8", _smollm2(2048, 24, 32, 32, 8192), "int8"),
    "qwen3-1.7b-int8": ModelSpec("qwen3-1.7b-int8", _qwen3(2048, 28, 6144), "int8"),
}


def parameter_count(spec: ModelSpec) -> int:
    """Parameters of the model (tied embeddings counted once), from a ``meta``-device build."""
    config = spec.config or AutoModelForCausalLM.from_pretrained(embedded_checkpoint()).config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def checkpoint(spec: ModelSpec) -> str:
    """The folder loraplex loads for ``spec`` (written on first use for the random-weight models)."""
    if spec.config is None:
        return str(embedded_checkpoint())
    folder = bench_home() / "scaling-models" / spec.name.removesuffix("-int8")
    if not (folder / "model.safetensors").is_file():
        _write_random(spec.config, folder, seed=0)
    return str(folder)


def _write_random(config: PretrainedConfig, folder: Path, seed: int) -> None:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, p in model.state_dict(keep_vars=True).items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        tensors[name] = torch.ones(p.shape) if "norm" in name else torch.randn(p.shape, generator=gen) * 0.02
    folder.mkdir(parents=True, exist_ok=True)
    staging = folder / "model.safetensors.part"
    save_file(tensors, str(staging), metadata={"format": "pt"})
    config.save_pretrained(folder)
    AutoTokenizer.from_pretrained(embedded_checkpoint()).save_pretrained(folder)
    staging.rename(folder / "model.safetensors")
