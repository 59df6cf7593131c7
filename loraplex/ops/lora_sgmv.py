"""The batched LoRA delta as one C++ kernel for x86 CPUs with AVX2 or AVX-512 (``lora_sgmv.cpp``).

Semantics: those of ``loraplex.ops.lora.add_lora`` (each slot group at its slot's own rank, B block by
block, rows with slot -1 untouched bit for bit, slots no group reads never read), computed as
    y[order[i]] += c_i * (x[order[i]] @ A[s_g, :R]^T) @ B[s_g, :, :R]^T    for i in o_g..o_{g+1}-1
(c = ``batch.entry_scales``, 1 without scales) in one call per pass of the plan:
each group's rows are read from x and written to y where they are (no gather,
scatter or padding), and the slot's A and B are read once for the group (the rows are computed four at
a time in registers against them). The groups are split evenly across torch's threads (a row is in one
group, which the kernel checks; each group is summed alike whatever the split, so y is the same bit for bit
at any thread count). The rank and the blocks come from the layer's int32 slot tables
(``LoRALinear.slot_ranks_dev`` / ``slot_blocks_dev``, ``[max_loras]`` / ``[max_loras, P, 4]``).

The kernel takes float32 x and y, A and B both float32 or both bfloat16 (``EngineConfig.lora_dtype``: each
weight is widened to float32 as it is read, every sum is float32, so bfloat16 weights give the float32 result
of their rounded values at half the bytes read), CPU tensors with unit inner strides and B stored rank-major
(``LoRALinear``'s layout: unit stride over out); for anything else ``add_lora_sgmv`` runs the torch ops. It is
built with the system compiler by ``torch.utils.cpp_extension`` at first use and cached (``make install``
builds it). One source, two builds chosen at run time by ``torch.backends.cpu.get_cpu_capability()``:
``"avx512"`` (16 floats per register) where it reports AVX512, else ``"avx2"`` (8); their dot products sum
in different orders, so they agree to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch

from loraplex.ops.cpp_build import build_cpu_extension, build_for_this_cpu
from loraplex.ops.lora import Blocks, LoRACache, add_lora
from loraplex.ops.lora_batch import LoRABatch

_SOURCE = Path(__file__).with_name("lora_sgmv.cpp")
WEIGHT_DTYPES = (torch.float32, torch.bfloat16)  # the adapter weight dtypes the kernel reads
_NO_SCALES = torch.empty(0, dtype=torch.float32)  # the kernel's "every entry scale is 1"


# The kernel's builds: name -> compiler flags (the source picks 16- or 8-lane vectors from ``__AVX512F__``).
ISA_FLAGS: dict[str, list[str]] = {
    "avx2": ["-O3", "-mavx2", "-mfma"],
    "avx512": ["-O3", "-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
}


@functools.cache
def kernel_build(isa: str) -> ModuleType | None:
    """The kernel built for ``isa`` (a key of ``ISA_FLAGS``), or None where it cannot be built (logged once).
    Only call it for an ISA this CPU runs (``kernel()`` chooses)."""
    return build_cpu_extension(f"loraplex_lora_sgmv_{isa}", f"LoRA sgmv kernel ({isa})", [_SOURCE], ISA_FLAGS[isa],
                               "the torch LoRA ops run instead")


@functools.cache
def kernel() -> ModuleType | None:
    """The kernel for this CPU: the AVX-512 build where ``get_cpu_capability()`` is AVX512 (falling back to
    AVX2 if it does not build), the AVX2 one on AVX2 CPUs, None elsewhere or where none builds."""
    return build_for_this_cpu(kernel_build)


def takes(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor) -> bool:
    """Whether the kernel computes this call: float32 x and y, float32 or bfloat16 A and B (one dtype), CPU
    tensors in the layouts it reads, and it is built."""
    if y.dtype is not torch.float32 or x.dtype is not torch.float32 or lora_b.dtype is not lora_a.dtype:
        return False
    if lora_a.dtype not in WEIGHT_DTYPES or not all(t.is_cpu for t in (y, x, lora_a, lora_b)):
        return False
    return (y.stride(-1) == 1 and x.stride(-1) == 1 and lora_a.stride(-1) == 1 and lora_b.stride(1) == 1
            and kernel() is not None)


def add_lora_sgmv(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                  slot_ranks: Sequence[int], slot_ranks_table: torch.Tensor, slot_blocks_table: torch.Tensor,
                  batch: LoRABatch, *, slot_blocks: Sequence[Blocks] | None = None,
                  cache: LoRACache | None = None) -> None:
    """``y += LoRA(x)`` per slot group (see the module docstring), in place; the torch ops where the kernel
    does not take the tensors. ``slot_ranks`` / ``slot_blocks`` are the tables' Python forms (for them)."""
    # x: [T, in]; y: [T, out]; lora_a: [max_loras, R_max, in]; lora_b: [max_loras, out, R_max]
    if not batch.has_lora:
        return
    if not takes(y, x, lora_a, lora_b):
        add_lora(y, x, lora_a, lora_b, slot_ranks, batch, slot_blocks=slot_blocks, cache=cache)
        return
    for part in (batch, *batch.more):
        scales = part.entry_scales
        kernel().sgmv(y, x, lora_a, lora_b, part.order, part.slots_tensor, part.offsets_tensor, slot_ranks_table,
                      slot_blocks_table, _NO_SCALES if scales is None else scales)
