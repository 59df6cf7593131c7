"""The acceptance rule: which draft tokens a verification step keeps, and the token that follows them.

A request that drafted k tokens ``d`` ran k + 1 positions in the step: its last token, then the draft. Row j of
its logits scores the token after position j, under the request's own adapter. Greedy rows keep the longest
prefix of the draft that equals the argmax of each row, then the argmax after it, which is exactly what k + 1
plain decoding steps would produce. Sampled rows use the standard rejection rule (Leviathan et al. 2023,
Chen et al. 2023) with a deterministic (one-hot) proposal q = e_d: accept d_j with probability
min(1, p_j(d_j) / q_j(d_j)) = p_j(d_j); at the first rejection draw from the residual norm(max(p_j - q_j, 0)),
which is p_j with d_j removed; after k acceptances draw the bonus token from p_k. Each emitted token is then
distributed exactly as plain sampling's (p being the request's warped distribution: temperature, top-k,
top-p, min-p).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from loraplex.engine.sampling.sampler import inverse_cdf, warped_probs

if TYPE_CHECKING:
    from loraplex.engine.request import Request


def accept_drafts(logits: torch.Tensor, firsts: Sequence[int], drafts: Sequence[Sequence[int]],
                  requests: Sequence[Request]) -> list[list[int]]:
    """Each request's accepted run: the draft tokens kept, then one more token (so 1 to k + 1 tokens).

    Semantics: for request i with draft d (k = len(d) >= 1) and rows l_j = logits[firsts[i] + j], j = 0..k:
    greedy: a = max{a <= k : d_j == argmax l_j for all j < a}; run = d[:a] + [argmax l_a].
    sampled: p_j = normalised ``warped_probs(l_j)``; u_j ~ U[0, 1) from the request's generator; a = the first
    j < k with u_j >= p_j(d_j), else k; run = d[:a] + [x], x ~ p_a with p_a(d_a) set to 0 when a < k.
    Shapes: logits [R, vocab] float32 (raw: these rows have no processors, see ``can_speculate``); returns
    one list per request, in order.
    """
    runs: list[list[int]] = []
    for first, draft, request in zip(firsts, drafts, requests, strict=True):
        rows = logits[first:first + len(draft) + 1]  # [k + 1, vocab]
        runs.append(_greedy(rows, draft) if request.params.greedy else _sampled(rows, draft, request))
    return runs


def _greedy(rows: torch.Tensor, draft: Sequence[int]) -> list[int]:
    """The longest draft prefix matching each row's argmax, then the argmax after it."""
    best = rows.argmax(dim=-1).tolist()  # [k + 1]
    a = 0
    while a < len(draft) and draft[a] == best[a]:
        a += 1
    return [*draft[:a], best[a]]


def _sampled(rows: torch.Tensor, draft: Sequence[int], request: Request) -> list[int]:
    """The rejection rule with a one-hot proposal over ``rows [k + 1, vocab]``."""
    k = len(draft)
    probs = warped_probs(rows, [request] * (k + 1))  # [k + 1, vocab]
    probs = probs / probs.sum(dim=-1, keepdim=True)
    p_draft = probs[torch.arange(k), torch.tensor(list(draft), dtype=torch.int64)]  # [k]
    u = torch.rand(k, dtype=torch.float64, generator=request.generator)  # [k]
    rejected = (u >= p_draft.double()).tolist()
    a = rejected.index(True) if True in rejected else k
    final = probs[a : a + 1].clone()  # [1, vocab]
    if a < k:
        final[0, draft[a]] = 0.0  # the residual max(p - e_d, 0): p without the draft token
        if not bool(final.sum() > 0):  # p was e_d up to rounding (u hit its last ulp): d_a is the only choice
            return [*draft[: a + 1]]
    return [*draft[:a], int(inverse_cdf(final, [request])[0])]
