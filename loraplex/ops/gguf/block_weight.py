"""A base weight kept in GGUF blocks (``Q4_0``, ``Q4_1``, ``Q8_0``; the K-quants ``Q4_K``, ``Q5_K``, ``Q6_K``),
multiplied without a float copy.

Semantics: ``BlockWeight.linear(x, bias) == x @ dense()^T + bias`` up to float rounding (float32 sums), where
``dense()`` is the weight the blocks stand for (``formats.dequantize``, bitwise ``gguf.quants.dequantize``'s).
x ``[T, in]`` float32 -> ``[T, out]``. A packed projection (q/k/v) may join rows of different types: each
run of one type is a segment that writes its own columns of the output. Activations are never quantized, so
each row's result depends on that row alone.

On x86 CPUs the matmul runs ``block_gemm.cpp``, built with the system compiler at first use and cached, in
two builds chosen at run time by ``torch.backends.cpu.get_cpu_capability()``: ``"avx512"`` where it reports
AVX512, else ``"avx2"``; K-quant segments run ``kquant_gemm.cpp`` (``kquant_kernel``) the same way.
Elsewhere (other CPUs, CUDA, no compiler) the weight is dequantized per call and ``F.linear`` runs: the same
numbers, slower.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from loraplex.ops.cpp_build import build_cpu_extension, build_for_this_cpu
from loraplex.ops.gguf import kquant_kernel
from loraplex.ops.gguf.formats import K_TYPES, NATIVE_TYPES, block_values, dequantize, row_bytes

_KERNEL_SOURCE = Path(__file__).with_name("block_gemm.cpp")

# The kernel's builds: name -> compiler flags (the source picks its vector width from ``__AVX512F__``).
ISA_FLAGS: dict[str, list[str]] = {
    "avx2": ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off"],
    "avx512": ["-O3", "-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-ffp-contract=off"],
}


@functools.cache
def kernel_build(isa: str) -> ModuleType | None:
    """The kernel built for ``isa`` (a key of ``ISA_FLAGS``), or None where it cannot be built (logged once).
    Only call it for an ISA this CPU runs (``kernel()`` chooses)."""
    return build_cpu_extension(f"loraplex_gguf_block_gemm_{isa}", f"GGUF block kernel ({isa})", [_KERNEL_SOURCE],
                               ISA_FLAGS[isa], "GGUF block matmuls dequantize per call")


@functools.cache
def kernel() -> ModuleType | None:
    """The kernel for this CPU (AVX-512 build, else AVX2), None where none builds or runs."""
    return build_for_this_cpu(kernel_build)


@dataclass(frozen=True)
class BlockSegment:
    """Consecutive output rows of one type: ``data`` uint8 ``[rows, in / 32 * block bytes]``."""

    qtype: str
    data: torch.Tensor


@dataclass(frozen=True)
class BlockWeight:
    """One base weight ``[out, in]`` as GGUF block rows, in one segment per run of one type."""

    segments: tuple[BlockSegment, ...]
    in_features: int

    @classmethod
    def from_rows(cls, parts: Sequence[tuple[str, torch.Tensor]], in_features: int) -> BlockWeight:
        """``parts``: ``(type, rows)`` in output order (e.g. q, k, v); consecutive parts of one type are joined."""
        merged: list[tuple[str, list[torch.Tensor]]] = []
        for qtype, rows in parts:
            if qtype not in NATIVE_TYPES:
                raise ValueError(f"not a natively served GGUF type: {qtype!r}")
            if in_features % block_values(qtype):
                raise ValueError(f"in_features {in_features} is not a multiple of {qtype}'s {block_values(qtype)}")
            if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != row_bytes(qtype, in_features):
                raise ValueError(f"{qtype} rows of {in_features} values must be uint8 [n, "
                                 f"{row_bytes(qtype, in_features)}], got {rows.dtype} {tuple(rows.shape)}")
            if merged and merged[-1][0] == qtype:
                merged[-1][1].append(rows)
            else:
                merged.append((qtype, [rows]))
        segments = tuple(BlockSegment(t, torch.cat(r).contiguous() if len(r) > 1 else r[0].contiguous())
                         for t, r in merged)
        return cls(segments, in_features)

    @functools.cached_property
    def out_features(self) -> int:
        return sum(s.data.shape[0] for s in self.segments)

    @functools.cached_property
    def _kernel_segments(self) -> tuple[tuple[int, int, int, torch.Tensor], ...]:
        """Per segment ``(first column, end column, GGML type id, rows)``, computed once (decode calls
        ``linear`` ~120 times a step)."""
        parts, lo = [], 0
        for s in self.segments:
            parts.append((lo, lo + s.data.shape[0], NATIVE_TYPES[s.qtype][0], s.data))
            lo += s.data.shape[0]
        return tuple(parts)

    @property
    def nbytes(self) -> int:
        return sum(s.data.numel() for s in self.segments)

    def dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight ``[out, in]`` the blocks stand for."""
        return torch.cat([dequantize(s.data, s.qtype, dtype) for s in self.segments])

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [T, in] @ dense()^T + bias -> [T, out]``."""
        modules = [_segment_kernel(s.qtype) if x.device.type == "cpu" else None for s in self.segments]
        if None in modules or x.dtype != torch.float32 or x.dim() != 2 or x.stride(-1) != 1:
            return F.linear(x, self.dense(x.dtype), bias)
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        segments = self._kernel_segments
        if len(segments) == 1:
            modules[0].linear_into(x, segments[0][3], segments[0][2], y, bias)
            return y
        for (lo, hi, type_id, data), module in zip(segments, modules, strict=True):
            module.linear_into(x, data, type_id, y[:, lo:hi], None if bias is None else bias[lo:hi])
        return y


def _segment_kernel(qtype: str) -> ModuleType | None:
    """The kernel that multiplies ``qtype`` rows on this CPU (None: dequantize per call)."""
    return kquant_kernel.kernel() if qtype in K_TYPES else kernel()
