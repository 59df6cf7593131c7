"""The pooler: which rows of a step's flat batch a pooled request reads, and its running pool across chunks.

Semantics, for one pooled request with prompt length ``P`` and final hidden states ``h [P, hidden]`` (after the
model's final norm): ``last`` ``v = h[P - 1]``, ``mean`` ``v = (sum_p h[p]) / P``, ``cls`` ``v = h[0]``; then
``v = v[:dimensions]`` and, with ``normalize``, ``v = v / max(||v||_2, 1e-12)``.

A prompt may be prefilled in several chunks (chunked prefill), so each step reads only the rows its chunk
``[start, start + n)`` computes that the pool needs: ``last`` the prompt's last token (in its final chunk),
``cls`` position 0 (in its first chunk), ``mean`` every row, summed in float64 into the request's ``PoolState``.
A ``mean`` chunk starting at 0 resets the sum (a preempted request is recomputed from its prompt); a ``last`` or
``cls`` read replaces it. ``mean`` and
``cls`` never start past 0 (the scheduler serves them no prefix-cache hit: ``PoolingParams.needs_every_row``).
A classifying request's ``PoolState`` holds the head of the version it was admitted on (``RequestIntake``), so
its logits are that version's whatever the name serves by the time it finishes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loraplex.adapters.reading.weights import ScoreHead
from loraplex.engine.pooling.params import PoolingParams


@dataclass
class PoolState:
    """One pooled request's pool so far: the float64 sum of the rows read (``mean``) or the row (``last``,
    ``cls``), ``[hidden]``, and how many rows it holds; ``head``: a classifying request's version's head."""

    total: torch.Tensor | None = None  # [hidden] float64
    rows: int = 0
    head: ScoreHead | None = None

    def add(self, hidden: torch.Tensor, restart: bool) -> None:
        """Fold ``hidden [n, hidden]`` (the rows one step read) in; ``restart`` drops what it held first."""
        if restart or self.total is None:
            self.total, self.rows = torch.zeros(hidden.shape[-1], dtype=torch.float64), 0
        self.total = self.total + hidden.to(torch.float64).sum(0)  # [hidden]
        self.rows += hidden.shape[0]

    def vector(self, params: PoolingParams) -> list[float]:
        """The pooled vector: ``total / rows``, truncated to ``dimensions``, L2-normalised if asked; with
        ``classify`` the head's logits of it (``[num_labels]``)."""
        assert self.total is not None and self.rows > 0, "a pooled request finished without rows"
        if params.classify:
            assert self.head is not None, "a classifying request was admitted without its version's head"
            return self.head.logits((self.total / self.rows).to(torch.float32)).tolist()
        v = (self.total / self.rows).to(torch.float32)[: params.dimensions]  # [dims]
        if params.normalize:
            v = torch.nn.functional.normalize(v, dim=0)
        return v.tolist()


def rows_read(params: PoolingParams, start: int, num_tokens: int, prompt_len: int) -> range:
    """The positions of chunk ``[start, start + num_tokens)`` whose final hidden states the pool reads."""
    end = start + num_tokens
    if params.pooling_type == "mean":
        return range(start, end)
    if params.pooling_type == "cls":
        return range(0, 1) if start == 0 else range(0)
    return range(prompt_len - 1, prompt_len) if end == prompt_len else range(0)


@dataclass(frozen=True)
class PooledRow:
    """One pooled entry of a step: its index in the batch, its rows' span in the step's ``hidden``
    (``[first, end)``) and whether they replace its pool (a ``mean`` chunk at 0, any ``last`` / ``cls`` read)."""

    index: int
    first: int
    end: int
    restart: bool


@dataclass(frozen=True)
class PoolingPlan:
    """The rows a step reads for its pooled entries: ``rows [H]`` (flat batch rows, int64) and, per pooled
    entry, which of them are its."""

    rows: torch.Tensor  # [H] int64
    entries: tuple[PooledRow, ...]

    @classmethod
    def of(cls, chunks: Sequence[tuple[PoolingParams | None, int, int, int, int]]) -> PoolingPlan | None:
        """``chunks[i] = (pooling, start, num_tokens, prompt_len, width)`` per batch entry, in batch order (flat
        rows follow that order; ``width``: the entry's flat rows, more than ``num_tokens`` for a generation
        verifying draft tokens); None when no entry pools."""
        if all(pooling is None for pooling, *_ in chunks):
            return None
        rows: list[int] = []
        entries = []
        offset = 0
        for i, (pooling, start, n, prompt_len, width) in enumerate(chunks):
            if pooling is not None:
                read = rows_read(pooling, start, n, prompt_len)
                first = len(rows)
                rows += [offset + p - start for p in read]
                entries.append(PooledRow(i, first, len(rows), start == 0 or pooling.pooling_type != "mean"))
            offset += width
        return cls(torch.tensor(rows, dtype=torch.int64), tuple(entries))

    def nonfinite(self, hidden: torch.Tensor) -> set[int]:
        """Batch indices of pooled entries with a NaN or inf in the rows they read from ``hidden [H, hidden]``."""
        bad = ~torch.isfinite(hidden).all(dim=-1)  # [H]
        if not bool(bad.any()):
            return set()
        return {e.index for e in self.entries if bool(bad[e.first:e.end].any())}

    def accumulate(self, hidden: torch.Tensor, states: Sequence[PoolState | None]) -> None:
        """Fold each pooled entry's rows of ``hidden [H, hidden]`` into ``states[entry index]`` (None: skip it,
        e.g. a row that failed)."""
        for e in self.entries:
            state = states[e.index]
            if state is not None and e.end > e.first:
                state.add(hidden[e.first:e.end], e.restart)
