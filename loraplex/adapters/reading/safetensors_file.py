"""The safetensors format, checked against the bytes that hold it before any tensor is read.

Layout: a little-endian u64 header length N, N bytes of JSON (``{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {str: str}}``), then the data section; offsets are
relative to the data section. ``parse_header`` refuses, naming the file and the tensor: a header length
past the end of the file (a 2^63 length too) or over ``MAX_HEADER_BYTES``; a header that is not a
bounded JSON object of well-formed entries (names up to ``MAX_NAME_CHARS``); an unknown dtype; a shape
whose size in bytes differs from its offsets' span; offsets outside the data section (a truncated
file), overlapping or leaving a gap between tensors, or a data section longer than the tensors (the
library's own rules: the tensors tile it exactly). Only then are tensors made, as views of one owned
buffer (``tensor_views``), never pickled.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from loraplex.adapters.reading.bounded_json import parse_json
from loraplex.errors import InvalidAdapter

HEADER_LENGTH_BYTES = 8
# ~160 bytes a tensor: room for ~100,000 tensors (a 128-expert MoE adapter on every projection of 48 layers
# has ~37,000), and parsed in ~0.1 s (the format's own limit, 100 MB, would hold the GIL for seconds)
MAX_HEADER_BYTES = 16 << 20
MAX_NAME_CHARS = 1024  # a PEFT tensor name is ~80
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
          "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor as the header declares it (nothing read yet); ``start``/``end``: bytes in the data section."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class Header:
    specs: dict[str, TensorSpec]
    metadata: dict[str, str]
    data_start: int  # where the data section begins in the file (8 + the header length)
    data_len: int


def header_length(prefix: bytes, total: int, what: str) -> int:
    """The header length from the first 8 of ``total`` bytes, checked against ``total`` and the limit."""
    if total < HEADER_LENGTH_BYTES:
        raise InvalidAdapter(f"{what}: {total} bytes, shorter than the {HEADER_LENGTH_BYTES}-byte header length")
    length = int.from_bytes(prefix[:HEADER_LENGTH_BYTES], "little")
    if length > total - HEADER_LENGTH_BYTES:
        raise InvalidAdapter(f"{what}: header length {length} runs past the end of the file ({total} bytes)")
    if length > MAX_HEADER_BYTES:
        raise InvalidAdapter(f"{what}: header length {length} is over the limit of {MAX_HEADER_BYTES} bytes")
    return length


def parse_header(raw: bytes, total: int, what: str) -> Header:
    """The header of a ``total``-byte safetensors file whose header bytes are ``raw`` (module docstring)."""
    data_start = HEADER_LENGTH_BYTES + len(raw)
    data_len = total - data_start
    header = parse_json(raw, f"{what}: header", MAX_HEADER_BYTES)
    if not isinstance(header, dict):
        raise InvalidAdapter(f"{what}: the header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise InvalidAdapter(f"{what}: __metadata__ must map names to strings")
    specs = {name: _spec(name, entry, what) for name, entry in header.items()}
    end = 0
    for spec in sorted(specs.values(), key=lambda s: (s.start, s.end)):
        if spec.end > data_len:
            raise InvalidAdapter(f"{what}: tensor {spec.name!r} data_offsets [{spec.start}, {spec.end}] run past "
                                 f"the end of the data section ({data_len} bytes): the file is truncated")
        if spec.start != end:
            problem = ("overlaps the tensor before it" if spec.start < end
                       else f"leaves bytes {end}..{spec.start} unused")
            raise InvalidAdapter(f"{what}: tensor {spec.name!r} data_offsets [{spec.start}, {spec.end}] {problem}")
        end = spec.end
    if end != data_len:
        raise InvalidAdapter(f"{what}: the data section holds {data_len} bytes but its tensors cover {end}")
    return Header(specs, dict(metadata), data_start, data_len)


def _spec(name: str, entry: object, what: str) -> TensorSpec:
    if len(name) > MAX_NAME_CHARS:
        raise InvalidAdapter(f"{what}: a tensor name of {len(name)} characters ({name[:80]!r}...) is over the "
                             f"limit of {MAX_NAME_CHARS}")
    if not isinstance(entry, dict):
        raise InvalidAdapter(f"{what}: header entry {name!r} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPES:
        raise InvalidAdapter(f"{what}: tensor {name!r} has dtype {dtype!r}, not one of {', '.join(DTYPES)}")
    if not isinstance(shape, list) or not all(_count(n) for n in shape):
        raise InvalidAdapter(f"{what}: tensor {name!r} shape {shape!r} is not a list of sizes >= 0")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_count(n) for n in offsets) \
            or offsets[0] > offsets[1]:
        raise InvalidAdapter(f"{what}: tensor {name!r} data_offsets {offsets!r} are not [begin, end] with "
                             "0 <= begin <= end")
    nbytes = math.prod(shape) * DTYPES[dtype].itemsize
    if nbytes != offsets[1] - offsets[0]:
        raise InvalidAdapter(f"{what}: tensor {name!r} of shape {shape} and dtype {dtype} is {nbytes} bytes, but "
                             f"its data_offsets {offsets} span {offsets[1] - offsets[0]}")
    return TensorSpec(name, DTYPES[dtype], tuple(shape), offsets[0], offsets[1])


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def tensor_views(buffer: bytearray, base: int, specs: Mapping[str, TensorSpec]) -> dict[str, torch.Tensor]:
    """Each tensor as a view of ``buffer`` (its data section starting at byte ``base``): a slice of one flat
    view per dtype; a tensor not aligned to its element size is its own copy, an empty one its own tensor."""
    flats: dict[tuple[torch.dtype, int], torch.Tensor] = {}  # (dtype, offset % itemsize) -> the buffer as dtype
    out = {}
    for name, spec in specs.items():
        size = spec.dtype.itemsize
        offset, count = base + spec.start, (spec.end - spec.start) // size
        if count == 0:
            out[name] = torch.empty(spec.shape, dtype=spec.dtype)
            continue
        phase = offset % size
        if (spec.dtype, phase) not in flats:
            flats[spec.dtype, phase] = torch.frombuffer(buffer, dtype=spec.dtype, offset=phase,
                                                        count=(len(buffer) - phase) // size)
        view = flats[spec.dtype, phase][offset // size : offset // size + count].view(spec.shape)
        out[name] = view if phase == 0 else view.clone()
    return out


def parse_safetensors_bytes(buf: bytes | bytearray | memoryview,
                            what: str = "safetensors body") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(tensors, metadata)`` of a safetensors file held in memory, with ``parse_header``'s checks. The
    tensors are views of one owned buffer: ``buf`` itself when it is a ``bytearray`` (do not change it
    afterwards), else a copy of it."""
    buffer = buf if isinstance(buf, bytearray) else bytearray(buf)
    length = header_length(bytes(buffer[:HEADER_LENGTH_BYTES]), len(buffer), what)
    header = parse_header(bytes(buffer[HEADER_LENGTH_BYTES : HEADER_LENGTH_BYTES + length]), len(buffer), what)
    return tensor_views(buffer, header.data_start, header.specs), header.metadata


def safetensors_bytes(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """``tensors`` (and ``metadata``) as one safetensors file in memory, the inverse of
    ``parse_safetensors_bytes``: tensors laid out in name order, each its own bytes (views of one buffer may
    share storage, which the ``safetensors`` library refuses to save)."""
    names = {dtype: name for name, dtype in DTYPES.items()}
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    parts, offset = [], 0
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        header[name] = {"dtype": names[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(data)]}
        parts.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % HEADER_LENGTH_BYTES)  # the data section starts aligned, as the library writes it
    return b"".join([len(raw).to_bytes(HEADER_LENGTH_BYTES, "little"), raw, *parts])
