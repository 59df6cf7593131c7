"""Reading adapter weight files: the all-float32 fast path (views of one buffer) agrees with the safetensors
library on every file, and everything else falls back to the library."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.adapters.peft_format import read_peft_adapter
from loraplex.adapters.weight_file import SAFETENSORS_FILE, read_weight_file
from loraplex.config import ModelConfig
from loraplex.errors import InvalidAdapter


def _assert_same(read: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert read.keys() == reference.keys()
    for key, tensor in reference.items():
        assert read[key].dtype == tensor.dtype and read[key].shape == tensor.shape
        assert torch.equal(read[key], tensor), key


def test_float32_file_is_views_of_one_buffer(tiny_llama_adapters: dict[str, Path]) -> None:
    folder = tiny_llama_adapters["r8_all"]
    weights = read_weight_file(folder, allow_pickle=False)
    reference = load_file(folder / SAFETENSORS_FILE)
    _assert_same(weights.tensors, reference)
    assert weights.flat is not None and weights.flat.numel() == sum(t.numel() for t in reference.values())
    base = weights.flat.data_ptr()
    end = base + weights.flat.numel() * 4
    assert all(base <= t.data_ptr() < end for t in weights.tensors.values())
    weights.flat.zero_()  # owned: changing it changes the tensors, never the file
    assert all(not t.any() for t in weights.tensors.values())
    _assert_same(load_file(folder / SAFETENSORS_FILE), reference)


@pytest.mark.parametrize("kind", ["mixed_dtypes", "with_metadata", "empty_tensor"])
def test_other_files_match_the_library(kind: str, tiny_llama_adapters: dict[str, Path], tmp_path: Path) -> None:
    src = load_file(tiny_llama_adapters["r4_attn"] / SAFETENSORS_FILE)
    tensors, metadata = dict(src), None
    if kind == "mixed_dtypes":
        first = next(iter(tensors))
        tensors[first] = tensors[first].to(torch.bfloat16)
    elif kind == "with_metadata":
        metadata = {"format": "pt"}
    else:
        tensors["zero"] = torch.zeros(0, 3)
    save_file(tensors, tmp_path / SAFETENSORS_FILE, metadata=metadata)
    weights = read_weight_file(tmp_path, allow_pickle=False)
    _assert_same(weights.tensors, load_file(tmp_path / SAFETENSORS_FILE))
    assert (weights.flat is None) == (kind == "mixed_dtypes")


def test_truncated_file_is_invalid(tiny_llama_adapters: dict[str, Path], tmp_path: Path) -> None:
    data = (tiny_llama_adapters["r4_attn"] / SAFETENSORS_FILE).read_bytes()
    (tmp_path / SAFETENSORS_FILE).write_bytes(data[:-4])
    with pytest.raises(InvalidAdapter, match=r"adapter_model.safetensors: tensor '.*' data_offsets .* run past the "
                                             r"end of the data section .*: the file is truncated"):
        read_weight_file(tmp_path, allow_pickle=False)


def test_in_place_fold_equals_the_out_of_place_fold(tiny_llama_adapters: dict[str, Path], tiny_llama: Path,
                                                    tmp_path: Path) -> None:
    """B folded in place over the all-float32 buffer equals B read from a file with one float64 tensor (no
    flat buffer: each tensor converted and folded out of place), and so does the content hash."""
    src = tiny_llama_adapters["r4_attn"]
    tensors = load_file(src / SAFETENSORS_FILE)
    key = next(k for k in tensors if k.endswith("lora_B.weight"))
    slow_folder = tmp_path / "slow"
    shutil.copytree(src, slow_folder)
    save_file({**tensors, key: tensors[key].to(torch.float64)}, slow_folder / SAFETENSORS_FILE)  # not all F32
    assert read_weight_file(slow_folder, allow_pickle=False).flat is None
    mc = ModelConfig.from_hf(tiny_llama)
    fast, slow = read_peft_adapter(src, mc, 16), read_peft_adapter(slow_folder, mc, 16)
    assert fast.modules.keys() == slow.modules.keys()
    for k, (a, b) in fast.modules.items():
        assert torch.equal(a, slow.modules[k][0]) and torch.equal(b, slow.modules[k][1]), k
    assert fast.content_hash == slow.content_hash
