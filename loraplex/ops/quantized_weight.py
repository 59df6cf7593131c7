"""``QuantizedWeight``: what a layer needs of a base weight kept in a compact form (``ops.int8.Int8Weight``,
``ops.gguf.block_weight.BlockWeight``): its product with activations, and the float weight it stands for."""

from __future__ import annotations

from typing import Protocol

import torch


class QuantizedWeight(Protocol):
    """A weight ``[out, in]``: ``linear(x, bias) == x @ dense()^T + bias`` for ``x [T, in]`` (float rounding
    aside), ``dense(dtype)`` the float weight ``[out, in]``."""

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor: ...

    def dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor: ...
