"""PEFT adapter reading: the folded delta equals PEFT's, and every bad adapter fails alone and clearly."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from peft.tuners.lora import Linear as PeftLoraLinear
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from loraplex.adapters.manager import AdapterManager
from loraplex.adapters.reading.peft_format import AdapterWeights, read_peft_adapter
from loraplex.config import ModelConfig
from loraplex.errors import (
    AdapterNotFound,
    AdapterRankTooLarge,
    AdapterShapeMismatch,
    InvalidAdapter,
    UnsupportedAdapter,
)
from tests.fixtures import write_peft_adapter

PEFT_CASES = {
    "plain": dict(rank=8, alpha=16.0),
    "rslora": dict(rank=4, alpha=6.0, use_rslora=True),
    "patterns": dict(rank=4, alpha=8.0, rank_pattern={"q_proj": 2, "layers.1.mlp.down_proj": 6},
                     alpha_pattern={"v_proj": 3.0, r"layers\.0\.mlp\.up_proj": 20.0}),
    "regex_targets": dict(rank=3, alpha=5.0, target_modules=r".*layers\.1\.self_attn\.(q|v)_proj"),
}


@pytest.mark.parametrize("case", PEFT_CASES)
@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])
def test_folded_delta_equals_peft(case: str, arch: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    base = request.getfixturevalue(arch)
    folder = write_peft_adapter(base, tmp_path / case, seed=7, **PEFT_CASES[case])
    weights = read_peft_adapter(folder, ModelConfig.from_hf(base), max_lora_rank=16)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                           folder).eval()
    peft_modules = {name: m for name, m in peft_model.named_modules() if isinstance(m, PeftLoraLinear)}
    expected_keys = {(int(n.split(".layers.")[1].split(".")[0]), n.rsplit(".", 1)[1]) for n in peft_modules}
    assert set(weights.modules) == expected_keys
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, module in peft_modules.items():
            key = (int(name.split(".layers.")[1].split(".")[0]), name.rsplit(".", 1)[1])
            a, b = weights.modules[key]  # [r, in], [out, r]
            x = torch.randn(5, a.shape[1], generator=generator)  # [5, in]
            peft_delta = module(x) - module.base_layer(x)  # [5, out]
            assert a.shape[0] == module.r["default"]
            torch.testing.assert_close(x @ a.t() @ b.t(), peft_delta, rtol=1e-5, atol=1e-6)
    assert weights.max_rank == max(a.shape[0] for a, _ in weights.modules.values())
    assert weights.nbytes == sum(a.nbytes + b.nbytes for a, b in weights.modules.values())


def test_rslora_scale_differs_from_plain(tiny_llama: Path, tmp_path: Path) -> None:
    """Same tensors, rsLoRA on vs off: B differs exactly by sqrt(r) (alpha/sqrt(r) vs alpha/r)."""
    plain = write_peft_adapter(tiny_llama, tmp_path / "plain", rank=4, alpha=6.0, seed=3)
    rs = tmp_path / "rs"
    shutil.copytree(plain, rs)
    _edit_config(rs, use_rslora=True)
    mc = ModelConfig.from_hf(tiny_llama)
    w_plain, w_rs = read_peft_adapter(plain, mc, 16), read_peft_adapter(rs, mc, 16)
    for key, (_, b) in w_plain.modules.items():
        torch.testing.assert_close(w_rs.modules[key][1], b * 2.0)
    assert w_plain.content_hash != w_rs.content_hash


def test_named_adapter_keys_half_precision_and_pickle(tiny_llama_adapters: dict[str, Path], tiny_llama: Path,
                                                     tmp_path: Path) -> None:
    """``.lora_A.default.weight`` keys and bf16 tensors read as the same adapter; pickles only when allowed."""
    src = tiny_llama_adapters["r4_attn"]
    mc = ModelConfig.from_hf(tiny_llama)
    original = read_peft_adapter(src, mc, 16)
    named = _copy(src, tmp_path / "named", tensors=lambda t: {
        k.replace(".weight", ".default.weight"): v for k, v in t.items()})
    assert read_peft_adapter(named, mc, 16).content_hash == original.content_hash
    half = _copy(src, tmp_path / "bf16", tensors=lambda t: {k: v.to(torch.bfloat16) for k, v in t.items()})
    for key, (a, b) in read_peft_adapter(half, mc, 16).modules.items():
        assert a.dtype == torch.float32
        torch.testing.assert_close(b, original.modules[key][1], rtol=1e-2, atol=1e-3)
    pickled = _copy(src, tmp_path / "pickled")
    torch.save(load_file(pickled / "adapter_model.safetensors"), pickled / "adapter_model.bin")
    (pickled / "adapter_model.safetensors").unlink()
    with pytest.raises(UnsupportedAdapter, match="pickle") as info:
        read_peft_adapter(pickled, mc, 16)
    assert str(pickled) in str(info.value)
    assert read_peft_adapter(pickled, mc, 16, allow_pickle=True).content_hash == original.content_hash


def _edit_config(folder: Path, **changes: object) -> None:
    path = folder / "adapter_config.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), **changes)))


def _copy(src: Path, dst: Path, config: dict | None = None,
          tensors: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None) -> Path:
    shutil.copytree(src, dst)
    if config:
        _edit_config(dst, **config)
    if tensors:
        file = dst / "adapter_model.safetensors"
        save_file(tensors(load_file(file)), file)
    return dst


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


EMBED_LORA = "base_model.model.model.embed_tokens.lora_embedding_"


def _with(key: str, value: torch.Tensor) -> Callable[[dict], dict]:
    return lambda t: dict(t, **{key: value})


def _without(key: str) -> Callable[[dict], dict]:
    return lambda t: {k: v for k, v in t.items() if k != key}


def _renamed(old: str, new: str) -> Callable[[dict], dict]:
    return lambda t: {k.replace(old, new): v for k, v in t.items()}


def _nan(t: dict) -> dict:
    bad = t[Q_B].clone()
    bad[0, 0] = float("nan")
    return dict(t, **{Q_B: bad})


def _unlink(name: str) -> Callable[[Path], None]:
    return lambda folder: (folder / name).unlink()


# id -> (adapter fixture name, config changes, tensor edit, file edit, max rank, error, message fragments)
BAD = {
    "missing_folder": ("r4_attn", None, None, shutil.rmtree, 16, AdapterNotFound, ["no adapter folder"]),
    "missing_config": ("r4_attn", None, None, _unlink("adapter_config.json"), 16, AdapterNotFound,
                       ["no adapter_config.json"]),
    "malformed_json": ("r4_attn", None, None, lambda f: (f / "adapter_config.json").write_text("{r: 4"), 16,
                       InvalidAdapter, ["adapter_config.json is not valid JSON"]),
    "bad_r": ("r4_attn", {"r": 0}, None, None, 16, InvalidAdapter, ["r must be a positive integer, got 0"]),
    "rank_over_limit": ("r16_mlp", None, None, None, 8, AdapterRankTooLarge,
                        ["model.layers.0.mlp.down_proj", "rank 16", "max_lora_rank=8"]),
    "dora_without_magnitudes": ("r4_attn", {"use_dora": True}, None, None, 16, InvalidAdapter,
                                ["use_dora=true", "'model.layers.0.self_attn.k_proj' has no lora_magnitude_vector"]),
    "magnitude_without_dora": ("r4_attn", None, _with(Q_A.replace("lora_A.weight", "lora_magnitude_vector"),
                                                      torch.ones(64)), None, 16, InvalidAdapter,
                               ["'model.layers.0.self_attn.q_proj' has a DoRA lora_magnitude_vector",
                                "use_dora is false"]),
    "bias": ("r4_attn", {"bias": "all"}, None, None, 16, UnsupportedAdapter, ["bias='all'"]),
    "modules_to_save_other": ("r4_attn", {"modules_to_save": ["lm_head", "norm"]}, None, None, 16,
                              UnsupportedAdapter, ["'norm' is not supported",
                                                   "saved embed_tokens and lm_head and a classification head"]),
    "modules_to_save_missing": ("r4_attn", {"modules_to_save": ["lm_head"]}, None, None, 16, InvalidAdapter,
                                ["modules_to_save lists lm_head", "no lm_head.weight tensor"]),
    "saved_not_listed": ("r4_attn", None, _with("base_model.model.lm_head.weight", torch.zeros(49152, 64)), None,
                         16, InvalidAdapter, ["'lm_head.weight' replaces lm_head", "modules_to_save=[]"]),
    "saved_other_module": ("r4_attn", None, _with("base_model.model.model.norm.weight", torch.ones(64)), None, 16,
                           InvalidAdapter, ["would replace or retrain module 'model.norm'"]),
    "trainable_tokens_other": ("r4_attn", {"trainable_token_indices": {"q_proj": [1]}}, None, None, 16,
                               UnsupportedAdapter, ["trainable_token_indices for 'q_proj' are not supported"]),
    "trainable_tokens_missing": ("r4_attn", {"trainable_token_indices": [3, 5]}, None, None, 16, InvalidAdapter,
                                 ["no embed_tokens.token_adapter.trainable_tokens_delta"]),
    "not_lora": ("r4_attn", {"peft_type": "IA3"}, None, None, 16, UnsupportedAdapter, ["peft_type 'IA3'"]),
    "lm_head_untargeted": ("r4_attn", None, _renamed("model.layers.0.self_attn.q_proj", "lm_head"), None, 16,
                           InvalidAdapter, ["LoRA tensors for 'lm_head'", "does not select"]),
    "unknown_module": ("r4_attn", None, _renamed("self_attn.q_proj", "self_attn.rotary"), None, 16, InvalidAdapter,
                       ["'model.layers.0.self_attn.rotary'", "does not have or loraplex does not adapt",
                        "embed_tokens, lm_head"]),
    "embedding_shape": ("r4_attn", {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "embed_tokens"]},
                        lambda t: dict(t, **{f"{EMBED_LORA}A": torch.zeros(4, 256),
                                             f"{EMBED_LORA}B": torch.zeros(64, 4)}), None, 16,
                        AdapterShapeMismatch, ["lora_embedding_A: 256 vocabulary rows", "fewer than the base"]),
    "embedding_half": ("r4_attn", {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "embed_tokens"]},
                       _with("base_model.model.model.embed_tokens.lora_embedding_A", torch.zeros(4, 49152)), None,
                       16, InvalidAdapter, ["embed_tokens has lora_A but no lora_B"]),
    "added_tokens_without_head_rows": ("r4_attn", {"modules_to_save": ["embed_tokens"]},
                                       _with("base_model.model.model.embed_tokens.weight", torch.zeros(49154, 64)),
                                       None, 16, InvalidAdapter,
                                       ["vocabulary has 49154 tokens", "no lm_head rows for token ids [49152, 49153]"]),
    "layer_out_of_range": ("r4_attn", None, _renamed("layers.1.", "layers.7."), None, 16, InvalidAdapter,
                           ["layer 7 is out of range", "2 layers"]),
    "untargeted_module": ("r4_attn", {"target_modules": ["q_proj", "k_proj", "v_proj"]}, None, None, 16,
                          InvalidAdapter, ["'model.layers.0.self_attn.o_proj'", "target_modules"]),
    "layers_to_transform": ("r4_attn", {"layers_to_transform": [0]}, None, None, 16, InvalidAdapter,
                            ["'model.layers.1.self_attn.k_proj'", "layers_to_transform"]),
    "shape_a": ("r4_attn", None, _with(Q_A, torch.zeros(4, 32)), None, 16, AdapterShapeMismatch,
                ["q_proj.lora_A has shape [4, 32], expected [4, 64]"]),
    "shape_b_rank": ("r4_attn", None, _with(Q_B, torch.zeros(64, 3)), None, 16, AdapterShapeMismatch,
                     ["q_proj.lora_B has shape [64, 3], expected [64, 4]"]),
    "missing_b": ("r4_attn", None, _without(Q_B), None, 16, InvalidAdapter,
                  ["'model.layers.0.self_attn.q_proj' has lora_A but no lora_B"]),
    "nan": ("r4_attn", None, _nan, None, 16, InvalidAdapter, ["q_proj.lora_B contains NaN or inf"]),
    "inf": ("r4_attn", None, _with(Q_A, torch.full((4, 64), float("inf"))), None, 16, InvalidAdapter,
            ["q_proj.lora_A contains NaN or inf"]),
    "zero_modules": ("r4_attn", None, lambda t: {}, None, 16, InvalidAdapter, ["applies to zero modules"]),
    "missing_safetensors": ("r4_attn", None, None, _unlink("adapter_model.safetensors"), 16, InvalidAdapter,
                            ["no adapter_model.safetensors"]),
    "corrupt_safetensors": ("r4_attn", None, None,
                            lambda f: (f / "adapter_model.safetensors").write_bytes(b"\x08garbage"), 16,
                            InvalidAdapter, ["adapter_model.safetensors: header length", "runs past the end of the "
                                             "file (8 bytes)"]),
}


class NullWriter:
    """A slot writer that writes nothing (the manager without a model)."""

    def prepare(self, weights: AdapterWeights) -> AdapterWeights:
        return weights

    def set_slot(self, slot: int, weights: AdapterWeights) -> None:
        pass

    def clear_slot(self, slot: int) -> None:
        pass


@pytest.mark.parametrize("case", BAD)
def test_bad_adapter_fails_alone(case: str, tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
                                 tmp_path: Path) -> None:
    source, config, tensors, edit, max_rank, error, fragments = BAD[case]
    folder = _copy(tiny_llama_adapters[source], tmp_path / case, config, tensors)
    if edit is not None:
        edit(folder)
    manager = AdapterManager(ModelConfig.from_hf(tiny_llama), max_loras=2, max_cpu_loras=2,
                             max_lora_rank=max_rank, writer=NullWriter())
    good = manager.load("good", tiny_llama_adapters["r2_qv"])
    manager.acquire(good.version_id)
    before = (manager.list(), list(manager.slot_table.slots), manager.slot_table.version, manager.counters())
    with pytest.raises(error) as info:
        manager.load("bad", folder)
    assert type(info.value) is error
    message = str(info.value)
    assert str(folder) in message
    for fragment in fragments:
        assert fragment in message
    assert before == (manager.list(), list(manager.slot_table.slots), manager.slot_table.version,
                      manager.counters())
    manager.check_integrity()
    manager.close()
