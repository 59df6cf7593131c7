"""Next-token selection: greedy, temperature, top-k, top-p, with per-request seeded generators."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loraplex.engine.request import SamplingParams


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
) -> list[int]:
    """Pick one token per row.

    Semantics: row i is argmax(logits[i]) when ``params[i]`` is greedy; otherwise a draw from
    softmax(logits[i] / T) restricted to the top-k tokens and then to the smallest set whose
    probability mass reaches top_p, using ``generators[i]`` (a seeded request owns its generator, so
    its draws do not depend on the rest of the batch).
    Shapes: logits [S, vocab] float32.
    """
    # logits: [S, vocab]
    chosen = torch.argmax(logits, dim=-1).tolist()
    for i, p in enumerate(params):
        if not p.greedy:
            chosen[i] = _draw(logits[i], p, generators[i])
    return chosen


def _draw(row: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
    # row: [vocab]
    # float64, shifted by the max: any temperature > 0 (even 1e-300) sends the others to -inf,
    # never the max to inf or NaN.
    scaled = (row.double() - row.max()) / p.temperature
    if p.top_k > 0 and p.top_k < scaled.numel():
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop = mass_before >= p.top_p
        drop[0] = False  # the most likely token always stays (a top_p below float32's range is 0)
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator).item())
