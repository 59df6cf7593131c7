"""A GGUF file's metadata as transformers reads it: the HF config and the tokenizer with its chat template.

``hf_config`` maps llama.cpp's metadata keys to ``config.json`` fields as transformers' GGUF reading
(``AutoConfig.from_pretrained(folder, gguf_file=name)``) maps them for the architectures served here,
without parsing the tokenizer arrays (tests/test_gguf_loading.py compares the two). Like transformers, it
ignores the rope scaling keys (``{arch}.rope.scaling.*``) and sliding windows. The tokenizer is
transformers' own (``AutoTokenizer.from_pretrained(folder, gguf_file=name)``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from loraplex.models.gguf.reader import GGUFError, GGUFFile

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# general.architecture -> the HF architecture it is served as
ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# config.json field <- "{arch}." metadata key
_KEYS = {
    "max_position_embeddings": "context_length",
    "num_hidden_layers": "block_count",
    "intermediate_size": "feed_forward_length",
    "hidden_size": "embedding_length",
    "rope_theta": "rope.freq_base",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "vocab_size": "vocab_size",
}
# what head_dim is read from, per architecture (transformers: Llama's rope dimension, Qwen3's key length)
_HEAD_DIM = {"llama": "rope.dimension_count", "qwen3": "attention.key_length"}


def hf_config(path: Path, file: GGUFFile | None = None) -> dict[str, object]:
    """The ``config.json`` equivalent of GGUF file ``path`` (``file``: already open)."""
    file = file or GGUFFile(path)
    arch = file.architecture
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{path}: GGUF architecture {arch!r} is not served from GGUF; served: "
                        f"{', '.join(ARCHITECTURES)}")
    config: dict[str, object] = {"architectures": [ARCHITECTURES[arch]], "model_type": arch}
    for field, key in _KEYS.items():
        if file.has_field(f"{arch}.{key}"):
            config[field] = file.field(f"{arch}.{key}")
    missing = [f for f in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
               if f not in config]
    if missing:
        raise GGUFError(f"{path}: its metadata lacks {', '.join(f'{arch}.{_KEYS[f]}' for f in missing)}")
    if "vocab_size" not in config:
        tokens = file.field("tokenizer.ggml.tokens")
        if not isinstance(tokens, list):
            raise GGUFError(f"{path}: no {arch}.vocab_size and no tokenizer.ggml.tokens to count")
        config["vocab_size"] = len(tokens)
    if arch in _HEAD_DIM and file.has_field(f"{arch}.{_HEAD_DIM[arch]}"):
        config["head_dim"] = file.field(f"{arch}.{_HEAD_DIM[arch]}")
    config["tie_word_embeddings"] = "output.weight" not in file.tensors
    for token in ("bos", "eos", "pad"):
        if file.has_field(f"tokenizer.ggml.{token}_token_id"):
            config[f"{token}_token_id"] = file.field(f"tokenizer.ggml.{token}_token_id")
    if arch == "qwen2":
        config["attention_bias"] = True
    return config


def gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The tokenizer (and chat template) stored in GGUF file ``path``'s metadata."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (ValueError, KeyError, OSError) as e:
        raise GGUFError(f"{path}: transformers cannot build a tokenizer from its metadata: {e}") from e


def has_tokenizer(path: Path) -> bool:
    """Whether GGUF file ``path`` carries a tokenizer (``tokenizer.ggml.tokens``)."""
    return GGUFFile(path).has_field("tokenizer.ggml.tokens")
