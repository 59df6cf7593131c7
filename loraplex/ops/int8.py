"""Weight-only int8 base matmuls: per-output-channel symmetric quantization, float activations.

Semantics: ``quantize(W) = (q, s)`` with ``s[n] = max_k |W[n, k]| / 127`` (1 for an all-zero row) and
``q[n, k] = round(W[n, k] / s[n])`` in [-127, 127]; ``Int8Weight.linear(x, bias) == x @ dequantize(q, s)^T
+ bias`` up to float rounding, ``dequantize(q, s)[n, k] = q[n, k] * s[n]``. x ``[T, in]`` float32,
q ``[out, in]`` int8, s ``[out]`` float32 -> ``[T, out]``. Activations are never quantized, so each row's
result depends on that row alone (a request's output does not depend on its batch).

On x86 CPUs the matmul runs a small C++ kernel (``int8_gemm.cpp``), built with the system compiler by
``torch.utils.cpp_extension`` at first use and cached; it reads a quarter of float32's weight bytes. One
source, two builds chosen at run time by ``torch.backends.cpu.get_cpu_capability()``: ``"avx512"``
(``-mavx512f``: 16 channels per register, 12x32 tiles) where it reports AVX512, else ``"avx2"`` (6x16
tiles). Both sum every output element in the same order, so they give bitwise the same result, whatever
the batch. Where neither can be built or used (other CPUs, CUDA, no compiler) the weight is dequantized
per call and ``F.linear`` runs: the same numbers, at float32 speed or less.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from loraplex.ops.cpp_build import build_cpu_extension, build_for_this_cpu

_KERNEL_SOURCE = Path(__file__).with_name("int8_gemm.cpp")


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [out, in]`` float -> ``(q [out, in] int8, scale [out] float32)``, per output channel."""
    w = weight.detach().to(torch.float32)
    amax = w.abs().amax(dim=1)  # [out]
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q [out, in] * scale[:, None]`` as ``dtype`` (the float weight the int8 one stands for)."""
    return (q.to(torch.float32) * scale[:, None]).to(dtype)


# The kernel's builds: name -> compiler flags (the source picks its vector width from ``__AVX512F__``).
# ``-ffp-contract=off``: only the source's explicit fused multiply-adds, so both builds round alike.
ISA_FLAGS: dict[str, list[str]] = {
    "avx2": ["-O3", "-mavx2", "-mfma", "-ffp-contract=off"],
    "avx512": ["-O3", "-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-ffp-contract=off"],
}


@functools.cache
def kernel_build(isa: str) -> ModuleType | None:
    """The kernel built for ``isa`` (a key of ``ISA_FLAGS``), or None where it cannot be built (logged
    once). Only call it for an ISA this CPU runs (``kernel()`` chooses)."""
    return build_cpu_extension(f"loraplex_int8_gemm_{isa}", f"int8 kernel ({isa})", [_KERNEL_SOURCE], ISA_FLAGS[isa],
                               "int8 matmuls dequantize per call")


@functools.cache
def kernel() -> ModuleType | None:
    """The kernel for this CPU: the AVX-512 build where ``get_cpu_capability()`` is AVX512 (falling back to
    AVX2 if it does not build), the AVX2 one on AVX2 CPUs, None elsewhere or where none builds."""
    return build_for_this_cpu(kernel_build)


@dataclass(frozen=True)
class Int8Weight:
    """One base weight in int8: the kernel's packed layout ``[ceil(out/16), in, 16]`` when the kernel is
    used (``packed``), else plain ``q [out, in]``; ``scale [out]``. Only one copy of q is kept."""

    data: torch.Tensor
    scale: torch.Tensor
    packed: bool

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Int8Weight:
        q, scale = quantize(weight)
        module = kernel() if weight.device.type == "cpu" else None
        return cls(module.pack(q), scale, True) if module is not None else cls(q, scale, False)

    @property
    def q(self) -> torch.Tensor:
        """``q [out, in]`` int8 (a copy when packed)."""
        if not self.packed:
            return self.data
        blocks, in_features, width = self.data.shape
        return self.data.transpose(1, 2).reshape(blocks * width, in_features)[: self.scale.shape[0]]

    def dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight ``[out, in]`` this one stands for."""
        return dequantize(self.q, self.scale, dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [T, in] @ dequantize(q, scale)^T + bias -> [T, out]``."""
        if self.packed and x.dtype == torch.float32 and x.dim() == 2 and x.stride(-1) == 1:
            return kernel().linear(x, self.data, self.scale, bias)
        return F.linear(x, self.dense(x.dtype), bias)
