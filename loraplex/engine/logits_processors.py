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

from loraplex.engine.sampling_params import SamplingParams


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

    def sync(self, output: Sequence[int]) -> None:
        new = self.prompt_len + len(output)
        if new > self._buf.numel():
            grown = torch.empty(2 * new, dtype=torch.int64)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        if new > self._len:
            self._buf[self._len : new] = torch.tensor(list(output[self._len - self.prompt_len :]), dtype=torch.int64)
        self._len = new

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


def _flat(rows: Sequence[int], parts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row [N], token [N])``: each part's tokens tagged with its batch row."""
    lengths = torch.tensor([p.numel() for p in parts])
    return torch.repeat_interleave(torch.tensor(rows), lengths), torch.cat(parts)


def _per_pair(values: Sequence[float], parts: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Each row's value repeated once per token of its part: ``[N]``."""
    return torch.repeat_interleave(torch.tensor(values, dtype=dtype), torch.tensor([p.numel() for p in parts]))


def apply_logits_processors(logits: torch.Tensor, rows: Sequence[ProcessedRow], eos_token_ids: Collection[int]) -> None:
    """Apply every row's penalties, bias and ``min_tokens`` mask to ``logits`` in place.

    Semantics, for each row i with params p and seen tokens (prompt + generated) S_i, generated G_i:
      for t in set(S_i): logits[i, t] = logits[i, t] / r if logits[i, t] > 0 else logits[i, t] * r
                         (r = p.repetition_penalty; HF's RepetitionPenaltyLogitsProcessor);
      logits[i, t] -= p.frequency_penalty * count(t in G_i) + p.presence_penalty * (t in G_i);
      logits[i, t] += p.logit_bias[t];
      logits[i, t] = -inf for t in p.stop_token_ids (and EOS unless ignore_eos) while |G_i| < p.min_tokens.
    Shapes: logits [S, vocab] float; ``rows`` has S entries.
    """
    active = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if not active:
        return
    dtype = logits.dtype
    rep = [i for i in active if rows[i].params.repetition_penalty != 1.0]
    if rep:
        parts = [_state(rows[i]).all_tokens() for i in rep]
        row, tok = _flat(rep, parts)
        penalty = _per_pair([rows[i].params.repetition_penalty for i in rep], parts, dtype)
        seen = logits[row, tok]  # duplicates read and write the same value: each token is penalised once
        logits[row, tok] = torch.where(seen > 0, seen / penalty, seen * penalty)
    counted = [i for i in active if rows[i].params.presence_penalty or rows[i].params.frequency_penalty]
    if counted:
        parts = [_state(rows[i]).output_tokens() for i in counted]
        row, tok = _flat(counted, parts)
        frequency = _per_pair([rows[i].params.frequency_penalty for i in counted], parts, dtype)
        logits.index_put_((row, tok), -frequency, accumulate=True)  # once per occurrence
        presence = _per_pair([rows[i].params.presence_penalty for i in counted], parts, dtype)
        logits[row, tok] = logits[row, tok] - presence  # once per distinct token (duplicates write one value)
    biased = [i for i in active if rows[i].params.logit_bias]
    if biased:
        parts, values = [], []
        for i in biased:
            history = _state(rows[i])
            if history.bias_ids is None:
                bias = rows[i].params.logit_bias
                history.bias_ids = torch.tensor(list(bias), dtype=torch.int64)
                history.bias_values = torch.tensor(list(bias.values()), dtype=torch.float32)
            parts.append(history.bias_ids)
            values.append(history.bias_values)
        row, tok = _flat(biased, parts)
        logits.index_put_((row, tok), torch.cat(values).to(dtype), accumulate=True)
    short = [i for i in active if len(rows[i].output_token_ids) < rows[i].params.min_tokens]
    if short:
        parts = [torch.tensor(sorted(_stop_ids(rows[i].params, eos_token_ids)), dtype=torch.int64) for i in short]
        row, tok = _flat(short, parts)
        logits[row, tok] = float("-inf")


def _stop_ids(params: SamplingParams, eos_token_ids: Collection[int]) -> set[int]:
    """The ids ``min_tokens`` masks: the request's stop ids, and EOS unless it ignores EOS."""
    return set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
