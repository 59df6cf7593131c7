"""Frozen configs, normalised once: model code never reads raw HF ``config.json`` attributes."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

from loraplex.errors import ModelError

# The seven adapted projections of a Llama-style block, in a fixed order (families with other
# projections declare their own through ``ModelConfig.projections``).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# How the LoRA delta is computed: "auto" = Triton kernels on CUDA when Triton is installed, the C++ sgmv
# kernel on CPUs with AVX2 where it builds, torch ops elsewhere; "torch", "sgmv" or "triton" force one
# (``loraplex.ops.lora.resolve_lora_kernels``).
LORA_KERNELS = ("auto", "torch", "sgmv", "triton")


@dataclass(frozen=True)
class Projection:
    """One adaptable linear layer of a decoder block: ``layers.N.<parent>.<name>`` in HF and PEFT names.
    With ``experts > 0`` it is a mixture-of-experts' stacked parameter (``mlp.experts.gate_up_proj``):
    one ``in_features -> out_features`` matrix per expert, adapted per expert (PEFT's ``target_parameters``)."""

    parent: str  # "self_attn", "mlp" or an experts container ("mlp.experts")
    in_features: int
    out_features: int
    experts: int = 0  # > 0: a stacked expert parameter, one LoRA pair per expert


@dataclass(frozen=True)
class ExpertConfig:
    """A sparse mixture-of-experts MLP, normalised once (``layers.moe`` computes it).

    ``routing``: "softmax_topk" (Qwen3-MoE, OLMoE: ``p = softmax(logits)``, top-k of p, renormalised to sum
    1 when ``normalize_top_k``) or "topk_softmax" (GraniteMoE: top-k of the logits, softmax over those k)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    routing: str
    normalize_top_k: bool = False

    ROUTINGS: ClassVar[tuple[str, ...]] = ("softmax_topk", "topk_softmax")

    def __post_init__(self) -> None:
        if self.routing not in self.ROUTINGS:
            raise ModelError(f"unsupported expert routing {self.routing!r}; supported: {', '.join(self.ROUTINGS)}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ModelError(f"num_experts_per_tok={self.top_k} must be in [1, num_experts={self.num_experts}]")


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
    """``rope_scaling`` normalised; ``rope_type`` is "default", "linear", "dynamic", "llama3" or "longrope"
    (Phi-3's; its old name "su" is accepted)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors while seq_len <= original max
    long_factor: tuple[float, ...] = ()  # longrope: ... once seq_len > original max
    attention_factor: float = 1.0  # multiplies cos and sin (longrope)

    TYPES: ClassVar[tuple[str, ...]] = ("default", "linear", "dynamic", "llama3", "longrope")

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any], scaling: Mapping[str, Any] | None = None) -> RopeScaling:
        """From a raw config; ``scaling`` overrides where the parameters sit (per-layer-type configs)."""
        scaling = _rope_parameters(raw) if scaling is None else scaling
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        rope_type = "longrope" if rope_type == "su" else rope_type
        if rope_type not in cls.TYPES:
            raise ModelError(f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(cls.TYPES)}")
        max_pos = int(raw.get("max_position_embeddings", 8192))
        # Phi-3 keeps the pretraining length at the top level, and HF gives that copy priority
        original = int(raw.get("original_max_position_embeddings")
                       or scaling.get("original_max_position_embeddings", max_pos))
        factor = scaling.get("factor")
        attention_factor = 1.0
        if rope_type == "longrope":
            # HF's _compute_longrope_parameters: factor defaults to the ratio of the two lengths
            factor = max_pos / original if factor is None else float(factor)
            attention_factor = scaling.get("attention_factor") or (
                math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0)
        return cls(
            rope_type=rope_type,
            factor=float(1.0 if factor is None else factor),
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=original,
            short_factor=tuple(float(f) for f in scaling.get("short_factor") or ()),
            long_factor=tuple(float(f) for f in scaling.get("long_factor") or ()),
            attention_factor=float(attention_factor),
        )


def _rope_parameters(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    """transformers >= 5 writes ``rope_parameters`` (theta included); older files ``rope_scaling``."""
    return raw.get("rope_parameters") or raw.get("rope_scaling") or {}


def _layer_types(raw: Mapping[str, Any], num_layers: int, window: int | None) -> tuple[str, ...]:
    """Per-layer attention type as HF derives it: ``layer_types`` when the file has it (what current
    transformers writes); else, with a window, Qwen's ``max_window_layers`` (layers from there on slide),
    Gemma's ``sliding_window_pattern`` (every p-th layer is global) or, as Mistral and Phi-3 do, every layer."""
    if raw.get("layer_types"):
        return tuple(raw["layer_types"])
    if window is None:
        return ()
    if "max_window_layers" in raw:
        return tuple("sliding_attention" if i >= int(raw["max_window_layers"]) else "full_attention"
                     for i in range(num_layers))
    if "sliding_window_pattern" in raw:
        pattern = int(raw["sliding_window_pattern"])
        return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers))
    return ("sliding_attention",) * num_layers


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
    hidden_act: str = "silu"  # the gated MLP's activation (HF's name)
    sliding_window: int | None = None  # keys a "sliding_attention" layer sees: positions (p - W, p]
    layer_types: tuple[str, ...] = ()  # per layer, one of LAYER_TYPES; () = all full attention
    partial_rotary_factor: float = 1.0  # rotary on the first int(head_dim * factor) dims of each head (Phi-4-mini)

    LAYER_TYPES: ClassVar[tuple[str, ...]] = ("full_attention", "sliding_attention")

    def __post_init__(self) -> None:
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ModelError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        unknown = sorted(set(self.layer_types) - set(self.LAYER_TYPES))
        if unknown:
            raise ModelError(f"unsupported layer_types {unknown}; supported: {', '.join(self.LAYER_TYPES)}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ModelError(f"sliding_window must be >= 1, got {self.sliding_window}")
        s = self.rope_scaling
        if not 0.0 < self.partial_rotary_factor <= 1.0 or self.rotary_dim % 2:
            raise ModelError(f"partial_rotary_factor={self.partial_rotary_factor} must give an even rotary dimension "
                             f"in (0, head_dim={self.head_dim}], got {self.rotary_dim}")
        half = self.rotary_dim // 2
        if s.rope_type == "longrope" and not len(s.short_factor) == len(s.long_factor) == half:
            what = "head_dim / 2" if self.rotary_dim == self.head_dim else "the rotary dimension / 2"
            raise ModelError(f"longrope needs short_factor and long_factor of {what} = {half} "
                             f"entries each, got {len(s.short_factor)} and {len(s.long_factor)}")

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
        # Qwen2/Qwen3 switch their window off with use_sliding_window=false (HF then drops it)
        window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
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
            hidden_act=str(raw.get("hidden_act") or raw.get("hidden_activation") or "silu"),
            sliding_window=window,
            layer_types=_layer_types(raw, int(raw["num_hidden_layers"]), window),
            partial_rotary_factor=float(_rope_parameters(raw).get("partial_rotary_factor")
                                        or raw.get("partial_rotary_factor") or 1.0),
        )

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that rotary embeddings rotate (the first ones; HF's ``int(d * factor)``)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of block ``layer``; None for full (causal) attention."""
        sliding = self.layer_types and self.layer_types[layer] == "sliding_attention"
        return self.sliding_window if sliding else None

    def attention_windows(self) -> tuple[int | None, ...]:
        """The distinct windows of the model's layers (None = full attention), in layer order."""
        return tuple(dict.fromkeys(self.layer_window(i) for i in range(self.num_layers)))

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

    def parameter_targets(self) -> dict[str, tuple[tuple[str, str], ...]]:
        """Parameters PEFT adapts through ``target_parameters`` (a ``ParamWrapper`` per parameter, nested in
        this order around the module): module path inside a block -> ``(parameter, projection name)`` pairs,
        e.g. ``{"mlp.experts": (("gate_up_proj", "gate_up_proj"), ("down_proj", "down_proj"))}``; empty for
        a dense family."""
        return {}


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config`` keys): each step, a request may propose up to
    ``num_speculative_tokens`` draft tokens, checked by the same forward pass that computes its next token.

    ``method="ngram"`` (prompt lookup, the only method): the draft is what followed the most recent earlier
    occurrence of the request's last n tokens in its own prompt and output, for the largest n in
    [``prompt_lookup_min``, ``prompt_lookup_max``] that occurs (vLLM's rule for the defaults: one of the two
    given sets the other; neither: both 5). ``disable_by_batch_size``: no drafts in a step with more
    requests running or waiting than this (vLLM's key; None: our default, 8, where a CPU step turns compute-bound).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int | None = None

    METHODS: ClassVar[tuple[str, ...]] = ("ngram",)
    DEFAULT_LOOKUP: ClassVar[int] = 5
    DEFAULT_BATCH_LIMIT: ClassVar[int] = 8

    def __post_init__(self) -> None:
        if self.method not in self.METHODS:
            raise ValueError(f"speculative_config.method must be one of {self.METHODS}, got {self.method!r}")
        lookup_max, lookup_min = self.prompt_lookup_max, self.prompt_lookup_min
        if lookup_max is None and lookup_min is None:
            lookup_max = lookup_min = self.DEFAULT_LOOKUP
        object.__setattr__(self, "prompt_lookup_max", lookup_max if lookup_max is not None else lookup_min)
        object.__setattr__(self, "prompt_lookup_min", lookup_min if lookup_min is not None else lookup_max)
        if self.disable_by_batch_size is None:
            object.__setattr__(self, "disable_by_batch_size", self.DEFAULT_BATCH_LIMIT)
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def of(cls, value: SpeculativeConfig | Mapping[str, Any] | str | None) -> SpeculativeConfig | None:
        """From a ``SpeculativeConfig``, a dict of vLLM's keys or its JSON text (``--speculative-config``);
        None stays None (speculation off). ``ValueError`` names an unknown key or a bad value."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from exc
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"unknown speculative_config key(s) {unknown}; known: {known}")
        return cls(**value)


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
    # Requests queued and not running (beyond the seats free under max_num_seqs); past it a new request
    # is refused (QueueFull: the server's 503 with Retry-After). None: unbounded.
    max_waiting_requests: int | None = None
    # Tokens one step computes at most (chunked prefill: running streams decode first, a longer prompt is
    # prefilled in chunks of what is left). 256, measured: a 4000-token prompt's TTFT is still an unchunked
    # prefill's, a wave of 32 new prompts gets its first tokens as fast as at any budget, and the streams'
    # largest gap is half 512's (docs/server.md: Chunked prefill).
    max_num_batched_tokens: int = 256
    block_size: int = 16
    kv_cache_blocks: int | None = None  # None: derive from kv_cache_bytes
    kv_cache_bytes: int = 512 * 1024**2
    allow_pickle_adapters: bool = False
    # Host memory for adapters' saved vocabulary rows (modules_to_save embed_tokens/lm_head, trainable
    # tokens, added tokens), held while their version is loaded; a load past it fails (never swaps).
    saved_rows_budget_bytes: int = 512 * 1024**2
    seed: int = 0
    # Waiting requests may skip ahead of one whose adapter cannot be placed, for at most this many
    # steps; then admission turns strictly first-come-first-served until it is placed (no starvation).
    max_skip_steps: int = 64
    # Admission order: "fair" (per-tenant virtual token counters, engine/scheduler/fair_share.py; one tenant gets
    # plain FCFS) or "fcfs" (queue order, tenants ignored); priority orders within a tenant under "fair".
    scheduling_policy: str = "fair"
    # Reuse the K/V of cached full blocks of a prompt's prefix computed under the same adapter version.
    enable_prefix_caching: bool = True
    # Check invariant 1 (each token's slot holds the adapter its request asked for) and that every KV
    # block a request reads was written under its adapter version, every step.
    debug_checks: bool = False
    # The first adapter version id this engine hands out. A restarted engine process continues after
    # every id its predecessor handed out, so a version id the API process still holds never names
    # another adapter in the new engine (invariant 6).
    first_version_id: int = 1
    # CPU threads for torch's kernels (torch.set_num_threads, process-wide); None keeps torch's default
    # (one per core). On a shared host, fewer threads than busy cores avoids OpenMP oversubscription.
    num_threads: int | None = None
    lora_kernels: str = "auto"  # one of LORA_KERNELS
    # Base weights: None keeps them in ``dtype``; "int8" stores every base projection and the lm_head as
    # weight-only int8, per output channel (``loraplex.ops.int8``); LoRA weights and activations stay float.
    quantization: str | None = None
    # Adapter weights (A, B of every adapted projection) in the host tier and the slots: "float32" keeps the
    # model's dtype (float32 on CPU); "bfloat16" rounds them once at load (B after its scale is folded in),
    # halving the bytes a decode step reads, and the LoRA kernels widen them back and sum in float32.
    # embed_tokens / lm_head adapter parts stay in the model's dtype.
    lora_dtype: str = "float32"
    # Request bounds (engine/intake.py, RequestBounds), a RequestError (400) naming the param past them: the
    # choices of one prompt may generate this many tokens together, n x max_tokens (each choice's real maximum:
    # the server sets max_tokens to the rest of the context when the client gives none); None: 16 x the context.
    max_request_output_tokens: int | None = None
    # The most prompt tokens one request may ask prompt logprobs of; None: the context length.
    max_prompt_logprobs_tokens: int | None = None
    # The most entries one request's LoRA plan (an adapter mix) may have: each is held and pinned in a slot.
    max_adapters_per_request: int = 4
    # Speculative decoding (n-gram drafts verified in the step's one forward pass); None: off. A dict or JSON
    # text of vLLM's keys is normalised to a ``SpeculativeConfig``.
    speculative_config: SpeculativeConfig | None = None
    # Structured-output grammars compile in this many worker processes (engine/sampling/structured/compile_pool.py:
    # a tenant may hold all but one of them), each compile within this many seconds (past it: a 400 on
    # structured_outputs, and the worker is killed).
    grammar_compile_workers: int = 2
    grammar_compile_timeout_s: float = 10.0
    # Start those workers with the engine (``loraplex serve``) rather than on the first structured request.
    grammar_compile_warm: bool = False

    QUANTIZATIONS: ClassVar[tuple[str, ...]] = ("int8",)
    LORA_DTYPES: ClassVar[tuple[str, ...]] = ("float32", "bfloat16")
    SCHEDULING_POLICIES: ClassVar[tuple[str, ...]] = ("fair", "fcfs")

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config", SpeculativeConfig.of(self.speculative_config))
        if self.lora_kernels not in LORA_KERNELS:
            raise ValueError(f"EngineConfig.lora_kernels must be one of {LORA_KERNELS}, got {self.lora_kernels!r}")
        for field in ("max_loras", "max_cpu_loras", "max_lora_rank", "max_num_seqs", "block_size",
                      "max_num_batched_tokens", "max_adapters_per_request"):
            if getattr(self, field) < 1:
                raise ValueError(f"EngineConfig.{field} must be >= 1, got {getattr(self, field)}")
        if self.quantization is not None and self.quantization not in self.QUANTIZATIONS:
            raise ValueError(f"EngineConfig.quantization must be None or one of {self.QUANTIZATIONS}, "
                             f"got {self.quantization!r}")
        if self.lora_dtype not in self.LORA_DTYPES:
            raise ValueError(f"EngineConfig.lora_dtype must be one of {self.LORA_DTYPES}, got {self.lora_dtype!r}")
        if self.scheduling_policy not in self.SCHEDULING_POLICIES:
            raise ValueError(f"EngineConfig.scheduling_policy must be one of {self.SCHEDULING_POLICIES}, "
                             f"got {self.scheduling_policy!r}")
        if self.saved_rows_budget_bytes < 0:
            raise ValueError(f"EngineConfig.saved_rows_budget_bytes must be >= 0, got {self.saved_rows_budget_bytes}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError(f"EngineConfig.max_waiting_requests must be >= 0 or None, got {self.max_waiting_requests}")
        for field in ("max_request_output_tokens", "max_prompt_logprobs_tokens"):
            if getattr(self, field) is not None and getattr(self, field) < 1:
                raise ValueError(f"EngineConfig.{field} must be >= 1 or None, got {getattr(self, field)}")
        if self.grammar_compile_workers < 1 or not self.grammar_compile_timeout_s > 0:
            raise ValueError(f"EngineConfig.grammar_compile_workers must be >= 1 and grammar_compile_timeout_s > 0, "
                             f"got {self.grammar_compile_workers}, {self.grammar_compile_timeout_s}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"EngineConfig.num_threads must be >= 1 or None, got {self.num_threads}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"EngineConfig.max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )
