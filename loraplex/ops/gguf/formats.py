"""GGUF's block formats that loraplex multiplies natively, restated in torch.

Every row of a weight ``[out, in]`` is ``in / 32`` blocks of 32 values; a block holds a float16 scale ``d``
(``Q4_1``: then a float16 minimum ``m``) and the quantized values, value ``j < 16`` in the low nibble of byte
``j`` and value ``j + 16`` in its high nibble (4-bit types):

- ``Q4_0`` (18 bytes): ``w = d * (nibble - 8)``
- ``Q4_1`` (20 bytes): ``w = d * nibble + m``
- ``Q8_0`` (34 bytes): ``w = d * q`` with ``q`` int8

in float32, a multiply then an add, as ``gguf.quants.dequantize`` computes them (bitwise the same).
"""

from __future__ import annotations

import torch

QK = 32  # values per block
# GGML type name -> (GGML type id, bytes per block)
NATIVE_TYPES: dict[str, tuple[int, int]] = {"Q4_0": (2, 18), "Q4_1": (3, 20), "Q8_0": (8, 34)}


def row_bytes(qtype: str, in_features: int) -> int:
    """Bytes of one stored row of ``in_features`` values."""
    return in_features // QK * NATIVE_TYPES[qtype][1]


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 at byte ``offset`` of every block ``[rows, n, bytes]`` as float32 ``[rows, n, 1]``."""
    return blocks[..., offset : offset + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Bytes ``[rows, n, 16]`` -> the 32 values ``[rows, n, 32]`` (low nibbles first), as float32."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1).to(torch.float32)


def dequantize(data: torch.Tensor, qtype: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored rows ``data`` (uint8 ``[out, in / 32 * block bytes]``) of type ``qtype`` -> the float weight
    ``[out, in]`` they stand for."""
    if qtype not in NATIVE_TYPES:
        raise ValueError(f"not a natively served GGUF type: {qtype!r}")
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, NATIVE_TYPES[qtype][1])
    d = _f16(blocks, 0)
    if qtype == "Q4_0":
        w = d * (_nibbles(blocks[..., 2:]) - 8.0)
    elif qtype == "Q4_1":
        w = d * _nibbles(blocks[..., 4:]) + _f16(blocks, 2)
    else:
        w = d * blocks[..., 2:].contiguous().view(torch.int8).to(torch.float32)
    return w.reshape(rows, -1).to(dtype)
