"""Checkpoint loading: shards, ``model.`` prefixes, packed q/k/v and gate/up, tied embeddings, errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.config import ModelConfig
from loraplex.errors import ModelError
from loraplex.models.loader import load_model
from loraplex.models.registry import model_class, model_config, supported_architectures


def load(folder: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return load_model(folder, model_config(folder), 2, 8, dtype, "cpu")


def copy_with(src: Path, dst: Path, shards: list[dict[str, torch.Tensor]]) -> Path:
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    for i, shard in enumerate(shards):
        save_file(shard, str(dst / f"model-{i:05d}-of-{len(shards):05d}.safetensors"))
    return dst


def test_packed_weights_are_the_checkpoint_tensors(tiny_qwen2: Path) -> None:
    model, raw = load(tiny_qwen2), load_file(str(tiny_qwen2 / "model.safetensors"))
    attn, mlp = model.layers[1].self_attn, model.layers[1].mlp
    p = "model.layers.1."
    expect_qkv = torch.cat([raw[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(attn.qkv_proj.weight, expect_qkv)
    assert torch.equal(attn.qkv_proj.bias, torch.cat([raw[p + f"self_attn.{n}_proj.bias"] for n in "qkv"]))
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat([raw[p + "mlp.gate_proj.weight"],
                                                           raw[p + "mlp.up_proj.weight"]]))
    assert torch.equal(model.norm.weight, raw["model.norm.weight"])
    assert model.lm_head is None and model.lm_head_weight is model.embed_tokens.weight  # tied


def test_shards_without_prefix_load_the_same(tmp_path: Path, tiny_model: Path) -> None:
    raw = load_file(str(tiny_model / "model.safetensors"))
    names = sorted(raw)
    half = len(names) // 2
    shards = [{n: raw[n] for n in names[:half]},
              {n.removeprefix("model."): raw[n] for n in names[half:]}]
    ref, got = load(tiny_model), load(copy_with(tiny_model, tmp_path / "sharded", shards))
    ref_params, got_params = dict(ref.named_parameters()), dict(got.named_parameters())
    assert ref_params.keys() == got_params.keys()
    assert all(torch.equal(ref_params[n], got_params[n]) for n in ref_params)
    if not ref.config.tie_word_embeddings:
        assert torch.equal(got.lm_head.weight, raw["lm_head.weight"])


def test_dtype_conversion(tiny_llama: Path) -> None:
    model = load(tiny_llama, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    raw = load_file(str(tiny_llama / "model.safetensors"))
    assert torch.equal(model.embed_tokens.weight, raw["model.embed_tokens.weight"].to(torch.bfloat16))


def test_missing_tensor_is_named(tmp_path: Path, tiny_llama: Path) -> None:
    raw = load_file(str(tiny_llama / "model.safetensors"))
    del raw["model.layers.1.mlp.up_proj.weight"]
    folder = copy_with(tiny_llama, tmp_path / "missing", [raw])
    with pytest.raises(ModelError, match=r"lacks 1 tensors.*layers\.1\.mlp\.up_proj\.weight"):
        load(folder)


def test_misshaped_tensor_is_named(tmp_path: Path, tiny_llama: Path) -> None:
    raw = load_file(str(tiny_llama / "model.safetensors"))
    raw["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    folder = copy_with(tiny_llama, tmp_path / "bad", [raw])
    with pytest.raises(ModelError, match=r"k_proj\.weight.*\(16, 64\).*expects \(32, 64\)"):
        load(folder)


def test_folder_without_safetensors(tmp_path: Path, tiny_llama: Path) -> None:
    (tmp_path / "empty").mkdir()
    shutil.copy(tiny_llama / "config.json", tmp_path / "empty" / "config.json")
    with pytest.raises(ModelError, match="no \\*.safetensors"):
        load(tmp_path / "empty")


def test_unsupported_architecture_is_named(tmp_path: Path, tiny_llama: Path) -> None:
    with pytest.raises(ModelError, match="'GPT2LMHeadModel'"):
        model_class("GPT2LMHeadModel")
    assert set(supported_architectures()) == {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                              "Qwen3ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM",
                                              "Gemma2ForCausalLM", "GraniteForCausalLM", "SmolLM3ForCausalLM",
                                              "Qwen3MoeForCausalLM", "GraniteMoeForCausalLM"}
    raw = json.loads((tiny_llama / "config.json").read_text())
    raw["architectures"] = ["FalconForCausalLM"]
    with pytest.raises(ModelError, match="'FalconForCausalLM'"):
        model_config(raw)
    cfg = model_config(tiny_llama)
    bogus = type(cfg)(**{**cfg.__dict__, "architecture": "FalconForCausalLM"})
    with pytest.raises(ModelError, match="'FalconForCausalLM'"):
        load_model(tiny_llama, bogus, 2, 8, torch.float32, "cpu")


def test_config_of_another_family_is_refused(tiny_llama: Path) -> None:
    """A bare ``ModelConfig`` skips the family's normalisation (e.g. Qwen2's implicit q/k/v bias)."""
    with pytest.raises(ModelError, match="needs a LlamaFamilyConfig"):
        load_model(tiny_llama, ModelConfig.from_hf(tiny_llama), 2, 8, torch.float32, "cpu")


def test_checkpoint_tensor_without_a_place_is_an_error(tmp_path: Path, tiny_llama: Path) -> None:
    """A tensor the model does not read (e.g. a q_norm of another family) must not be dropped silently."""
    tensors = load_file(str(tiny_llama / "model.safetensors"))
    extra = copy_with(tiny_llama, tmp_path / "extra", [{**tensors, "model.layers.0.self_attn.q_norm.weight":
                                                         torch.ones(16)}])
    with pytest.raises(ModelError, match=r"1 tensors LlamaForCausalLM does not use: layers\.0\.self_attn\.q_norm"):
        load(extra)
