"""Logit soft-capping (Gemma 2, Gemma 3): a smooth clamp of scores to ``(-cap, cap)``."""

from __future__ import annotations

import torch


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """Semantics: ``y = tanh(x / cap) * cap``, elementwise, in that order (HF's), so float32 results match HF's
    bit for bit; ``-inf`` stays ``-inf`` (a masked or padded score must not become ``-cap``). Any shape (new
    tensor)."""
    capped = torch.tanh(x / cap) * cap
    return torch.where(x == float("-inf"), x, capped)
