"""GGUF's K-quant super-block formats (``Q4_K``, ``Q5_K``, ``Q6_K``: 256 values each) dequantized in torch,
bitwise as ``gguf.quants`` (ggml's ``block_q4_K`` / ``block_q5_K`` / ``block_q6_K``) computes them:

- ``Q4_K`` (144 bytes): f16 ``d``, f16 ``dmin``, 12 bytes of eight 6-bit scales ``sc`` and minimums ``m``,
  128 bytes of nibbles. Sub-block ``j`` (values ``32j .. 32j + 31``) is the low (``j`` even) or high nibble of
  bytes ``32 (j // 2) ..``; ``w = (d * sc[j]) * q - (dmin * m[j])``.
- ``Q5_K`` (176 bytes): as ``Q4_K`` with 32 bytes ``qh`` after the scales: bit ``j`` of ``qh[l]`` is bit 4
  of value ``l`` of sub-block ``j``.
- ``Q6_K`` (210 bytes): 128 bytes ``ql`` (low 4 bits), 64 bytes ``qh`` (high 2 bits), 16 int8 scales, f16
  ``d``. Value ``v = 128 h + 32 s + t`` (``h < 2``, ``s < 4``, ``t < 32``) has low bits
  ``ql[64 h + 32 (s % 2) + t] >> 4 (s // 2)`` and high bits ``qh[32 h + t] >> 2 s``;
  ``w = (d * sc[v // 16]) * (q - 32)``.
"""

from __future__ import annotations

import torch

_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 at byte ``offset`` of every super-block ``[n, bytes]`` as float32 ``[n, 1, 1]``."""
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).to(torch.float32).reshape(-1, 1, 1)


def scale_min(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 packed bytes ``[n, 12]`` -> eight 6-bit scales and eight minimums, each ``[n, 8]`` uint8."""
    d, m, m_d = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _nibble_groups(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes ``[n, 128]`` -> the eight sub-blocks' 4-bit values ``[n, 8, 32]`` (low nibbles then high)."""
    groups = qs.reshape(-1, 4, 1, 32)
    return torch.cat([groups & 0x0F, groups >> 4], dim=2).reshape(-1, 8, 32)


def _q4k_q5k(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    sc, mn = scale_min(blocks[:, 4:16])
    q = _nibble_groups(blocks[:, 16:144] if qtype == "Q4_K" else blocks[:, 48:176])
    if qtype == "Q5_K":
        qh = blocks[:, 16:48].reshape(-1, 1, 32)
        bits = torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)
        q = q | (((qh >> bits) & 1) << 4)
    dl = _f16(blocks, 0) * sc.to(torch.float32).unsqueeze(-1)
    dm = _f16(blocks, 2) * mn.to(torch.float32).unsqueeze(-1)
    return dl * q.to(torch.float32) - dm


def _q6k(blocks: torch.Tensor) -> torch.Tensor:
    ql = blocks[:, :128].reshape(-1, 2, 1, 64)
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(-1, 2, 4, 32)
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32)
    high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)) & 3
    q = (low | (high << 4)).to(torch.int16) - 32
    scales = blocks[:, 192:208].contiguous().view(torch.int8).to(torch.float32).reshape(-1, 16, 1)
    return (_f16(blocks, 208) * scales) * q.reshape(-1, 16, 16).to(torch.float32)


def dequantize_k(data: torch.Tensor, qtype: str) -> torch.Tensor:
    """Stored rows ``data`` (uint8 ``[out, in / 256 * block bytes]``) of K-quant ``qtype`` -> float32
    ``[out, in]``."""
    rows = data.shape[0]
    blocks = data.reshape(-1, _BYTES[qtype])
    w = _q6k(blocks) if qtype == "Q6_K" else _q4k_q5k(blocks, qtype)
    return w.reshape(rows, -1)
