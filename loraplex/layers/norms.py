"""Normalisation layers shared by the model families."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Semantics: ``y = weight * (x / sqrt(mean(x^2, -1) + eps))`` over the last dimension, computed in
    float32 as HF does. Shapes: x ``[..., hidden]`` -> same shape and dtype."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # no copy for float32
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
