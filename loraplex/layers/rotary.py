"""Rotary position embeddings with the ``rope_scaling`` types of the Llama family.

Frequencies follow HF transformers' ``modeling_rope_utils`` exactly (float32 arithmetic in the same
order), so cos/sin match HF bit for bit where the formulas agree:

- default: ``inv_freq[i] = 1 / theta ** (2i / d)`` for ``i < d/2``
- linear: ``inv_freq / factor``
- llama3: low frequencies divided by ``factor``, high ones kept, the band between interpolated
- dynamic (NTK): ``theta' = theta * (factor * L / max_pos - (factor - 1)) ** (d / (d - 2))`` with
  ``L = max(seq_len, max_pos)``. HF uses one ``seq_len`` per forward call (the batch's largest
  position + 1); here it is per sequence (its last position this step + 1), which equals HF for a
  sequence run alone and keeps the batch independent.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from loraplex.config import ModelConfig


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))  # [dim/2]


def _llama3_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    s = cfg.rope_scaling
    inv_freq = _base_inv_freq(cfg.rope_theta, cfg.head_dim)  # [dim/2]
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def inv_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """Static inverse frequencies ``[head_dim / 2]`` float32 (for "dynamic": those below max_pos)."""
    rope_type = cfg.rope_scaling.rope_type
    if rope_type == "llama3":
        return _llama3_inv_freq(cfg)
    inv_freq = _base_inv_freq(cfg.rope_theta, cfg.head_dim)
    if rope_type == "linear":
        inv_freq = inv_freq / cfg.rope_scaling.factor
    return inv_freq


def dynamic_inv_frequencies(cfg: ModelConfig, seq_lens: torch.Tensor) -> torch.Tensor:
    """Dynamic-NTK inverse frequencies per token: ``seq_lens [T]`` -> ``[T, head_dim / 2]`` float32."""
    dim, factor, max_pos = cfg.head_dim, cfg.rope_scaling.factor, cfg.max_position_embeddings
    length = torch.clamp(seq_lens, min=max_pos).to(torch.float32)  # [T]
    theta = cfg.rope_theta * ((factor * length / max_pos) - (factor - 1)) ** (dim / (dim - 2))  # [T]
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=seq_lens.device) / dim  # [dim/2]
    return 1.0 / (theta[:, None] ** exponents[None, :])


class RotaryEmbedding(nn.Module):
    """Builds per-step cos/sin once; ``apply`` rotates q and k of every layer with them."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str) -> None:
        super().__init__()
        self.cfg = cfg
        self.dynamic = cfg.rope_scaling.rope_type == "dynamic"
        self.register_buffer("inv_freq", inv_frequencies(cfg).to(device), persistent=False)  # [d/2]

    def cos_sin(
        self, positions: torch.Tensor, seq_lens: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [T]``, ``seq_lens [T]`` (the token's sequence length after this step) ->
        ``cos [T, 1, d]`` and ``signed_sin [T, 1, d]`` where ``signed_sin = cat(-sin, sin)``."""
        if self.dynamic:
            inv_freq = dynamic_inv_frequencies(self.cfg, seq_lens)  # [T, d/2]
        else:
            inv_freq = self.inv_freq[None, :]  # [1, d/2]
        freqs = positions[:, None].to(torch.float32) * inv_freq  # [T, d/2]
        cos, sin = freqs.cos(), freqs.sin()
        return (torch.cat((cos, cos), dim=-1).to(dtype)[:, None, :],
                torch.cat((-sin, sin), dim=-1).to(dtype)[:, None, :])


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Semantics: ``out = x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``
    (HF's convention), computed as ``x * cos + cat(x2, x1) * signed_sin``.
    Shapes: x ``[T, heads, d]``, cos/signed_sin ``[T, 1, d]`` -> ``[T, heads, d]`` (new tensor)."""
    t, heads, d = x.shape
    swapped = x.view(t, heads, 2, d // 2).flip(2).view(t, heads, d)  # cat(x2, x1)
    return torch.addcmul(x * cos, swapped, signed_sin)
