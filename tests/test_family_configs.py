"""Config normalisation of the families against HF's own config classes (layer types, windows, rope
bases and scaling as the files on the Hub and current transformers write them), the rotary tables
against HF's rotary modules, and precise errors for what is not supported."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Gemma3TextConfig, Phi3Config, Qwen3Config
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

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


@pytest.mark.parametrize("key", ["final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention"])
def test_gemma3_refuses_what_it_does_not_compute(key: str) -> None:
    with pytest.raises(ModelError, match=f"Gemma 3 with {key}="):
        model_config({**GEMMA3_HUB, key: 30.0})


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
    ({"partial_rotary_factor": 0.75}, r"partial_rotary_factor=0\.75 is not supported"),
    ({"long_factor": [1.0] * 3}, r"longrope needs short_factor and long_factor of head_dim / 2 = 8 entries each"),
    ({"rope_type": "yarn", "type": "yarn"}, r"unsupported rope_scaling type 'yarn'"),
])
def test_phi3_rope_it_cannot_compute_is_refused(change: dict, message: str) -> None:
    raw = {**tiny_config("phi3").to_dict(), "architectures": ["Phi3ForCausalLM"]}
    with pytest.raises(ModelError, match=message):
        model_config({**raw, "rope_parameters": {**raw["rope_parameters"], **change}})


def test_unknown_layer_type_and_activation_are_refused() -> None:
    raw = dict(SMALL, architectures=["Qwen3ForCausalLM"], num_hidden_layers=2, head_dim=16)
    with pytest.raises(ModelError, match=r"unsupported layer_types \['chunked_attention'\]"):
        model_config({**raw, "layer_types": ["full_attention", "chunked_attention"]})
    with pytest.raises(ModelError, match="layer_types has 1 entries for 2 layers"):
        model_config({**raw, "layer_types": ["full_attention"]})
    from loraplex.models.loader import load_model  # the activation is checked when the model is built

    with pytest.raises(ModelError, match="unsupported activation 'relu2'"):
        load_model("/nonexistent", model_config({**raw, "hidden_act": "relu2"}), 1, 4, torch.float32, "cpu")
