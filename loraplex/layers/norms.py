"""Normalisation layers shared by the model families."""

from __future__ import annotations

import torch
from torch import nn

from loraplex.ops import cpu_kernels


class RMSNorm(nn.Module):
    """Semantics: ``y = (offset + weight) * (x / sqrt(mean(x^2, -1) + eps))`` over the last dimension,
    computed in float32 as HF does. ``offset`` is 0 for Llama-style norms and 1 for Gemma's, whose
    checkpoints store ``weight - 1`` (HF then multiplies in float32 before casting; Llama casts first).
    Shapes: x ``[..., hidden]`` -> same shape and dtype. Rows ``[T, hidden]`` in float32 on a CPU run
    as one kernel (``loraplex.ops.cpu_kernels``), the same arithmetic in one pass."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, device: torch.device | str,
                 offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = cpu_kernels.for_tensors(x) if x.dim() == 2 and x.stride(-1) == 1 else None
        if kernels is not None:
            return kernels.rms_norm(x, self.weight, self.eps, self.offset)
        x32 = x.float()  # no copy for float32
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (normed * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * normed.to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Semantics: ``h = residual + x``; returns ``(h, self(h))``, the residual stream and its norm, with
        the same arithmetic as the add and ``forward`` separately. ``x`` is a block's fresh output that the
        caller gives up: float32 rows ``[T, hidden]`` on a CPU run as one kernel (vLLM's
        ``fused_add_rms_norm``) that writes ``h`` into ``x`` and returns ``(x, normed)``."""
        rows = x.dim() == 2 and x.stride(-1) == 1 and residual.dim() == 2 and residual.stride(-1) == 1
        kernels = cpu_kernels.for_tensors(x, residual) if rows else None
        if kernels is not None:
            return x, kernels.add_rms_norm(x, residual, self.weight, self.eps, self.offset)
        hidden = residual + x
        return hidden, self(hidden)
