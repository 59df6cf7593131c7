"""Logits processors: penalties, logit bias and ``min_tokens``, applied per row, vectorised over the batch.

Each processor touches only the rows that use it, with one set of flat index ops for all of them (a
row's seen tokens, its bias entries, its masked ids are concatenated; ``row`` says whose they are):
its cost grows with the number of (row, token) pairs involved, never with ``rows x vocab``, and a
batch where no row uses a processor does no work here at all.

Order (vLLM's): repetition penalty -> presence and frequency penalties -> logit bias -> min_tokens mask.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

import torch

from loraplex.engine.sampling.params import SamplingParams


class ProcessorState:
    """The tensors the processors keep for one request across steps: its prompt and generated token ids
    as one growing int64 tensor, kept in step with its (append-only) output list (each step copies only
    the tokens appended since the previous one), and its ``logit_bias`` as tensors."""

    def __init__(self, prompt: Sequence[int]) -> None:
        self.prompt_len = len(prompt)
        self._buf = torch.empty(max(16, 2 * len(prompt)), dtype=torch.int64)  # [capacity]
        self._buf[: self.prompt_len] = torch.tensor(list(prompt), dtype=torch.int64)
        self._len = self.prompt_len
        self.bias_ids: torch.Tensor | None = None  # [B] logit_bias keys, built once
        self.bias_values: torch.Tensor | None = None  # [B] float32
        self._stop_ids: torch.Tensor | None = None  # [M] the ids min_tokens masks, built once

    def sync(self, output: Sequence[int]) -> None:
        new = self.prompt_len + len(output)
        if new > self._buf.numel():
            grown = torch.empty(2 * new, dtype=torch.int64)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        if new == self._len + 1:  # the usual step: one token
            self._buf[self._len] = output[-1]
        elif new > self._len:
            self._buf[self._len : new] = torch.tensor(list(output[self._len - self.prompt_len :]), dtype=torch.int64)
        self._len = new

    def stop_ids(self, params: SamplingParams, eos_token_ids: Collection[int]) -> torch.Tensor:
        """The ids ``min_tokens`` masks: the request's stop ids, and EOS unless it ignores EOS."""
        if self._stop_ids is None:
            ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
            self._stop_ids = torch.tensor(sorted(ids), dtype=torch.int64)
        return self._stop_ids

    def all_tokens(self) -> torch.Tensor:
        return self._buf[: self._len]  # [P + O]

    def output_tokens(self) -> torch.Tensor:
        return self._buf[self.prompt_len : self._len]  # [O]


class ProcessedRow(Protocol):
    """What the processors read of a request (``engine.request.Request`` provides it)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    processor_state: ProcessorState | None


def _state(row: ProcessedRow) -> ProcessorState:
    if row.processor_state is None:
        row.processor_state = ProcessorState(row.prompt_token_ids)
    row.processor_state.sync(row.output_token_ids)
    return row.processor_state


def _flat(rows: Sequence[int], parts: Sequence[torch.Tensor], vocab: int, values: Sequence[float] | None = None,
          dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(index [N], value [N] | None)``: each part's tokens as indices into the flattened ``[S * vocab]``
    logits of its batch row (and that row's value per token). Only serial kernels touch these few
    thousand elements (index_select / scatter_ / index_add_ / index_fill_, index tensors built from
    Python lists): torch parallelises advanced indexing and repeat_interleave even at this size, which
    costs tens of milliseconds on a busy host."""
    lengths = [p.numel() for p in parts]
    offsets = torch.tensor([r * vocab for r, n in zip(rows, lengths, strict=True) for _ in range(n)], dtype=torch.int64)
    value = None
    if values is not None:
        value = torch.tensor([v for v, n in zip(values, lengths, strict=True) for _ in range(n)], dtype=dtype)
    return offsets + torch.cat(list(parts)), value


def apply_logits_processors(logits: torch.Tensor, rows: Sequence[ProcessedRow], eos_token_ids: Collection[int]) -> None:
    """Apply every row's penalties, bias and ``min_tokens`` mask to ``logits`` in place.

    Semantics, for each row i with params p and seen tokens (prompt + generated) S_i, generated G_i:
      for t in set(S_i): logits[i, t] = logits[i, t] / r if logits[i, t] > 0 else logits[i, t] * r
                         (r = p.repetition_penalty; HF's RepetitionPenaltyLogitsProcessor);
      logits[i, t] -= p.frequency_penalty * count(t in G_i) + p.presence_penalty * (t in G_i);
      logits[i, t] += p.logit_bias[t];
      logits[i, t] = -inf for t in p.stop_token_ids (and EOS unless ignore_eos) while |G_i| < p.min_tokens.
    Shapes: logits [S, vocab] float, contiguous; ``rows`` has S entries.
    """
    active = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if not active:
        return
    if not logits.is_contiguous():
        raise ValueError("logits must be contiguous")
    flat, vocab, dtype = logits.view(-1), logits.shape[-1], logits.dtype  # [S * vocab]
    rep = [i for i in active if rows[i].params.repetition_penalty != 1.0]
    if rep:
        parts = [_state(rows[i]).all_tokens() for i in rep]
        index, penalty = _flat(rep, parts, vocab, [rows[i].params.repetition_penalty for i in rep], dtype)
        seen = flat.index_select(0, index)  # duplicates read and write the same value: penalised once
        flat.scatter_(0, index, torch.where(seen > 0, seen / penalty, seen * penalty))
    counted = [i for i in active if rows[i].params.presence_penalty or rows[i].params.frequency_penalty]
    if counted:
        parts = [_state(rows[i]).output_tokens() for i in counted]
        index, frequency = _flat(counted, parts, vocab, [-rows[i].params.frequency_penalty for i in counted], dtype)
        flat.index_add_(0, index, frequency)  # once per occurrence
        presence = _flat(counted, parts, vocab, [rows[i].params.presence_penalty for i in counted], dtype)[1]
        flat.scatter_(0, index, flat.index_select(0, index) - presence)  # once per distinct token
    biased = [i for i in active if rows[i].params.logit_bias]
    if biased:
        parts, values = [], []
        for i in biased:
            state = _state(rows[i])
            if state.bias_ids is None:
                bias = rows[i].params.logit_bias
                state.bias_ids = torch.tensor(list(bias), dtype=torch.int64)
                state.bias_values = torch.tensor(list(bias.values()), dtype=torch.float32)
            parts.append(state.bias_ids)
            values.append(state.bias_values)
        index, _ = _flat(biased, parts, vocab)
        flat.index_add_(0, index, torch.cat(values).to(dtype))
    short = [i for i in active if len(rows[i].output_token_ids) < rows[i].params.min_tokens]
    if short:
        parts = [_state(rows[i]).stop_ids(rows[i].params, eos_token_ids) for i in short]
        flat.index_fill_(0, _flat(short, parts, vocab)[0], float("-inf"))


