"""Next-token selection for a batch: logits processors, then greedy or temperature / top-k / top-p /
min-p draws, vectorised over the rows that use each step, with per-request seeded generators.

A greedy row without processors costs nothing beyond the batch's one ``argmax``. Sampled rows are
warped together (one set of tensor ops per warper, over the rows that use it); the draw itself is one
``multinomial`` for all unseeded rows (the engine's generator) and one per seeded row (its own
generator, so a seeded request's tokens do not depend on the rest of the batch).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

import torch

from loraplex.engine.logits_processors import ProcessedRow, apply_logits_processors


class SampledRow(ProcessedRow, Protocol):
    generator: torch.Generator


def sample(logits: torch.Tensor, rows: Sequence[SampledRow], eos_token_ids: Collection[int] = ()) -> list[int]:
    """Pick one token per row; ``logits`` is modified in place (processors).

    Semantics: x_i = processors_i(logits[i]) (see ``apply_logits_processors``); row i is argmax(x_i) when
    greedy; otherwise a draw from softmax(x_i / T_i) restricted to the top-k tokens, then to the smallest
    set whose probability mass reaches top_p, then to the tokens whose probability is at least
    min_p times the largest, drawn with ``rows[i].generator``.
    Shapes: logits [S, vocab] float32; returns S token ids.
    """
    apply_logits_processors(logits, rows, eos_token_ids)
    chosen = torch.argmax(logits, dim=-1)  # [S]
    drawn = [i for i, r in enumerate(rows) if not r.params.greedy]
    if drawn:
        chosen[drawn] = _draw(logits[drawn], [rows[i] for i in drawn])
    return chosen.tolist()


def _draw(logits: torch.Tensor, rows: Sequence[SampledRow]) -> torch.Tensor:
    """One token per row of ``logits [R, vocab]`` from its warped distribution -> ``[R]`` int64."""
    # float64, shifted by the max: any temperature > 0 (even 1e-300) sends the others to -inf, never the max
    # to inf or NaN.
    temperature = torch.tensor([r.params.temperature for r in rows], dtype=torch.float64)
    x = (logits.double() - logits.max(dim=-1, keepdim=True).values) / temperature[:, None]  # [R, vocab]
    vocab = x.shape[-1]
    top_k = [i for i, r in enumerate(rows) if 0 < r.params.top_k < vocab]
    if top_k:
        ks = torch.tensor([rows[i].params.top_k for i in top_k])
        kth = torch.topk(x[top_k], int(ks.max()), dim=-1).values.gather(1, (ks - 1)[:, None])  # [Rk, 1]
        x[top_k] = x[top_k].masked_fill(x[top_k] < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)  # [R, vocab]
    top_p = [i for i, r in enumerate(rows) if r.params.top_p < 1.0]
    if top_p:
        probs[top_p] = _nucleus(probs[top_p], torch.tensor([rows[i].params.top_p for i in top_p],
                                                            dtype=torch.float64))
    min_p = [i for i, r in enumerate(rows) if r.params.min_p > 0.0]
    if min_p:
        floor = torch.tensor([rows[i].params.min_p for i in min_p], dtype=torch.float64)[:, None]
        sub = probs[min_p]
        probs[min_p] = sub.masked_fill(sub < floor * sub.max(dim=-1, keepdim=True).values, 0.0)
    return _multinomial(probs, rows)


def _nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's smallest most-likely set reaching mass ``top_p [R]``: ``probs [R, vocab]`` -> same."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop = mass_before >= top_p[:, None]
    drop[:, 0] = False  # the most likely token always stays (a top_p below float32's range is 0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs.masked_fill(drop, 0.0))


def _multinomial(probs: torch.Tensor, rows: Sequence[SampledRow]) -> torch.Tensor:
    """One draw per row (rows need not be normalised): one call for the rows sharing a generator, one
    per row with its own."""
    out = torch.empty(len(rows), dtype=torch.int64)
    by_generator: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        by_generator.setdefault(id(r.generator), []).append(i)
    for members in by_generator.values():
        generator = rows[members[0]].generator
        out[members] = torch.multinomial(probs[members], 1, generator=generator)[:, 0]
    return out
