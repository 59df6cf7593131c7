"""Log-probabilities of chosen tokens and their top alternatives, for the rows that ask (only those pay).

They are taken from the model's raw logits for the request's adapter: before penalties, bias,
temperature and top-k/p (vLLM's ``logprobs_mode="raw_logprobs"``), so they describe the model, not the
sampler. A ``TokenLogprob`` is a plain tuple of ints and floats (picklable, JSON-able).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from loraplex.engine.request import Request


class TokenLogprob(NamedTuple):
    """One position: the token there, its log-probability, its rank (1 = the most likely token) and the
    ``k`` most likely tokens as ``(token_id, logprob)``, most likely first."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], top_ks: Sequence[int]) -> list[TokenLogprob]:
    """Semantics: lp_i = log_softmax(logits[i]); row i gives (token_ids[i], lp_i[token_ids[i]],
    1 + #{t: lp_i[t] > lp_i[token_ids[i]]}, the top_ks[i] largest (t, lp_i[t]) in descending order).
    Shapes: logits [R, vocab] float32 (raw), token_ids and top_ks R entries."""
    if not token_ids:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)  # [R, vocab]
    chosen = lp.gather(1, torch.tensor(list(token_ids), dtype=torch.int64)[:, None])  # [R, 1]
    ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
    k_max = max(top_ks)
    top_values, top_ids = (torch.topk(lp, k_max, dim=-1) if k_max else (lp[:, :0], lp[:, :0].long()))
    values, ids = top_values.tolist(), top_ids.tolist()
    return [
        TokenLogprob(token, logprob, rank, tuple(zip(ids[i][:k], values[i][:k], strict=True)))
        for i, (token, logprob, rank, k) in enumerate(zip(token_ids, chosen[:, 0].tolist(), ranks, top_ks,
                                                          strict=True))
    ]


def needs_prompt_rows(request: Request, start: int, num_tokens: int) -> bool:
    """Whether a step computing positions ``[start, start + num_tokens)`` of ``request`` computes prompt
    positions whose logprobs it asked for and lacks."""
    done = request.prompt_logprobs
    return done is not None and max(start, len(done) - 1) < min(start + num_tokens, len(request.prompt_token_ids) - 1)


def add_prompt_logprobs(request: Request, start: int, logits: torch.Tensor) -> None:
    """Append the logprobs of the prompt tokens that ``logits [num_tokens, vocab]`` (row j: position
    ``start + j``, which predicts the token at ``start + j + 1``) score and ``request`` still lacks; a
    recomputed (preempted) prompt is not scored twice."""
    prompt, done = request.prompt_token_ids, request.prompt_logprobs
    first, end = max(start, len(done) - 1), min(start + logits.shape[0], len(prompt) - 1)  # positions q
    targets = prompt[first + 1 : end + 1]
    k = request.params.prompt_logprobs
    done += token_logprobs(logits[first - start : end - start], targets, [k] * len(targets))
