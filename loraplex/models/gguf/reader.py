"""Opening a GGUF file: its metadata and its tensors, memory-mapped.

A GGUF file (little-endian) is ``"GGUF"``, a version (2 or 3), the tensor and key-value counts, the metadata
key-values (a key string, a value type, the value: a number, a string, or an array of them), the tensor table
(name, dims, GGML type, offset) and, at the next multiple of ``general.alignment`` (32 by default), the
tensor data. Dims are stored fastest-varying first, so a weight ``[out, in]`` in torch's order is
``[in, out]`` in the file; a block-quantized row holds ``in / block_size`` blocks of ``type_size`` bytes.

The header is parsed here rather than with ``gguf.GGUFReader``, which builds a numpy view of every string
of the tokenizer arrays (about 100k of them: seconds per open); string arrays are skipped until asked for.
Anything malformed (bad magic, an unknown version, value or tensor type, a header or tensor data past the
end of the file) is a ``GGUFError`` naming the file. ``gguf`` still supplies the type sizes and the
dequantization of every type.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from loraplex.errors import ModelError

_FLOAT_TYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                GGMLQuantizationType.F64: np.float64}
# GGUF value type -> struct format of a scalar (8: string, 9: array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFError(ModelError):
    """A GGUF file that cannot be served: corrupt, truncated, or holding what loraplex does not serve."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor as stored: ``raw`` is ``[rows, row_bytes]`` uint8 for block types (``rows`` = the torch
    shape's leading dims), the values themselves for float types; ``shape`` is torch's order."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    raw: np.ndarray

    def rows(self) -> np.ndarray:
        """The stored data as ``[shape[0], bytes or values per row]`` (a view)."""
        return self.raw.reshape(self.shape[0], -1)

    def dequantized(self, rows: np.ndarray | None = None) -> torch.Tensor:
        """The float32 tensor (torch's shape) that this one stands for, as ``gguf.quants.dequantize``
        computes it; ``rows``: the stored rows to use instead (e.g. permuted), ``[shape[0], -1]``."""
        data = self.rows() if rows is None else rows
        values = data.astype(np.float32) if self.qtype in _FLOAT_TYPES else dequantize(data, self.qtype)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(self.shape))


class _Cursor:
    """Reads little-endian values from the mapped file, a ``GGUFError`` past its end."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.path, self.pos = buf, path, 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.buf):
            raise GGUFError(f"{self.path}: truncated or corrupt header (needs bytes up to {self.pos + n}, the "
                            f"file has {len(self.buf)})")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalar(self, kind: int) -> int | float | bool:
        fmt = _SCALARS.get(kind)
        if fmt is None:
            raise GGUFError(f"{self.path}: unknown metadata value type {kind} at byte {self.pos}")
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        try:
            return self.take(int(self.scalar(10))).decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{self.path}: a metadata string is not UTF-8 (corrupt header?)") from e

    def value(self, kind: int) -> object:
        """A value; string arrays are skipped and returned as ``_Strings`` (read when asked for)."""
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            return self.scalar(kind)
        item, count = int(self.scalar(4)), int(self.scalar(10))
        if item == _STRING:
            start = self.pos
            for _ in range(count):
                length = int(self.scalar(10))  # read before the += (which would read pos first)
                self.pos += length
            self.take(0)
            return _Strings(start, count)
        if item not in _SCALARS:
            raise GGUFError(f"{self.path}: unknown metadata array type {item}")
        size = struct.calcsize(_SCALARS[item])
        return list(struct.unpack(f"<{count}{_SCALARS[item][1]}", self.take(size * count)))


@dataclass(frozen=True)
class _Strings:
    """A string array left in the file: ``count`` strings from byte ``start``."""

    start: int
    count: int


class GGUFFile:
    """A GGUF file's metadata (``field``) and tensors (``tensors``, by name), memory-mapped read-only."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with self.path.open("rb") as f:
                self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:  # ValueError: an empty file cannot be mapped
            raise GGUFError(f"{self.path}: cannot be read as a GGUF file: {e}") from e
        cur = _Cursor(self._buf, self.path)
        if cur.take(4) != b"GGUF":
            raise GGUFError(f"{self.path}: not a GGUF file (no GGUF magic)")
        version = cur.scalar(4)
        if version not in (2, 3):
            raise GGUFError(f"{self.path}: GGUF version {version} is not read (2 and 3 are; big-endian files aren't)")
        n_tensors, n_fields = int(cur.scalar(10)), int(cur.scalar(10))
        self._fields: dict[str, object] = {}
        for _ in range(n_fields):
            key = cur.string()
            self._fields[key] = cur.value(int(cur.scalar(4)))
        table = [self._tensor_info(cur) for _ in range(n_tensors)]
        alignment = int(self._fields.get("general.alignment", 32))  # type: ignore[arg-type]
        if alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"{self.path}: general.alignment {alignment} is not a power of two")
        data_start = -(-cur.pos // alignment) * alignment
        self.tensors = {name: self._tensor(name, qtype, dims, data_start + offset)
                        for name, qtype, dims, offset in table}
        self.architecture = str(self._fields.get("general.architecture", ""))
        if not self.architecture:
            raise GGUFError(f"{self.path}: no general.architecture in its metadata")

    def _tensor_info(self, cur: _Cursor) -> tuple[str, GGMLQuantizationType, tuple[int, ...], int]:
        name = cur.string()
        n_dims = int(cur.scalar(4))
        if n_dims > 4:
            raise GGUFError(f"{self.path}: tensor {name!r} has {n_dims} dims (corrupt header?)")
        dims = tuple(int(cur.scalar(10)) for _ in range(n_dims))
        raw_type = int(cur.scalar(4))
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError as e:
            raise GGUFError(f"{self.path}: tensor {name!r} has unknown GGML type {raw_type}") from e
        return name, qtype, dims, int(cur.scalar(10))

    def _tensor(self, name: str, qtype: GGMLQuantizationType, dims: tuple[int, ...], start: int) -> GGUFTensor:
        shape = tuple(reversed(dims))
        block, type_size = GGML_QUANT_SIZES[qtype]
        if shape and shape[-1] % block:
            raise GGUFError(f"{self.path}: tensor {name!r} has rows of {shape[-1]} values, not whole "
                            f"{qtype.name} blocks of {block}")
        count = int(np.prod(shape)) if shape else 1
        n_bytes = count // block * type_size
        if start + n_bytes > len(self._buf):
            raise GGUFError(f"{self.path}: truncated: tensor {name!r} needs bytes up to {start + n_bytes}, the "
                            f"file has {len(self._buf)}")
        if qtype in _FLOAT_TYPES:
            raw = np.frombuffer(self._buf, _FLOAT_TYPES[qtype], count, start).reshape(shape)
        else:
            raw = np.frombuffer(self._buf, np.uint8, n_bytes, start).reshape(*shape[:-1], -1)
        return GGUFTensor(name, qtype, shape, raw)

    def field(self, key: str, default: object = None) -> object:
        """Metadata value ``key`` (a number, str, or list of them), ``default`` when absent."""
        value = self._fields.get(key, default)
        if isinstance(value, _Strings):
            cur = _Cursor(self._buf, self.path)
            cur.pos = value.start
            return [cur.string() for _ in range(value.count)]
        return value

    def has_field(self, key: str) -> bool:
        return key in self._fields

    def tensor(self, name: str) -> GGUFTensor:
        if name not in self.tensors:
            raise GGUFError(f"{self.path}: no tensor {name!r} (the model needs it)")
        return self.tensors[name]
