"""An adapter's weight file read into CPU tensors, with as few passes over its bytes as possible.

A cold adapter load sits on the critical path of the requests waiting for it, so the common case is
made cheap: a safetensors file whose tensors are all float32 (what PEFT saves from a float32 model)
is read with one ``readinto`` into one owned buffer, and every tensor is a zero-copy view of it; the
caller can then check every value at once (``flat``) and fold scales in place. Anything else (other
or mixed dtypes, a header this fast path does not recognise, a damaged file) goes through the
``safetensors`` library itself, which also produces the precise error for a bad file.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.errors import InvalidAdapter, UnsupportedAdapter

SAFETENSORS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"
_HEADER_BYTES = 8  # safetensors: little-endian u64 header length, then the JSON header, then the data
_F32_BYTES = 4


@dataclass(frozen=True)
class WeightFile:
    """The tensors of one weight file, by name; owned by the caller (safe to change in place)."""

    tensors: dict[str, torch.Tensor]
    # Every tensor's elements back to back, when they are all float32 views of one buffer (else None):
    # one reduction over it checks every value of the file.
    flat: torch.Tensor | None


def read_weight_file(folder: Path, allow_pickle: bool) -> WeightFile:
    """``adapter_model.safetensors`` (or, only if ``allow_pickle``, ``adapter_model.bin``) of ``folder``."""
    safetensors_path, pickle_path = folder / SAFETENSORS_FILE, folder / PICKLE_FILE
    if safetensors_path.is_file():
        return _read_safetensors(folder, safetensors_path)
    if pickle_path.is_file():
        if not allow_pickle:
            raise UnsupportedAdapter(
                f"{folder}: only {PICKLE_FILE} (a pickle) is present; pickles are refused unless "
                "explicitly allowed (allow_pickle_adapters); convert it to safetensors")
        try:
            state = torch.load(pickle_path, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises many unrelated types for a bad pickle
            raise InvalidAdapter(f"{folder}: cannot read {PICKLE_FILE} ({e})") from e
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise InvalidAdapter(f"{folder}: {PICKLE_FILE} does not hold a name -> tensor dict")
        return WeightFile(dict(state), None)
    raise InvalidAdapter(f"{folder}: no {SAFETENSORS_FILE} in the adapter folder")


def _read_safetensors(folder: Path, path: Path) -> WeightFile:
    try:
        with path.open("rb") as f:
            buffer = bytearray(path.stat().st_size)
            read = f.readinto(buffer)
    except OSError as e:
        raise InvalidAdapter(f"{folder}: cannot read {SAFETENSORS_FILE} ({e})") from e
    fast = _float32_views(buffer) if read == len(buffer) else None
    if fast is not None:
        return fast
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        return WeightFile(load(bytes(buffer[:read])), None)
    except (SafetensorError, OSError, ValueError) as e:
        raise InvalidAdapter(f"{folder}: cannot read {SAFETENSORS_FILE} ({e})") from e


def _float32_views(buffer: bytearray) -> WeightFile | None:
    """Zero-copy float32 views of a well-formed all-F32 safetensors ``buffer``; None otherwise (the
    library then reads the file). Well-formed: the tensors tile the data section exactly, in order."""
    if len(buffer) < _HEADER_BYTES:
        return None
    header_len = int.from_bytes(buffer[:_HEADER_BYTES], "little")
    data_start = _HEADER_BYTES + header_len
    if data_start > len(buffer) or data_start % _F32_BYTES:
        return None
    try:
        header = json.loads(buffer[_HEADER_BYTES:data_start])
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(header, dict):
        return None
    header.pop("__metadata__", None)
    spans = []
    for name, entry in header.items():
        if not isinstance(entry, dict) or entry.get("dtype") != "F32":
            return None
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if (not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape)
                or not isinstance(offsets, list) or len(offsets) != 2):
            return None
        spans.append((offsets[0], offsets[1], name, shape))
    spans.sort(key=lambda span: span[:2])
    end = 0
    for lo, hi, _, shape in spans:
        if lo != end or hi - lo != math.prod(shape) * _F32_BYTES:
            return None
        end = hi
    if data_start + end != len(buffer):
        return None
    flat = torch.frombuffer(buffer, dtype=torch.float32, offset=data_start) if end else torch.empty(0)
    tensors = {name: flat[lo // _F32_BYTES : hi // _F32_BYTES].view(shape) for lo, hi, name, shape in spans}
    return WeightFile(tensors, flat)
