"""Reading adapter weight files: tensors are views of one owned buffer and agree with the safetensors library
on every file and buffer; the header is checked against the size (every malformed case named) first."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, load_file, save, save_file

from loraplex.adapters.reading.peft_format import read_peft_adapter, read_peft_adapter_from_tensors
from loraplex.adapters.reading.safetensors_file import MAX_HEADER_BYTES, parse_safetensors_bytes
from loraplex.adapters.reading.weight_file import SAFETENSORS_FILE, read_weight_file
from loraplex.config import ModelConfig
from loraplex.errors import AdapterOverflow, InvalidAdapter


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


def _file(header: object, data: bytes = b"", length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return (len(raw) if length is None else length).to_bytes(8, "little") + raw + data


def _f32(shape: list[int], lo: int, hi: int, dtype: str = "F32") -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [lo, hi]}


HEADERS = {  # id -> (file bytes, message fragment); every one an InvalidAdapter naming the file
    "short": (b"\x01\x00\x00\x00", "4 bytes, shorter than the 8-byte header length"),
    "header_past_end": (_file({}, length=100), "header length 100 runs past the end of the file (10 bytes)"),
    "header_2_63": (_file({}, length=2**63), f"header length {2**63} runs past the end of the file (10 bytes)"),
    "not_json": (_file(b"{nope"), "header is not valid JSON"),
    "not_object": (_file([]), "the header is not a JSON object"),
    "deep": (_file(b"[" * 1000 + b"]" * 1000), "header nests 1000 levels deep, over the limit of 32"),
    "metadata": (_file({"__metadata__": {"a": 1}}), "__metadata__ must map names to strings"),
    "long_name": (_file({"x" * 2000: _f32([1], 0, 4)}, bytes(4)), "a tensor name of 2000 characters"),
    "dtype": (_file({"t": _f32([1], 0, 4, "F128")}, bytes(4)), "tensor 't' has dtype 'F128', not one of F64, F32"),
    "shape": (_file({"t": _f32([-1], 0, 4)}, bytes(4)), "tensor 't' shape [-1] is not a list of sizes >= 0"),
    "offsets": (_file({"t": _f32([1], 4, 0)}, bytes(4)), "tensor 't' data_offsets [4, 0] are not [begin, end]"),
    "size_mismatch": (_file({"t": _f32([2, 2], 0, 12)}, bytes(12)),
                      "tensor 't' of shape [2, 2] and dtype F32 is 16 bytes, but its data_offsets [0, 12] span 12"),
    "past_data": (_file({"t": _f32([4], 0, 16)}, bytes(8)), "tensor 't' data_offsets [0, 16] run past the end of "
                                                            "the data section (8 bytes): the file is truncated"),
    "overlap": (_file({"a": _f32([4], 0, 16), "b": _f32([4], 8, 24)}, bytes(24)),
                "tensor 'b' data_offsets [8, 24] overlaps the tensor before it"),
    "gap": (_file({"a": _f32([4], 0, 16), "b": _f32([4], 20, 36)}, bytes(36)),
            "tensor 'b' data_offsets [20, 36] leaves bytes 16..20 unused"),
    "trailing": (_file({"a": _f32([4], 0, 16)}, bytes(20)), "the data section holds 20 bytes but its tensors cover 16"),
}


@pytest.mark.parametrize("case", HEADERS)
def test_the_header_is_checked_against_the_size_before_any_tensor(case: str, tmp_path: Path) -> None:
    """The same refusal for a file and for a buffer in memory, naming which."""
    data, fragment = HEADERS[case]
    (tmp_path / SAFETENSORS_FILE).write_bytes(data)
    with pytest.raises(InvalidAdapter) as info:
        read_weight_file(tmp_path, allow_pickle=False)
    assert f"{tmp_path}: {SAFETENSORS_FILE}" in str(info.value) and fragment in str(info.value), str(info.value)
    with pytest.raises(InvalidAdapter) as info:
        parse_safetensors_bytes(data, "PUT body")
    assert str(info.value).startswith("PUT body") and fragment in str(info.value), str(info.value)


def test_a_header_over_its_limit_is_refused_unread(tmp_path: Path) -> None:
    length = MAX_HEADER_BYTES + 1
    with (tmp_path / SAFETENSORS_FILE).open("wb") as f:
        f.write(length.to_bytes(8, "little"))
        f.truncate(8 + length)  # sparse
    with pytest.raises(InvalidAdapter, match=f"header length {length} is over the limit of {MAX_HEADER_BYTES} bytes"):
        read_weight_file(tmp_path, allow_pickle=False)


def test_buffers_parse_like_the_library() -> None:
    """Every dtype, an empty tensor and metadata; a bytearray's tensors are views of it, bytes are copied."""
    g = torch.Generator().manual_seed(0)
    tensors = {"f32": torch.randn(3, 5, generator=g), "bf16": torch.randn(4, generator=g).to(torch.bfloat16),
               "f16": torch.randn(2, 2, generator=g).half(), "f64": torch.randn(3, generator=g).double(),
               "i64": torch.arange(5), "bool": torch.tensor([True, False, True]), "empty": torch.zeros(0, 4)}
    data = save(tensors, metadata={"adapter_config": "{}"})
    parsed, metadata = parse_safetensors_bytes(data)
    assert metadata == {"adapter_config": "{}"}
    _assert_same(parsed, load(data))
    owned = bytearray(data)
    views, _ = parse_safetensors_bytes(owned)
    base = torch.frombuffer(owned, dtype=torch.uint8).data_ptr()
    assert all(base <= t.data_ptr() < base + len(owned) for name, t in views.items() if t.numel())


def test_tensors_in_memory_read_like_the_folder(tiny_llama_adapters: dict[str, Path], tiny_llama: Path) -> None:
    """``parse_safetensors_bytes`` + ``read_peft_adapter_from_tensors`` (the config from ``__metadata__``) give
    the folder's adapter exactly; the caller's tensors are left as they were."""
    folder = tiny_llama_adapters["r8_all"]
    mc = ModelConfig.from_hf(tiny_llama)
    config = (folder / "adapter_config.json").read_text()
    body = save(load_file(folder / SAFETENSORS_FILE), metadata={"adapter_config": config})
    tensors, metadata = parse_safetensors_bytes(body)
    before = {k: t.clone() for k, t in tensors.items()}
    from_memory = read_peft_adapter_from_tensors(tensors, metadata["adapter_config"], mc, 16, source="PUT sql")
    from_folder = read_peft_adapter(folder, mc, 16)
    assert from_memory.content_hash == from_folder.content_hash and from_memory.path == "PUT sql"
    assert from_memory.modules.keys() == from_folder.modules.keys()
    for key, (a, b) in from_folder.modules.items():
        assert torch.equal(a, from_memory.modules[key][0]) and torch.equal(b, from_memory.modules[key][1]), key
    _assert_same(tensors, before)
    key = next(k for k in tensors if k.endswith("q_proj.lora_A.weight"))
    tensors[key][0, 0] = 3e38
    with pytest.raises(AdapterOverflow, match="^PUT sql: module 'model.layers.0.self_attn.q_proj': "):
        read_peft_adapter_from_tensors(tensors, json.loads(config), mc, 16, source="PUT sql")
    with pytest.raises(InvalidAdapter, match="^PUT sql: adapter_config nests 40 levels deep"):
        read_peft_adapter_from_tensors(tensors, "[" * 40 + "]" * 40, mc, 16, source="PUT sql")
