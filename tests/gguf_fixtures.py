"""Tiny GGUF files written as llama.cpp's converter writes them, from the tiny random HF checkpoints.

``write_tiny_gguf(hf_folder, path, types)`` stores every tensor of the HF checkpoint under its GGUF name
(gguf's own HF -> GGUF map), Llama q/k rows permuted as ``convert_hf_to_gguf.py`` permutes them, the model
hyper-parameters as llama.cpp's metadata keys, and the embedded SmolLM2 GGUF's tokenizer and chat template
(the tiny checkpoints share its tokenizer). Weights are quantized with ``gguf.quants.quantize`` (``Q4_0``,
``Q4_1``, ``Q8_0``); the K-quants, which ``gguf`` only reads, get random blocks with small scales (any bytes
are valid blocks), so HF and loraplex dequantize the same weights.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFReader, GGUFWriter, get_tensor_name_map
from gguf.quants import quantize
from safetensors.torch import load_file

from loraplex.models.embedded import _gguf_path

_ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
# K-quant block layout: bytes per block, and where its float16 scales sit (d, then dmin when present)
_K_QUANTS = {"Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}
_TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                   "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                   "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
                   "tokenizer.ggml.add_bos_token", "tokenizer.chat_template")


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: each head's rows ``[2, d/2]`` stored as ``[d/2, 2]``."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_k_blocks(rows: int, cols: int, qtype: str, seed: int) -> np.ndarray:
    """Random ``qtype`` rows ``[rows, cols / 256 * block bytes]`` with float16 scales of about 1e-3."""
    size, scale_offsets = _K_QUANTS[qtype]
    gen = np.random.default_rng(seed)
    blocks = gen.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    for offset in scale_offsets:
        scales = (gen.uniform(0.5, 1.5, (rows, cols // 256)) * 1e-3).astype(np.float16)
        blocks[..., offset : offset + 2] = scales.view(np.uint8).reshape(rows, cols // 256, 2)
    return blocks.reshape(rows, -1)


def checked_kernel_product(module: object, x: torch.Tensor, data: torch.Tensor, type_id: int, w: torch.Tensor,
                           bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``module.linear_into`` (a GGUF block or K-quant kernel build) on every row of ``x``, checked against
    the float64 product ``x @ w^T + bias`` with ``w`` the float64 dequantized weight; (its result, that
    float64 product)."""
    result = torch.empty(x.shape[0], data.shape[0])
    module.linear_into(x, data, type_id, result, bias)  # type: ignore[attr-defined]
    expected = x.double() @ w.t() + (0 if bias is None else bias.double())
    torch.testing.assert_close(result.double(), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    return result, expected


def _stored(name: str, w: np.ndarray, qtype: str, seed: int) -> tuple[np.ndarray, GGMLQuantizationType]:
    kind = getattr(GGMLQuantizationType, qtype)
    if w.ndim == 1 or qtype == "F32":
        return w.astype(np.float32), GGMLQuantizationType.F32
    if qtype in _K_QUANTS:
        return random_k_blocks(w.shape[0], w.shape[1], qtype, seed), kind
    return quantize(w.astype(np.float32), kind), kind


def _tensor_type(gguf_name: str, types: Mapping[str, str]) -> str:
    """``types``: a GGUF tensor-name fragment ("attn_v", "token_embd", ...) -> type; "default" for the rest."""
    for fragment, qtype in types.items():
        if fragment != "default" and fragment in gguf_name:
            return qtype
    return types["default"]


def write_tiny_gguf(hf_folder: Path, path: Path, types: Mapping[str, str], tokenizer: bool = True) -> Path:
    """Convert the HF checkpoint in ``hf_folder`` to the GGUF file ``path`` (module docstring); return it.
    ``tokenizer=False`` leaves the tokenizer out but its bos / eos ids (transformers then reads the file in a
    fraction of the time: most of it goes into SmolLM2's 100k tokenizer strings)."""
    config = json.loads((hf_folder / "config.json").read_text())
    arch = _ARCH[config["architectures"][0]]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    names = get_tensor_name_map({n: a for a, n in MODEL_ARCH_NAMES.items()}[arch], config["num_hidden_layers"])
    writer = GGUFWriter(path, arch)
    writer.add_name("tiny-" + arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if tokenizer:
        _copy_tokenizer(writer)
    else:  # the special token ids alone, as every GGUF in the wild has them
        writer.add_bos_token_id(config["bos_token_id"])
        writer.add_eos_token_id(config["eos_token_id"])
    state = load_file(hf_folder / "model.safetensors")
    for i, (hf_name, tensor) in enumerate(sorted(state.items())):
        if hf_name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))  # suffix included
        assert gguf_name is not None, hf_name
        w = tensor.to(torch.float32).numpy()
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            w = _permute(w, heads if "q_proj" in hf_name else kv_heads)
        data, kind = _stored(gguf_name, w, _tensor_type(gguf_name, types), seed=i)
        writer.add_tensor(gguf_name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _copy_tokenizer(writer: GGUFWriter) -> None:
    """The embedded SmolLM2 GGUF's tokenizer keys, as they are."""
    reader = GGUFReader(_gguf_path())
    fields = {key: reader.fields[key].contents() for key in _TOKENIZER_KEYS}
    writer.add_tokenizer_model(fields["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(fields["tokenizer.ggml.pre"])
    writer.add_token_list(fields["tokenizer.ggml.tokens"])
    writer.add_token_types(fields["tokenizer.ggml.token_type"])
    writer.add_token_merges(fields["tokenizer.ggml.merges"])
    writer.add_bos_token_id(fields["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(fields["tokenizer.ggml.eos_token_id"])
    writer.add_unk_token_id(fields["tokenizer.ggml.unknown_token_id"])
    writer.add_pad_token_id(fields["tokenizer.ggml.padding_token_id"])
    writer.add_add_bos_token(fields["tokenizer.ggml.add_bos_token"])
    writer.add_chat_template(fields["tokenizer.chat_template"])
