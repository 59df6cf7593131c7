"""Model runner: one step over a flat ragged batch of entries and the paged KV cache.

Each ``StepEntry`` is the work of one sequence this step: a prompt (or a chunk of one) or one
decode token. The runner concatenates the entries' tokens in order (the order the LoRA mapping
must follow), builds the step's ``AttentionMetadata`` once with a handful of vectorised tensor ops
(no per-token Python loops; one ``ContextPlan`` per distinct attention window of the model's layers),
runs the model, and returns the logits of each entry's last token (or of all its tokens, for an entry
that asks: prompt logprobs).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loraplex.config import ModelConfig
from loraplex.engine.kv_cache import KVCache
from loraplex.layers.attention import AttentionMetadata, ContextPlan, DecodeKeys, PrefillSpan, block_rows
from loraplex.ops.lora_batch import LoRABatch


@dataclass(frozen=True)
class StepEntry:
    """One sequence's work in a step."""

    token_ids: tuple[int, ...]  # tokens computed this step (a prompt chunk, or one decode token)
    start_pos: int  # position of token_ids[0]
    block_table: tuple[int, ...]  # physical blocks covering positions [0, start_pos + len(token_ids))
    all_logits: bool = False  # logits of every token (prompt logprobs), not just the last one
    pooled: bool = False  # a pooling request's chunk: no logits (its final hidden states are read instead)

    @property
    def num_logits(self) -> int:
        if self.pooled:
            return 0
        return len(self.token_ids) if self.all_logits else 1


@dataclass(frozen=True)
class StepInputs:
    """The model's inputs for one step, built by ``prepare_step``."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    logits_rows: torch.Tensor  # [R] int64: each entry's last token's row, or all its rows (all_logits)
    attn: AttentionMetadata


def _validate(entries: Sequence[StepEntry], block_size: int, vocab_size: int) -> list[int]:
    """Check every entry; return the tokens of the flat batch."""
    if not entries:
        raise ValueError("a step needs at least one entry")
    for i, e in enumerate(entries):
        n = len(e.token_ids)
        if n == 0 or e.start_pos < 0:
            raise ValueError(f"entry {i}: needs >= 1 token and start_pos >= 0 (got {n}, {e.start_pos})")
        if len(e.block_table) * block_size < e.start_pos + n:
            raise ValueError(f"entry {i}: {len(e.block_table)} blocks of {block_size} cannot hold "
                             f"{e.start_pos + n} positions")
    flat = list(itertools.chain.from_iterable(e.token_ids for e in entries))
    if min(flat) < 0 or max(flat) >= vocab_size:
        raise ValueError(f"token ids must lie in [0, {vocab_size})")
    return flat


def _decode_keys(decode: list[int], tables: torch.Tensor, starts: list[int], block_size: int, kv_heads: int,
                 window: int | None, dtype: torch.dtype, device: torch.device) -> DecodeKeys:
    """The keys the one-token entries ``decode`` read under ``window``: positions from the first one the
    window reaches (0 when full) to the new token's."""
    end = torch.tensor([starts[i] + 1 for i in decode])  # [S_d] context length incl. the new token
    first = (end - window).clamp(min=0) if window is not None else torch.zeros_like(end)  # [S_d]
    return DecodeKeys(tables[decode], first, end, block_size, kv_heads, dtype, device)


def _prefill_span(rows: slice, start: int, table: torch.Tensor, block_size: int, kv_heads: int,
                  window: int | None, device: torch.device) -> PrefillSpan:
    """A multi-token entry; one that continues a sequence gets the context rows its window reaches and
    an offset mask, a fresh one longer than its window a windowed mask."""
    n = rows.stop - rows.start
    if start == 0 and (window is None or n <= window):
        return PrefillSpan(rows, 0, None, None)
    q_pos = start + torch.arange(n)  # [n]
    context_rows = None
    first_block = 0
    if start > 0:
        first_block = max(0, start - window + 1) // block_size if window is not None else 0
        last_block = -(-(start + n) // block_size)
        context_rows = block_rows(table[first_block:last_block], kv_heads).flatten().to(device)  # [2*KV*blocks]
    k_pos = first_block * block_size + torch.arange(start + n - first_block * block_size)  # [ctx]
    mask = k_pos[None, :] <= q_pos[:, None]  # [n, ctx]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return PrefillSpan(rows, start, context_rows, mask.to(device))


def _context_plan(window: int | None, lens: list[int], starts: list[int], cu: list[int], decode: list[int],
                  tables: torch.Tensor, block_size: int, kv_heads: int, dtype: torch.dtype,
                  device: torch.device) -> ContextPlan:
    keys = _decode_keys(decode, tables, starts, block_size, kv_heads, window, dtype, device) if decode else None
    prefills = tuple(_prefill_span(slice(cu[i], cu[i + 1]), starts[i], tables[i], block_size, kv_heads, window,
                                   device) for i, n in enumerate(lens) if n > 1)
    return ContextPlan(window, keys, prefills)


def prepare_step(entries: Sequence[StepEntry], block_size: int, model_config: ModelConfig, dtype: torch.dtype,
                 device: torch.device, vocab_size: int | None = None) -> StepInputs:
    """Validate ``entries`` (token ids below ``vocab_size``, default the model's) and build the step's flat
    inputs and attention metadata."""
    flat = _validate(entries, block_size, vocab_size or model_config.vocab_size)
    lens = [len(e.token_ids) for e in entries]
    starts = [e.start_pos for e in entries]
    cu = list(itertools.accumulate(lens, initial=0))  # [S + 1] row offsets
    max_blocks = max(len(e.block_table) for e in entries)
    tables = torch.tensor([list(e.block_table) + [0] * (max_blocks - len(e.block_table)) for e in entries],
                          dtype=torch.int64)  # [S, max_blocks], padded with block 0
    starts_t, lens_t, cu_t = (torch.tensor(x, dtype=torch.int64) for x in (starts, lens, cu))
    entry_of = torch.repeat_interleave(torch.arange(len(entries)), lens_t)  # [T]
    positions = torch.arange(len(flat)) - cu_t[entry_of] + starts_t[entry_of]  # [T]
    kv_heads = model_config.num_kv_heads
    blocks = tables[entry_of, positions // block_size]  # [T]
    # token rows of the cache viewed as [blocks * 2 * KV * block_size, d], ordered [2, T, KV]
    write_rows = block_rows(blocks[:, None], kv_heads)[..., 0] * block_size + (positions % block_size)[:, None]

    decode = [i for i, n in enumerate(lens) if n == 1]
    decode_rows = None
    if decode:
        rows = [cu[i] for i in decode]
        contiguous = rows[-1] - rows[0] == len(rows) - 1
        decode_rows = slice(rows[0], rows[-1] + 1) if contiguous else torch.tensor(rows, device=device)
    plans = {window: _context_plan(window, lens, starts, cu, decode, tables, block_size, kv_heads, dtype, device)
             for window in model_config.attention_windows()}
    attn = AttentionMetadata(
        write_rows=write_rows.flatten().to(device),
        seq_lens=(starts_t + lens_t)[entry_of].to(device),
        decode_rows=decode_rows,
        plans=plans,
        num_tokens=len(flat),
    )
    logits_rows = cu_t[1:] - 1  # [S]
    if any(e.all_logits or e.pooled for e in entries):
        logits_rows = torch.tensor([r for i, e in enumerate(entries) for r in (
            () if e.pooled else range(cu[i], cu[i + 1]) if e.all_logits else (cu[i + 1] - 1,))], dtype=torch.int64)
    return StepInputs(
        input_ids=torch.tensor(flat, dtype=torch.int64).to(device),
        positions=positions.to(device),
        logits_rows=logits_rows.to(device),
        attn=attn,
    )


class ModelRunner:
    """Runs steps of ``model`` against ``kv_cache``; not thread-safe (the engine's step loop owns it)."""

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, block_size: int) -> None:
        if block_size != kv_cache.block_size:
            raise ValueError(f"runner block_size {block_size} != KV cache block_size {kv_cache.block_size}")
        model.pack_dense()  # the runner only runs inference: base weights go to the GEMM library's layout
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = model.embed_tokens.weight.device
        self.dtype = model.embed_tokens.weight.dtype
        self._lora_on_device: tuple[LoRABatch, LoRABatch] | None = None  # (as given, on self.device)

    @torch.inference_mode()
    def execute(self, entries: Sequence[StepEntry], lora: LoRABatch | None) -> torch.Tensor:
        """Float32 logits ``[sum(e.num_logits), vocab]``: each entry's last token, or every token of an entry
        with ``all_logits``, in entry order; writes the entries' K/V into the cache. ``lora`` (if any) must
        list the tokens in the same flat order as ``entries``."""
        step, lora = self._prepare(entries, lora)
        return self.model(step.input_ids, step.positions, step.attn, self.kv_cache.kv, lora, step.logits_rows)

    @torch.inference_mode()
    def execute_pooled(self, entries: Sequence[StepEntry], lora: LoRABatch | None,
                       hidden_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``execute``'s logits (``pooled`` entries have none), and the float32 final hidden states (after the
        final norm, before ``lm_head``) of the flat rows ``hidden_rows [H]``: ``[H, hidden]``."""
        step, lora = self._prepare(entries, lora)
        return self.model.forward_hidden(step.input_ids, step.positions, step.attn, self.kv_cache.kv, lora,
                                         step.logits_rows, hidden_rows.to(self.device))

    def _prepare(self, entries: Sequence[StepEntry], lora: LoRABatch | None) -> tuple[StepInputs, LoRABatch | None]:
        step = prepare_step(entries, self.block_size, self.model.config, self.dtype, self.device,
                            self.model.served_vocab_size)  # adapters may add tokens
        if lora is not None and lora.num_tokens != step.attn.num_tokens:
            raise ValueError(f"LoRA batch has {lora.num_tokens} tokens, the step has {step.attn.num_tokens}")
        if lora is not None:  # memoised on the batch object, so a repeated batch keeps its plan on the device
            if self._lora_on_device is None or self._lora_on_device[0] is not lora:
                self._lora_on_device = (lora, lora.to(self.device))
            lora = self._lora_on_device[1]
        return step, lora
