"""Frozen configs, normalised once: model code never reads raw HF ``config.json`` attributes."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from loraplex.errors import ModelError

# The seven adapted projections of a Llama-style block, in a fixed order (families with other
# projections declare their own through ``ModelConfig.projections``).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Projection:
    """One adaptable linear layer of a decoder block: ``layers.N.<parent>.<name>`` in HF and PEFT names."""

    parent: str  # "self_attn" or "mlp"
    in_features: int
    out_features: int


def read_hf_config(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """An HF ``config.json`` as a dict: given as a dict, a file, or a folder holding one."""
    if isinstance(source, Mapping):
        return dict(source)
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ModelError(f"{path}: no config.json")
    return json.loads(path.read_text())


@dataclass(frozen=True)
class RopeScaling:
    """``rope_scaling`` normalised; ``rope_type`` is "default", "linear", "dynamic" or "llama3"."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    TYPES: ClassVar[tuple[str, ...]] = ("default", "linear", "dynamic", "llama3")

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> RopeScaling:
        scaling = _rope_parameters(raw)
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in cls.TYPES:
            raise ModelError(f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(cls.TYPES)}")
        return cls(
            rope_type=rope_type,
            factor=float(scaling.get("factor", 1.0)),
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                scaling.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))),
        )


def _rope_parameters(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    """transformers >= 5 writes ``rope_parameters`` (theta included); older files ``rope_scaling``."""
    return raw.get("rope_parameters") or raw.get("rope_scaling") or {}


@dataclass(frozen=True)
class ModelConfig:
    """The fields every family's code reads; a family subclasses it for its own (see ``normalise``)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, source: str | Path | Mapping[str, Any]) -> ModelConfig:
        """Normalise an HF ``config.json`` (a dict, a file or a folder holding one). Which class to use
        for an architecture is the model registry's business (``loraplex.models.registry.model_config``)."""
        return cls(**cls.normalise(read_hf_config(source)))

    @classmethod
    def normalise(cls, raw: Mapping[str, Any]) -> dict[str, Any]:
        """The constructor's keyword arguments from a raw HF config; a family's subclass extends this with
        its own fields (``{**super().normalise(raw), "sliding_window": ...}``)."""
        archs = raw.get("architectures") or ["LlamaForCausalLM"]
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return dict(
            architecture=archs[0],
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", _rope_parameters(raw).get("rope_theta", 10000.0))),
            rope_scaling=RopeScaling.from_hf(raw),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def projections(self) -> dict[str, Projection]:
        """Adaptable projection name -> where it sits and its shape (a Llama-style block's seven;
        families with fused or other projections override this)."""
        q_out = self.num_heads * self.head_dim
        kv_out = self.num_kv_heads * self.head_dim
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": Projection("self_attn", h, q_out),
            "k_proj": Projection("self_attn", h, kv_out),
            "v_proj": Projection("self_attn", h, kv_out),
            "o_proj": Projection("self_attn", q_out, h),
            "gate_proj": Projection("mlp", h, i),
            "up_proj": Projection("mlp", h, i),
            "down_proj": Projection("mlp", i, h),
        }


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start; the CLI and ``LLM(...)`` build one of these."""

    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"  # "auto" = float32 on CPU, bfloat16 on CUDA
    device: str = "auto"
    max_loras: int = 4
    max_cpu_loras: int = 16
    max_lora_rank: int = 16
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_blocks: int | None = None  # None: derive from kv_cache_bytes
    kv_cache_bytes: int = 512 * 1024**2
    allow_pickle_adapters: bool = False
    seed: int = 0
    # Waiting requests may skip ahead of one whose adapter cannot be placed, for at most this many
    # steps; then admission turns strictly first-come-first-served until it is placed (no starvation).
    max_skip_steps: int = 64
    # Check invariant 1 (each token's slot holds the adapter its request asked for) every step.
    debug_checks: bool = False
    # CPU threads for torch's kernels (torch.set_num_threads, process-wide); None keeps torch's default
    # (one per core). On a shared host, fewer threads than busy cores avoids OpenMP oversubscription.
    num_threads: int | None = None

    def __post_init__(self) -> None:
        for field in ("max_loras", "max_cpu_loras", "max_lora_rank", "max_num_seqs", "block_size"):
            if getattr(self, field) < 1:
                raise ValueError(f"EngineConfig.{field} must be >= 1, got {getattr(self, field)}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"EngineConfig.num_threads must be >= 1 or None, got {self.num_threads}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"EngineConfig.max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )
