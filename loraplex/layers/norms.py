"""Normalisation layers shared by the model families."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Semantics: ``y = (offset + weight) * (x / sqrt(mean(x^2, -1) + eps))`` over the last dimension,
    computed in float32 as HF does. ``offset`` is 0 for Llama-style norms and 1 for Gemma's, whose
    checkpoints store ``weight - 1`` (HF then multiplies in float32 before casting; Llama casts first).
    Shapes: x ``[..., hidden]`` -> same shape and dtype."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, device: torch.device | str,
                 offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # no copy for float32
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (normed * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * normed.to(x.dtype)
