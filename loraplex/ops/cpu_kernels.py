"""The decode step's non-matmul work as a few C++ kernels for x86 CPUs with AVX2 (float32).

- ``paged_decode_attention(q, cache, tables, first, end, scale)``: one-token attention that reads the
  paged KV cache in place, block by block (``paged_attention.cpp``): no gather copy of K/V.
- ``decode_attention_qkv(qkv, cos, signed_sin, cache, tables, first, end, scale, heads)``: a decode step's
  rotary on q and k, K/V write and attention from the packed q/k/v projection output in one call
  (``fused_decode.cpp``), rounding exactly as ``rotary`` then ``paged_decode_attention``.
- ``rms_norm(x, weight, eps, offset)``, ``silu_mul(gate_up)``, ``rotary(x, cos, signed_sin)``: one pass per
  row each (``fused_pointwise.cpp``), where torch runs three to six ops; ``add_rms_norm(x, residual, ...)``:
  the residual add (in place into ``x``) and the next RMSNorm in one pass (vLLM's ``fused_add_rms_norm``).

Each one's ``Semantics:`` is in its C++ source; the torch code it replaces (``loraplex.layers``) stays
as the path for every other case (CUDA, other dtypes, no compiler), and tests hold both to float64
references. The module is built from the sources with the system compiler by
``torch.utils.cpp_extension`` at first use and cached (``make install`` builds it once); where it
cannot be built, ``kernels()`` logs why once and returns None.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch

from loraplex.ops.cpp_build import build_cpu_extension

_SOURCES = [Path(__file__).with_name(name) for name in ("cpu_kernels.cpp", "paged_attention.cpp",
                                                        "fused_pointwise.cpp", "fused_decode.cpp")]
# AVX2 + FMA, ATen's vectorised exp (Vectorized<float> at that capability), and no implicit fused
# multiply-adds: the pointwise kernels round as the torch ops they replace do.
_FLAGS = ["-O3", "-mavx2", "-mfma", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-ffp-contract=off"]


@functools.cache
def kernels() -> ModuleType | None:
    """The compiled module, or None where it cannot be built or run (no AVX2, no compiler; logged once)."""
    return build_cpu_extension("loraplex_cpu_kernels", "CPU step kernels", _SOURCES, _FLAGS,
                               "the torch ops run instead")


def for_tensors(*tensors: torch.Tensor) -> ModuleType | None:
    """The kernels when every tensor is a float32 CPU tensor and they are built; else None."""
    for t in tensors:  # a plain loop: this runs a few hundred times per step
        if t.dtype is not torch.float32 or not t.is_cpu:
            return None
    return kernels()
