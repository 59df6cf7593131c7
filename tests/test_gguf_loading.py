"""GGUF checkpoints served as they are (issue 33): tiny GGUF files written from random tiny checkpoints
(tests/gguf_fixtures.py) against HF transformers loading the same files (which dequantizes them): the
config, the tokenizer and chat template, logits within 1e-4 and greedy tokens, LoRA adapters on top (HF +
PEFT on the GGUF-loaded model), which weights stay in blocks, and clear errors for bad files and folders."""

from __future__ import annotations

import dataclasses
import shutil
from functools import lru_cache
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from loraplex import LLM, SamplingParams
from loraplex.layers.lora_linear import LoRALinear
from loraplex.models.embedded import resolve_model
from loraplex.models.gguf.metadata import hf_config
from loraplex.models.gguf.reader import GGUFError
from loraplex.models.loader import load_model
from loraplex.models.registry import model_config
from loraplex.ops.gguf.block_weight import BlockWeight
from tests.conftest import ADAPTER_SPECS, family_targets
from tests.engine_harness import capture_step_logits
from tests.fixtures import write_peft_adapter, write_tiny_model
from tests.gguf_fixtures import write_tiny_gguf
from tests.model_harness import ShuffledBlocks, assert_logits_close, greedy, make_runner, random_prompts

# name -> (family, HF config overrides, tensor types: GGUF name fragment -> type). The files carry no tokenizer
# (transformers spends seconds reading SmolLM2's) but TOKENIZED's, written from the same checkpoint as its case.
TOKENIZED = "llama-q4_0+tokenizer"
CASES = {
    "llama-q4_0": ("llama", {}, {"default": "Q4_0", "token_embd": "Q8_0", "attn_v": "Q8_0"}),
    "llama-q4_1-untied": ("llama", {"tie_word_embeddings": False}, {"default": "Q4_1", "output.": "Q4_0"}),
    "qwen2-q8_0": ("qwen2", {}, {"default": "Q8_0", "token_embd": "Q4_1"}),
    "qwen3-q4_1": ("qwen3", {"head_dim": 128}, {"default": "Q4_1", "token_embd": "Q8_0"}),  # HF reads no head_dim
    "llama-kquants": ("llama", {"hidden_size": 256, "intermediate_size": 256},
                      {"default": "Q4_K", "attn_v": "Q6_K", "ffn_down": "Q5_K", "token_embd": "Q8_0"}),
}


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each case's GGUF file, alone in its folder (the HF checkpoint it came from beside it)."""
    out = {}
    for name, (family, overrides, types) in CASES.items():
        root = tmp_path_factory.mktemp(f"gguf-{name}")
        hf = write_tiny_model(root / "hf", family, **overrides)
        (root / "gguf").mkdir()
        out[name] = write_tiny_gguf(hf, root / "gguf" / f"{name}.gguf", types, tokenizer=False)
        if TOKENIZED.startswith(f"{name}+"):
            (root / "tokenized").mkdir()
            out[TOKENIZED] = write_tiny_gguf(hf, root / "tokenized" / "tokenized.gguf", types)
    return out


@lru_cache(maxsize=8)
def hf_gguf(path: Path) -> torch.nn.Module:
    """HF transformers' model of the GGUF file (dequantized to float32)."""
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def _without_layer_types(cfg):  # noqa: ANN001, ANN202 - a ModelConfig of any family
    """HF lists ``full_attention`` per layer where it has no sliding window; loraplex leaves it empty."""
    if all(t == "full_attention" for t in cfg.layer_types):
        return dataclasses.replace(cfg, layer_types=())
    return cfg


@pytest.mark.parametrize("case", [*CASES, TOKENIZED])
def test_config_is_transformers_reading_of_the_metadata(gguf_files: dict[str, Path], case: str) -> None:
    path = gguf_files[case]
    ours = hf_config(path)
    theirs = AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict()
    theirs["architectures"] = ours["architectures"]
    assert _without_layer_types(model_config(ours)) == _without_layer_types(model_config(theirs))
    assert model_config(path) == model_config(ours)  # the file itself, through the registry


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_greedy_tokens_equal_hf_on_the_same_file(gguf_files: dict[str, Path], case: str) -> None:
    """Prefill and decode logits within 1e-4 of HF's scale, greedy tokens equal, for each case (every block
    type kept in its blocks)."""
    path = gguf_files[case]
    runner = make_runner(path)
    prompts = random_prompts([5, 11, 3], 49152, seed=1)
    tokens, logits = greedy(runner, prompts, 6, ShuffledBlocks(runner))
    ref = hf_gguf(path)
    for i, prompt in enumerate(prompts):
        seq = prompt + tokens[i]
        with torch.inference_mode():
            ref_logits = ref(torch.tensor([seq])).logits[0].float()
        for step, step_logits in enumerate(logits):
            assert_logits_close(step_logits[i], ref_logits[len(prompt) - 1 + step])
        assert tokens[i] == ref_logits[len(prompt) - 1 : -1].argmax(-1).tolist()


def _block_layers(model: torch.nn.Module) -> list[bool]:
    return [isinstance(m.int8_weight, BlockWeight) for m in model.modules() if isinstance(m, LoRALinear)]


def test_native_block_types_stay_in_blocks(gguf_files: dict[str, Path]) -> None:
    """Q4_0 / Q4_1 / Q8_0 / K-quant projections and lm_heads are BlockWeights (no float copy)."""
    model = load_model(gguf_files["llama-q4_0"], None, 2, 8, torch.float32, "cpu")
    assert all(_block_layers(model)) and isinstance(model.lm_head_int8, BlockWeight)
    qkv = model.layers[0].self_attn.qkv_proj.int8_weight
    assert [s.qtype for s in qkv.segments] == ["Q4_0", "Q8_0"]  # q, k in Q4_0 then v in Q8_0
    assert model.layers[0].self_attn.qkv_proj.weight is None
    untied = load_model(gguf_files["llama-q4_1-untied"], None, 2, 8, torch.float32, "cpu")
    assert untied.lm_head is None and untied.lm_head_int8.segments[0].qtype == "Q4_0"
    kquants = load_model(gguf_files["llama-kquants"], None, 2, 8, torch.float32, "cpu")
    assert all(_block_layers(kquants)) and isinstance(kquants.lm_head_int8, BlockWeight)
    qkv = kquants.layers[0].self_attn.qkv_proj.int8_weight
    assert [s.qtype for s in qkv.segments] == ["Q4_K", "Q6_K"]  # q, k in Q4_K then v in Q6_K
    assert kquants.layers[0].mlp.down_proj.int8_weight.segments[0].qtype == "Q5_K"


def test_tokenizer_and_chat_template_from_the_metadata(gguf_files: dict[str, Path]) -> None:
    """The engine's tokenizer is transformers' GGUF tokenizer: same ids, same chat template; text generation
    through ``LLM`` equals HF's greedy continuation (on the same weights without the tokenizer); a file
    without a tokenizer serves token ids only."""
    path = gguf_files[TOKENIZED]
    llm = LLM(model=str(path), max_loras=1, kv_cache_blocks=64)
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    text = "Hello GGUF world: <|im_start|> 123"
    assert llm.tokenizer.encode(text) == reference.encode(text)
    assert llm.tokenizer.chat_template == reference.chat_template and "<|im_start|>" in reference.chat_template
    assert llm.engine.model_name == path.name and llm.engine.model_path == path
    out = llm.generate(["The cat"], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    prompt = reference.encode("The cat", add_special_tokens=False)
    with torch.inference_mode():
        same_weights = hf_gguf(gguf_files[TOKENIZED.split("+")[0]])
        expected = same_weights.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False)[0, len(prompt):]
    assert out.token_ids == expected.tolist()
    assert LLM(model=str(gguf_files["qwen2-q8_0"]), max_loras=1, kv_cache_blocks=16).tokenizer is None  # none stored


@pytest.mark.parametrize("case", ["llama-q4_0", "llama-kquants"])
def test_adapters_on_a_gguf_base_equal_hf_peft(gguf_files: dict[str, Path], tmp_path: Path, case: str) -> None:
    """Mixed LoRA adapters (float) over Q4_0/Q8_0 or Q4_K/Q5_K/Q6_K block weights: greedy tokens equal HF + PEFT
    on the model HF loads from the same GGUF file, and first-step logits within 1e-4."""
    path = gguf_files[case]
    hf_folder = path.parent.parent / "hf"
    adapters = {name: write_peft_adapter(hf_folder, tmp_path / name, rank=ADAPTER_SPECS[name][0],
                                         alpha=2 * ADAPTER_SPECS[name][0], seed=i + 1,
                                         target_modules=family_targets(hf_folder, ADAPTER_SPECS[name][1]))
                for i, name in enumerate(("r8_all", "r4_attn"))}
    names = ["r8_all", "r4_attn", None]
    prompts = random_prompts([4, 7, 5, 9, 3, 6], 49152, seed=5)
    chosen = [names[i % 3] for i in range(len(prompts))]
    llm = LLM(model=str(path.parent), max_loras=2, kv_cache_blocks=128, debug_checks=True)  # the folder form
    for name in names[:-1]:
        llm.load_adapter(name, adapters[name])
    captured = capture_step_logits(llm.engine)
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), adapters=chosen)
    for row, (prompt, name) in enumerate(zip(prompts, chosen, strict=True)):
        base = hf_gguf(path)
        model = base if name is None else PeftModel.from_pretrained(base, str(adapters[name])).eval()
        with torch.inference_mode():
            expected = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):]
            first = model(torch.tensor([prompt])).logits[0, -1]
        if name is not None:
            model.unload()
        assert outs[row].token_ids == expected.tolist(), (row, name)
        assert torch.allclose(captured[0][row], first, atol=1e-4 * float(first.abs().max()), rtol=0), (row, name)


def test_model_paths_resolve_to_the_gguf_file(gguf_files: dict[str, Path], tmp_path: Path) -> None:
    path = gguf_files["qwen2-q8_0"]
    assert resolve_model(str(path)) == path and resolve_model(str(path.parent)) == path
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        shutil.copy(path, two / name)
    with pytest.raises(GGUFError, match="holds 2 GGUF files"):
        resolve_model(str(two))


def _corrupt(src: Path, dst: Path, edit) -> Path:  # noqa: ANN001 - bytes -> bytes
    dst.write_bytes(edit(src.read_bytes()))
    return dst


@pytest.mark.parametrize(("kind", "message"), [
    ("magic", "not a GGUF file"),
    ("header", "truncated or corrupt header"),
    ("data", "truncated: tensor"),
    ("empty", "cannot be read as a GGUF file"),
    ("version", "GGUF version 7"),
])
def test_corrupt_or_truncated_files_are_clear_errors(gguf_files: dict[str, Path], tmp_path: Path, kind: str,
                                                     message: str) -> None:
    edits = {"magic": lambda b: b"GGUX" + b[4:], "header": lambda b: b[:300], "data": lambda b: b[:-100],
             "empty": lambda b: b"", "version": lambda b: b[:4] + (7).to_bytes(4, "little") + b[8:]}
    bad = _corrupt(gguf_files["llama-q4_0"], tmp_path / "bad.gguf", edits[kind])
    with pytest.raises(GGUFError, match=message):
        load_model(bad, None, 1, 8, torch.float32, "cpu")


def test_unserved_architecture_is_a_clear_error(tmp_path: Path) -> None:
    from gguf import GGUFWriter

    writer = GGUFWriter(tmp_path / "m.gguf", "mamba")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match="'mamba' is not served from GGUF"):
        model_config(tmp_path / "m.gguf")
