"""The gated MLP of the supported families: ``down(act(gate(x)) * up(x))`` (SwiGLU with SiLU, GeGLU
with GELU), with gate and up packed (or fused, as Phi-3 stores them) in one ``LoRALinear``."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.errors import ModelError
from loraplex.layers.lora_linear import LoRALinear
from loraplex.ops import cpu_kernels
from loraplex.ops.lora_batch import LoRABatch

# HF ``hidden_act`` / ``hidden_activation`` names -> the function HF's ACT2FN maps them to
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation HF calls ``name``; ``ModelError`` naming the supported ones otherwise."""
    if name not in ACTIVATIONS:
        raise ModelError(f"unsupported activation {name!r}; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class GatedMLP(nn.Module):
    """Semantics: ``y = down_proj(act(g) * u)`` with ``[g, u] = gate_up_proj(x)`` split in halves.
    Shapes: x ``[T, hidden]`` -> ``[T, hidden]``; ``gate_up_proj`` is ``hidden -> 2 I``. SiLU's
    ``act(g) * u`` runs as one CPU kernel for float32 (``loraplex.ops.cpu_kernels``)."""

    def __init__(self, gate_up_proj: LoRALinear, down_proj: LoRALinear, hidden_act: str) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj = gate_up_proj, down_proj
        self.intermediate = down_proj.in_features
        self.act = activation(hidden_act)

    def adapted(self) -> tuple[LoRALinear, LoRALinear]:
        return (self.gate_up_proj, self.down_proj)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, lora)  # [T, 2I]
        kernels = cpu_kernels.for_tensors(gate_up) if self.act is F.silu else None
        if kernels is not None:
            return self.down_proj(kernels.silu_mul(gate_up), lora)
        return self.down_proj(self.act(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate :], lora)
