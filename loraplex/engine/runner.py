"""Model runner: one step over a flat ragged batch of entries and the paged KV cache.

Each ``StepEntry`` is the work of one sequence this step: a prompt (or a chunk of one) or one
decode token. The runner concatenates the entries' tokens in order (the order the LoRA mapping
must follow), builds the step's ``AttentionMetadata`` once with a handful of vectorised tensor ops
(no per-token Python loops), runs the model, and returns the logits of each entry's last token.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loraplex.adapters.batch_indices import LoRABatch
from loraplex.config import ModelConfig
from loraplex.engine.kv_cache import KVCache
from loraplex.models.attention import AttentionMetadata, PrefillSpan


@dataclass(frozen=True)
class StepEntry:
    token_ids: tuple[int, ...]  # tokens computed this step (a prompt chunk, or one decode token)
    start_pos: int  # position of token_ids[0]
    block_table: tuple[int, ...]  # physical blocks covering positions [0, start_pos + len(token_ids))


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    logits_rows: torch.Tensor  # [S] int64 row of each entry's last token
    attn: AttentionMetadata


def _cache_slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat cache slot of each position: ``block_table[..., p // bs] * bs + p % bs`` (broadcasting)."""
    return torch.gather(block_table, -1, positions // block_size) * block_size + positions % block_size


def prepare_step(entries: Sequence[StepEntry], block_size: int, model_config: ModelConfig, dtype: torch.dtype,
                 device: torch.device) -> StepInputs:
    """Validate ``entries`` and build the step's flat inputs and attention metadata."""
    vocab_size, kv_heads = model_config.vocab_size, model_config.num_kv_heads
    if not entries:
        raise ValueError("a step needs at least one entry")
    lens = [len(e.token_ids) for e in entries]
    for i, e in enumerate(entries):
        if lens[i] == 0 or e.start_pos < 0:
            raise ValueError(f"entry {i}: needs >= 1 token and start_pos >= 0 (got {lens[i]}, {e.start_pos})")
        if len(e.block_table) * block_size < e.start_pos + lens[i]:
            raise ValueError(f"entry {i}: {len(e.block_table)} blocks of {block_size} cannot hold "
                             f"{e.start_pos + lens[i]} positions")
    flat = list(itertools.chain.from_iterable(e.token_ids for e in entries))
    if min(flat) < 0 or max(flat) >= vocab_size:
        raise ValueError(f"token ids must lie in [0, {vocab_size})")
    num_tokens, max_blocks = len(flat), max(len(e.block_table) for e in entries)
    cu = list(itertools.accumulate(lens, initial=0))  # [S + 1] row offsets
    tables = torch.tensor([list(e.block_table) + [0] * (max_blocks - len(e.block_table)) for e in entries],
                          dtype=torch.int64)  # [S, max_blocks], padded with block 0
    starts = torch.tensor([e.start_pos for e in entries], dtype=torch.int64)  # [S]
    lens_t = torch.tensor(lens, dtype=torch.int64)  # [S]
    cu_t = torch.tensor(cu, dtype=torch.int64)  # [S + 1]
    entry_of = torch.repeat_interleave(torch.arange(len(entries)), lens_t)  # [T]
    positions = torch.arange(num_tokens) - cu_t[entry_of] + starts[entry_of]  # [T]
    slot_mapping = _cache_slots(tables[entry_of], positions[:, None], block_size)[:, 0]  # [T]

    decode = [i for i, n in enumerate(lens) if n == 1]
    decode_rows = decode_kv_rows = decode_bias = None
    if decode:
        rows = [cu[i] for i in decode]
        contiguous = rows[-1] - rows[0] == len(rows) - 1
        decode_rows = slice(rows[0], rows[-1] + 1) if contiguous else torch.tensor(rows, device=device)
        idx = torch.tensor(decode, dtype=torch.int64)
        ctx = starts[idx] + 1  # [S_d]
        j = torch.arange(int(ctx.max()))  # [max_ctx]
        # [S_d, max_ctx]; past a sequence's length the slots are arbitrary valid ones, hidden by the bias
        slots = _cache_slots(tables[idx], j.expand(len(decode), -1), block_size)
        # rows of the [slots * 2 * KV, d] cache view, ordered [2 (K, V), S_d, KV, max_ctx]
        kv_rows = (slots[None, :, None, :] * (2 * kv_heads) + torch.arange(2)[:, None, None, None] * kv_heads
                   + torch.arange(kv_heads)[None, None, :, None])
        decode_kv_rows = kv_rows.flatten().to(device)
        pad = (j[None, :] >= ctx[:, None])[:, None, None, :].expand(-1, kv_heads, 1, -1)  # [S_d, KV, 1, max_ctx]
        decode_bias = torch.zeros(pad.shape, dtype=dtype).masked_fill_(pad, float("-inf"))
        decode_bias = decode_bias.view(len(decode) * kv_heads, 1, -1).to(device)
    prefills = []
    for i, n in enumerate(lens):
        if n == 1:
            continue
        start = entries[i].start_pos
        span = PrefillSpan(slice(cu[i], cu[i + 1]), start, None, None)
        if start > 0:
            j = torch.arange(start + n)  # [ctx]
            span = PrefillSpan(
                span.rows, start, _cache_slots(tables[i], j, block_size).to(device),
                (j[None, :] <= (start + torch.arange(n))[:, None]).to(device),  # [n, ctx]
            )
        prefills.append(span)
    attn = AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        seq_lens=(starts + lens_t)[entry_of].to(device),
        decode_rows=decode_rows,
        decode_kv_rows=decode_kv_rows,
        decode_bias=decode_bias,
        prefills=tuple(prefills),
        num_tokens=num_tokens,
    )
    return StepInputs(
        input_ids=torch.tensor(flat, dtype=torch.int64).to(device),
        positions=positions.to(device),
        logits_rows=(cu_t[1:] - 1).to(device),
        attn=attn,
    )


class ModelRunner:
    """Runs steps of ``model`` against ``kv_cache``; not thread-safe (the engine's step loop owns it)."""

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, block_size: int) -> None:
        if block_size != kv_cache.block_size:
            raise ValueError(f"runner block_size {block_size} != KV cache block_size {kv_cache.block_size}")
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = model.embed_tokens.weight.device
        self.dtype = model.embed_tokens.weight.dtype

    @torch.inference_mode()
    def execute(self, entries: Sequence[StepEntry], lora: LoRABatch | None) -> torch.Tensor:
        """Logits ``[len(entries), vocab]`` float32 of each entry's last token; writes the entries' K/V
        into the cache. ``lora`` (if any) must list the tokens in the same flat order as ``entries``."""
        step = prepare_step(entries, self.block_size, self.model.config, self.dtype, self.device)
        if lora is not None and lora.num_tokens != step.attn.num_tokens:
            raise ValueError(f"LoRA batch has {lora.num_tokens} tokens, the step has {step.attn.num_tokens}")
        return self.model(step.input_ids, step.positions, step.attn, self.kv_cache, lora, step.logits_rows)
