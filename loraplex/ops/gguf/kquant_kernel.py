"""The K-quant kernel (``kquant_gemm.cpp``: ``Q4_K``, ``Q5_K``, ``Q6_K``), built with the system compiler at
first use and cached, in the same two builds as the block kernel (``block_weight.ISA_FLAGS``), chosen at run
time by ``torch.backends.cpu.get_cpu_capability()``. ``linear_into(x, w, type_id, y, bias)`` writes
``y [M, N] = x [M, K] @ dequantize(w)^T + bias`` (K a multiple of 256)."""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

from loraplex.ops.cpp_build import build_cpu_extension, build_for_this_cpu

_KERNEL_SOURCE = Path(__file__).with_name("kquant_gemm.cpp")


@functools.cache
def kernel_build(isa: str) -> ModuleType | None:
    """The K-quant kernel built for ``isa`` ("avx2" or "avx512"), None where it cannot be built (logged)."""
    from loraplex.ops.gguf.block_weight import ISA_FLAGS

    return build_cpu_extension(f"loraplex_gguf_kquant_gemm_{isa}", f"GGUF K-quant kernel ({isa})", [_KERNEL_SOURCE],
                               ISA_FLAGS[isa], "GGUF K-quant matmuls dequantize per call")


@functools.cache
def kernel() -> ModuleType | None:
    """The K-quant kernel for this CPU (AVX-512 build, else AVX2), None where none builds or runs."""
    return build_for_this_cpu(kernel_build)
