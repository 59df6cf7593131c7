"""Rotary position embeddings with the ``rope_scaling`` types of the supported families.

Frequencies follow HF transformers' ``modeling_rope_utils`` exactly (float32 arithmetic in the same
order), so cos/sin match HF bit for bit where the formulas agree:

- default: ``inv_freq[i] = 1 / theta ** (2i / d)`` for ``i < d/2``
- linear: ``inv_freq / factor``
- llama3: low frequencies divided by ``factor``, high ones kept, the band between interpolated
- dynamic (NTK): ``theta' = theta * (factor * L / max_pos - (factor - 1)) ** (d / (d - 2))`` with
  ``L = max(seq_len, max_pos)``.
- longrope (Phi-3): ``inv_freq[i] = 1 / (ext[i] * theta ** (2i / d))`` with ``ext = long_factor`` once
  ``seq_len > original_max_position_embeddings``, else ``short_factor``; cos and sin are multiplied by
  ``attention_factor``.

HF uses one ``seq_len`` per forward call (the batch's largest position + 1); here it is per sequence
(its last position this step + 1), which equals HF for a sequence run alone and keeps the batch
independent. A prompt prefilled in chunks sees each chunk's own length (HF: the whole prompt's).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from loraplex.config import ModelConfig, RopeScaling
from loraplex.ops import cpu_kernels


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))  # [dim/2]


def _llama3_inv_freq(theta: float, dim: int, s: RopeScaling) -> torch.Tensor:
    inv_freq = _base_inv_freq(theta, dim)  # [dim/2]
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


def _longrope_inv_freq(theta: float, dim: int, factors: tuple[float, ...]) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # [dim/2]
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**exponents)


def inv_frequencies(theta: float, dim: int, scaling: RopeScaling) -> torch.Tensor:
    """Static inverse frequencies ``[dim / 2]`` float32 (for "dynamic": those below max_pos; for
    "longrope": the short ones)."""
    if scaling.rope_type == "llama3":
        return _llama3_inv_freq(theta, dim, scaling)
    if scaling.rope_type == "longrope":
        return _longrope_inv_freq(theta, dim, scaling.short_factor)
    inv_freq = _base_inv_freq(theta, dim)
    if scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    return inv_freq


def dynamic_inv_frequencies(theta: float, dim: int, factor: float, max_pos: int,
                            seq_lens: torch.Tensor) -> torch.Tensor:
    """Dynamic-NTK inverse frequencies per token: ``seq_lens [T]`` -> ``[T, dim / 2]`` float32."""
    length = torch.clamp(seq_lens, min=max_pos).to(torch.float32)  # [T]
    theta_t = theta * ((factor * length / max_pos) - (factor - 1)) ** (dim / (dim - 2))  # [T]
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=seq_lens.device) / dim  # [dim/2]
    return 1.0 / (theta_t[:, None] ** exponents[None, :])


class RotaryEmbedding(nn.Module):
    """Builds per-step cos/sin once; ``apply_rotary`` rotates q and k of every layer with them (the first
    ``cfg.rotary_dim`` dimensions of each head: all of them unless ``partial_rotary_factor < 1``).

    ``theta`` and ``scaling`` default to the config's; a family whose layer types use other bases
    (Gemma 3's local layers) builds one ``RotaryEmbedding`` per base."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str, theta: float | None = None,
                 scaling: RopeScaling | None = None) -> None:
        super().__init__()
        self.theta = cfg.rope_theta if theta is None else theta
        self.scaling = cfg.rope_scaling if scaling is None else scaling
        self.dim, self.max_pos = cfg.rotary_dim, cfg.max_position_embeddings  # head_dim unless partial
        self.register_buffer("inv_freq", inv_frequencies(self.theta, self.dim, self.scaling).to(device),
                             persistent=False)  # [d/2]
        long_freq = (_longrope_inv_freq(self.theta, self.dim, self.scaling.long_factor).to(device)
                     if self.scaling.rope_type == "longrope" else None)
        self.register_buffer("long_inv_freq", long_freq, persistent=False)  # [d/2] longrope only

    def length_dependent_above(self) -> int | None:
        """The sequence length past which cos/sin depend on how long the sequence is, not only on the
        position (so a token's K depends on its sequence's length when it was computed); None if never."""
        if self.scaling.rope_type == "dynamic":
            return self.max_pos
        if self.scaling.rope_type == "longrope":
            return self.scaling.original_max_position_embeddings
        return None

    def _inv_freq(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """``[T, d/2]`` or ``[1, d/2]`` inverse frequencies for tokens of sequences of ``seq_lens [T]``."""
        s = self.scaling
        if s.rope_type == "dynamic":
            return dynamic_inv_frequencies(self.theta, self.dim, s.factor, self.max_pos, seq_lens)
        if s.rope_type == "longrope":
            long = (seq_lens > s.original_max_position_embeddings)[:, None]  # [T, 1]
            return torch.where(long, self.long_inv_freq[None, :], self.inv_freq[None, :])
        return self.inv_freq[None, :]

    def cos_sin(
        self, positions: torch.Tensor, seq_lens: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [T]``, ``seq_lens [T]`` (the token's sequence length after this step) ->
        ``cos [T, 1, d]`` and ``signed_sin [T, 1, d]`` where ``signed_sin = cat(-sin, sin)``."""
        freqs = positions[:, None].to(torch.float32) * self._inv_freq(seq_lens)  # [T, d/2]
        cos, sin = freqs.cos(), freqs.sin()
        if self.scaling.attention_factor != 1.0:
            cos, sin = cos * self.scaling.attention_factor, sin * self.scaling.attention_factor
        return (torch.cat((cos, cos), dim=-1).to(dtype)[:, None, :],
                torch.cat((-sin, sin), dim=-1).to(dtype)[:, None, :])


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Semantics: ``out = x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``
    (HF's convention), computed as ``x * cos + cat(x2, x1) * signed_sin`` (one CPU kernel for float32,
    ``loraplex.ops.cpu_kernels``). Shapes: x ``[T, heads, d]``, cos/signed_sin ``[T, 1, d]`` -> ``[T, heads, d]``
    (new tensor)."""
    contiguous = x.stride(-1) == 1 and cos.is_contiguous() and signed_sin.is_contiguous()
    kernels = cpu_kernels.for_tensors(x, cos, signed_sin) if contiguous else None
    if kernels is not None:
        return kernels.rotary(x, cos, signed_sin)
    t, heads, d = x.shape
    swapped = x.view(t, heads, 2, d // 2).flip(2).view(t, heads, d)  # cat(x2, x1)
    return torch.addcmul(x * cos, swapped, signed_sin)
