"""Config normalisation of the families against HF's own config classes (layer types, windows, rope
bases and scaling, soft-capping, multipliers, NoPE layers, partial rotary, experts, as the files on the Hub
and current transformers write them), the rotary tables against HF's rotary modules, and precise errors
for what is not supported."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma3TextConfig,
    GraniteConfig,
    GraniteMoeConfig,
    Phi3Config,
    Qwen3Config,
    Qwen3MoeConfig,
    SmolLM3Config,
)
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from loraplex.config import ExpertConfig
from loraplex.errors import ModelError
from loraplex.layers.rotary import RotaryEmbedding
from loraplex.models.registry import model_config
from tests.fixtures import tiny_config

SMALL = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)

# What gemma-3-1b-it's config.json holds (written before transformers had layer_types/rope_parameters)
GEMMA3_HUB = dict(SMALL, architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", num_hidden_layers=8,
                  head_dim=16, query_pre_attn_scalar=16, sliding_window=512, sliding_window_pattern=6,
                  rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, rope_scaling=None,
                  final_logit_softcapping=None, attn_logit_softcapping=None, max_position_embeddings=32768,
                  bos_token_id=2, eos_token_id=[1, 106], pad_token_id=0)


def test_gemma3_hub_config_matches_hf() -> None:
    ours = model_config(GEMMA3_HUB)
    hf = Gemma3TextConfig(**{k: v for k, v in GEMMA3_HUB.items() if k != "architectures"})
    assert ours.layer_types == tuple(hf.layer_types)
    assert ours.layer_types.count("full_attention") == 1 and ours.layer_types[5] == "full_attention"
    assert ours.attention_windows() == (512, None)
    assert (ours.rope_theta, ours.local_rope_theta) == (hf.rope_parameters["full_attention"]["rope_theta"],
                                                        hf.rope_parameters["sliding_attention"]["rope_theta"])
    assert ours.tie_word_embeddings and ours.hidden_act == "gelu_pytorch_tanh" and ours.query_pre_attn_scalar == 16
    written = model_config({**hf.to_dict(), "architectures": ["Gemma3ForCausalLM"]})  # current transformers' form
    assert written == ours


def test_gemma3_rotary_per_layer_type_matches_hf() -> None:
    """Global layers: rope_theta with linear scaling (the 4B+ text configs); local: rope_local_base_freq."""
    raw = {**GEMMA3_HUB, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    cfg = model_config(raw)
    assert cfg.rope_scaling.rope_type == "linear" and cfg.local_rope_scaling.rope_type == "default"
    hf = Gemma3RotaryEmbedding(Gemma3TextConfig(**{k: v for k, v in raw.items() if k != "architectures"}))
    positions = torch.arange(40)
    for layer_type, ours in (("full_attention", RotaryEmbedding(cfg, "cpu")),
                             ("sliding_attention", RotaryEmbedding(cfg, "cpu", cfg.local_rope_theta,
                                                                   cfg.local_rope_scaling))):
        cos_ref, sin_ref = hf(torch.zeros(1), positions[None], layer_type)
        cos, signed_sin = ours.cos_sin(positions, torch.full((40,), 40), torch.float32)
        torch.testing.assert_close(cos[:, 0], cos_ref[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(signed_sin[:, 0, 8:], sin_ref[0, :, 8:], rtol=0, atol=1e-6)


def test_gemma3_refuses_bidirectional_attention() -> None:
    with pytest.raises(ModelError, match="Gemma 3 with use_bidirectional_attention=True"):
        model_config({**GEMMA3_HUB, "use_bidirectional_attention": True})


def test_gemma3_reads_soft_capping_when_set() -> None:
    assert (model_config(GEMMA3_HUB).attn_logit_softcapping, model_config(GEMMA3_HUB).final_logit_softcapping) == (
        None, None)
    capped = model_config({**GEMMA3_HUB, "attn_logit_softcapping": 50, "final_logit_softcapping": 30.0})
    assert (capped.attn_logit_softcapping, capped.final_logit_softcapping) == (50.0, 30.0)
    with pytest.raises(ModelError, match="final_logit_softcapping must be a positive number or null, got -1"):
        model_config({**GEMMA3_HUB, "final_logit_softcapping": -1})


# What gemma-2-2b's config.json holds (no layer_types: HF derives them; soft-capping 50 / 30)
GEMMA2_HUB = dict(SMALL, architectures=["Gemma2ForCausalLM"], model_type="gemma2", num_hidden_layers=5, head_dim=16,
                  query_pre_attn_scalar=16, sliding_window=4096, attn_logit_softcapping=50.0,
                  final_logit_softcapping=30.0, hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
                  rope_theta=10000.0, cache_implementation="hybrid", max_position_embeddings=8192, bos_token_id=2,
                  eos_token_id=[1, 107], pad_token_id=0)


def test_gemma2_hub_config_matches_hf() -> None:
    ours = model_config(GEMMA2_HUB)
    hf = Gemma2Config(**{k: v for k, v in GEMMA2_HUB.items() if k not in ("architectures", "cache_implementation")})
    assert ours.layer_types == tuple(hf.layer_types) == ("sliding_attention", "full_attention") * 2 + (
        "sliding_attention",)
    assert ours.attention_windows() == (4096, None)
    assert (ours.attn_logit_softcapping, ours.final_logit_softcapping) == (50.0, 30.0)
    assert ours.rope_theta == ours.local_rope_theta == hf.rope_parameters["rope_theta"]
    assert ours.tie_word_embeddings and ours.query_pre_attn_scalar == 16 and ours.hidden_act == "gelu_pytorch_tanh"
    written = model_config({**hf.to_dict(), "architectures": ["Gemma2ForCausalLM"]})  # current transformers' form
    assert written == ours
    defaults = model_config({k: v for k, v in GEMMA2_HUB.items() if "softcapping" not in k})  # HF's defaults
    assert (defaults.attn_logit_softcapping, defaults.final_logit_softcapping) == (50.0, 30.0)


GRANITE_HUB = dict(SMALL, architectures=["GraniteForCausalLM"], model_type="granite", num_hidden_layers=2,
                   attention_multiplier=0.015625, embedding_multiplier=12.0, logits_scaling=8.0,
                   residual_multiplier=0.22, rope_theta=5_000_000.0, tie_word_embeddings=True, attention_bias=False,
                   mlp_bias=False)


@pytest.mark.parametrize("arch", ["GraniteForCausalLM", "GraniteMoeForCausalLM"])
def test_granite_multipliers_match_hf(arch: str) -> None:
    raw = {**GRANITE_HUB, "architectures": [arch]}
    ours = model_config(raw)
    hf = (GraniteConfig if arch == "GraniteForCausalLM" else GraniteMoeConfig)(
        **{k: v for k, v in raw.items() if k not in ("architectures", "mlp_bias")})
    for key in ("attention_multiplier", "embedding_multiplier", "logits_scaling", "residual_multiplier"):
        assert getattr(ours, key) == getattr(hf, key), key
    bare = model_config({k: v for k, v in raw.items() if "multiplier" not in k and k != "logits_scaling"})
    assert (bare.attention_multiplier, bare.embedding_multiplier, bare.residual_multiplier, bare.logits_scaling) == (
        1.0, 1.0, 1.0, 1.0)  # HF's defaults (an attention scale of 1, not 1 / sqrt(d))
    with pytest.raises(ModelError, match=f"{arch} with mlp_bias=true is not supported"):
        model_config({**raw, "mlp_bias": True})


@pytest.mark.parametrize(("interval", "window"), [(4, None), (2, 8)])
def test_smollm3_nope_layers_match_hf(interval: int, window: int | None) -> None:
    """SmolLM3-3B's file lists no_rope_layers; HF derives them from the interval otherwise, and with a sliding
    window makes the NoPE layers slide."""
    raw = dict(SMALL, architectures=["SmolLM3ForCausalLM"], num_hidden_layers=8, no_rope_layer_interval=interval,
               use_sliding_window=window is not None, sliding_window=window, pad_token_id=0)
    hf = SmolLM3Config(**{k: v for k, v in raw.items() if k != "architectures"})
    ours = model_config(raw)
    assert ours.rope_layers == tuple(bool(f) for f in hf.no_rope_layers)
    assert ours.rope_layers.count(False) == 8 // interval and not ours.rope_layers[interval - 1]
    assert ours.layer_types in (tuple(hf.layer_types), ())
    assert [ours.layer_window(i) for i in range(8)] == [window if t == "sliding_attention" else None
                                                       for t in hf.layer_types]
    listed = model_config({**raw, "no_rope_layers": [1, 0] * 4})
    assert listed.rope_layers == (True, False) * 4
    with pytest.raises(ModelError, match="no_rope_layers must hold one 0 or 1 per layer"):
        model_config({**raw, "no_rope_layers": [1, 0]})


# What Qwen3-30B-A3B's config.json holds for its experts (sizes shrunk)
QWEN3_MOE_HUB = dict(SMALL, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_hidden_layers=2,
                     head_dim=16, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=24, norm_topk_prob=True,
                     decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False, sliding_window=None)


def test_qwen3_moe_hub_config_matches_hf() -> None:
    ours = model_config(QWEN3_MOE_HUB)
    hf = Qwen3MoeConfig(**{k: v for k, v in QWEN3_MOE_HUB.items() if k != "architectures"})
    assert ours.experts == ExpertConfig(num_experts=hf.num_experts, top_k=hf.num_experts_per_tok,
                                        intermediate_size=hf.moe_intermediate_size, routing="softmax_topk",
                                        normalize_top_k=hf.norm_topk_prob)
    written = model_config({**hf.to_dict(), "architectures": ["Qwen3MoeForCausalLM"]})  # num_local_experts
    assert written.experts == ours.experts
    projections = ours.projections()
    assert projections["gate_up_proj"].experts == 16 and projections["gate_up_proj"].out_features == 48
    assert (projections["gate"].in_features, projections["gate"].out_features) == (64, 16)
    with pytest.raises(ModelError, match=r"num_experts_per_tok=20 must be in \[1, num_experts=16\]"):
        model_config({**QWEN3_MOE_HUB, "num_experts_per_tok": 20})


def test_granite_moe_hub_config_matches_hf() -> None:
    raw = {**GRANITE_HUB, "architectures": ["GraniteMoeForCausalLM"], "num_local_experts": 32,
           "num_experts_per_tok": 8, "intermediate_size": 40}
    hf = GraniteMoeConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "mlp_bias")})
    ours = model_config(raw)
    assert ours.experts == ExpertConfig(num_experts=hf.num_local_experts, top_k=hf.num_experts_per_tok,
                                        intermediate_size=hf.intermediate_size, routing="topk_softmax")
    assert ours.projections()["down_proj"].parent == "block_sparse_moe.experts"


@pytest.mark.parametrize(("use", "max_window_layers", "expect"), [
    (True, 1, ("full_attention", "sliding_attention", "sliding_attention")),
    (False, 1, ()),
    (True, 3, ("full_attention",) * 3),
])
def test_qwen_sliding_window_switch_matches_hf(use: bool, max_window_layers: int, expect: tuple[str, ...]) -> None:
    """Released Qwen configs carry use_sliding_window / max_window_layers and no layer_types."""
    raw = dict(SMALL, architectures=["Qwen3ForCausalLM"], num_hidden_layers=3, head_dim=16, sliding_window=5,
               use_sliding_window=use, max_window_layers=max_window_layers)
    ours = model_config(raw)
    hf = Qwen3Config(**{k: v for k, v in raw.items() if k != "architectures"})
    assert tuple(hf.layer_types) == (expect or ("full_attention",) * 3)
    assert ours.layer_types == expect
    assert [ours.layer_window(i) for i in range(3)] == [hf.sliding_window if t == "sliding_attention" else None
                                                        for t in hf.layer_types]


def test_phi3_window_applies_to_every_layer_and_longrope_parses() -> None:
    """Phi-3-mini-4k has sliding_window 2047 (HF masks every layer with it); LongRoPE's attention factor
    is sqrt(1 + ln(factor) / ln(original)) with factor = max / original positions."""
    raw = {**tiny_config("phi3", sliding_window=2047).to_dict(), "architectures": ["Phi3ForCausalLM"]}
    cfg = model_config(raw)
    assert cfg.attention_windows() == (2047,)
    assert cfg.rope_scaling.rope_type == "longrope" and cfg.rope_scaling.original_max_position_embeddings == 32
    assert cfg.rope_scaling.attention_factor == pytest.approx(math.sqrt(1 + math.log(4) / math.log(32)))
    old = {**raw, "rope_parameters": None, "rope_scaling": {**raw["rope_parameters"], "type": "su", "rope_type": "su"}}
    assert model_config(old).rope_scaling == cfg.rope_scaling  # "su" is LongRoPE's old name


@pytest.mark.parametrize("seq_len", [20, 32, 33, 60])
def test_longrope_tables_match_hf_on_both_sides_of_the_switch(seq_len: int) -> None:
    hf_cfg = tiny_config("phi3")
    ours = RotaryEmbedding(model_config({**hf_cfg.to_dict(), "architectures": ["Phi3ForCausalLM"]}), "cpu")
    positions = torch.arange(seq_len)
    cos_ref, sin_ref = Phi3RotaryEmbedding(Phi3Config(**hf_cfg.to_dict()))(torch.zeros(1), positions[None])
    cos, signed_sin = ours.cos_sin(positions, torch.full((seq_len,), seq_len), torch.float32)
    half = cos.shape[-1] // 2
    torch.testing.assert_close(cos[:, 0], cos_ref[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(signed_sin[:, 0, half:], sin_ref[0, :, half:], rtol=0, atol=1e-6)
    torch.testing.assert_close(signed_sin[:, 0, :half], -sin_ref[0, :, :half], rtol=0, atol=1e-6)


@pytest.mark.parametrize(("change", "message"), [
    ({"partial_rotary_factor": 0.7}, r"partial_rotary_factor=0\.7 must give an even rotary dimension in \(0, "
     r"head_dim=16\], got 11"),
    ({"long_factor": [1.0] * 3}, r"longrope needs short_factor and long_factor of head_dim / 2 = 8 entries each"),
    ({"rope_type": "yarn", "type": "yarn"}, r"unsupported rope_scaling type 'yarn'"),
])
def test_phi3_rope_it_cannot_compute_is_refused(change: dict, message: str) -> None:
    raw = {**tiny_config("phi3").to_dict(), "architectures": ["Phi3ForCausalLM"]}
    with pytest.raises(ModelError, match=message):
        model_config({**raw, "rope_parameters": {**raw["rope_parameters"], **change}})


# What Phi-4-mini-instruct's config.json holds (sizes shrunk: head_dim 16, rope on 12 of them)
def phi4_mini_hub(long_factors: int = 6) -> dict:
    return dict(SMALL, architectures=["Phi3ForCausalLM"], model_type="phi3", num_hidden_layers=2,
                partial_rotary_factor=0.75, original_max_position_embeddings=32, max_position_embeddings=128,
                rope_theta=10000.0, sliding_window=262144, tie_word_embeddings=True,
                rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(6)],
                              "long_factor": [2.0 + 0.5 * i for i in range(long_factors)]})


@pytest.mark.parametrize("seq_len", [20, 33])
def test_phi4_mini_partial_rotary_tables_match_hf(seq_len: int) -> None:
    raw = phi4_mini_hub()
    cfg = model_config(raw)
    assert cfg.rotary_dim == 12 and cfg.head_dim == 16
    hf_cfg = Phi3Config(**{k: v for k, v in raw.items() if k != "architectures"})
    cos_ref, sin_ref = Phi3RotaryEmbedding(hf_cfg)(torch.zeros(1), torch.arange(seq_len)[None])
    cos, signed_sin = RotaryEmbedding(cfg, "cpu").cos_sin(torch.arange(seq_len), torch.full((seq_len,), seq_len),
                                                          torch.float32)
    assert cos.shape[-1] == cos_ref.shape[-1] == 12
    torch.testing.assert_close(cos[:, 0], cos_ref[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(signed_sin[:, 0, 6:], sin_ref[0, :, 6:], rtol=0, atol=1e-6)
    with pytest.raises(ModelError, match=r"longrope needs short_factor and long_factor of the rotary dimension / 2 "
                       r"= 6"):
        model_config(phi4_mini_hub(long_factors=8))


def test_unknown_layer_type_and_activation_are_refused() -> None:
    raw = dict(SMALL, architectures=["Qwen3ForCausalLM"], num_hidden_layers=2, head_dim=16)
    with pytest.raises(ModelError, match=r"unsupported layer_types \['chunked_attention'\]"):
        model_config({**raw, "layer_types": ["full_attention", "chunked_attention"]})
    with pytest.raises(ModelError, match="layer_types has 1 entries for 2 layers"):
        model_config({**raw, "layer_types": ["full_attention"]})
    from loraplex.models.loader import load_model  # the activation is checked when the model is built

    with pytest.raises(ModelError, match="unsupported activation 'relu2'"):
        load_model("/nonexistent", model_config({**raw, "hidden_act": "relu2"}), 1, 4, torch.float32, "cpu")
