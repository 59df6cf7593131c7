"""GGUF's block formats that loraplex multiplies natively, restated in torch.

Every row of a weight ``[out, in]`` is ``in / 32`` blocks of 32 values; a block holds a float16 scale ``d``
(``Q4_1``: then a float16 minimum ``m``) and the quantized values, value ``j < 16`` in the low nibble of byte
``j`` and value ``j + 16`` in its high nibble (4-bit types):

- ``Q4_0`` (18 bytes): ``w = d * (nibble - 8)``
- ``Q4_1`` (20 bytes): ``w = d * nibble + m``
- ``Q8_0`` (34 bytes): ``w = d * q`` with ``q`` int8

in float32, a multiply then an add, as ``gguf.quants.dequantize`` computes them (bitwise the same).

The K-quants hold rows of ``in / 256`` super-blocks of 256 values, in sub-blocks with 6-bit (``Q4_K``,
``Q5_K``: scale ``sc`` and minimum ``m`` per 32 values, packed in 12 bytes) or int8 (``Q6_K``: per 16 values)
scales; ``w = (d * sc) * q - (dmin * m)`` (``Q4_K``: 4-bit q; ``Q5_K``: 5-bit) and ``w = (d * sc) * (q - 32)``
(``Q6_K``: 6-bit q), float32 operations in that order as ``gguf.quants`` computes them (``kquant_formats``).
"""

from __future__ import annotations

import torch

from loraplex.ops.gguf.kquant_formats import dequantize_k

QK = 32  # values per block
# GGML type name -> (GGML type id, bytes per block)
NATIVE_TYPES: dict[str, tuple[int, int]] = {"Q4_0": (2, 18), "Q4_1": (3, 20), "Q8_0": (8, 34),
                                             "Q4_K": (12, 144), "Q5_K": (13, 176), "Q6_K": (14, 210)}
K_TYPES = frozenset({"Q4_K", "Q5_K", "Q6_K"})  # super-blocks of QK_K values
QK_K = 256


def block_values(qtype: str) -> int:
    """Values per (super-)block of ``qtype``: a row's ``in_features`` must be a multiple of it."""
    return QK_K if qtype in K_TYPES else QK


def row_bytes(qtype: str, in_features: int) -> int:
    """Bytes of one stored row of ``in_features`` values."""
    return in_features // block_values(qtype) * NATIVE_TYPES[qtype][1]


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
    if qtype in K_TYPES:
        return dequantize_k(data, qtype).to(dtype)
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
