"""Attention over a flat ragged batch and a paged KV cache.

The runner builds one ``AttentionMetadata`` per step; every layer reuses it. Entries that compute
one token (decodes, and one-token prompts) are batched into a single SDPA call per layer: each
gathers its whole context from the flat cache through a padded index ``[S_d, max_ctx]``, and a
length mask hides the padding. Entries with several tokens (prefills or prefill chunks) each get
their own causal SDPA call: a fresh prompt (start 0) attends to its own new K/V directly, a chunk
that continues a sequence gathers its context from the cache with an offset causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PrefillSpan:
    """One multi-token entry: rows ``rows`` of the flat batch, positions ``start_pos ..``."""

    rows: slice
    start_pos: int
    context_slots: torch.Tensor | None  # [ctx] int64 cache slots of positions [0, ctx); None if start 0
    mask: torch.Tensor | None  # [n, ctx] bool, True = attend (key pos <= query pos); None if start 0


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs for one step, shared by all layers."""

    slot_mapping: torch.Tensor  # [T] int64 flat cache slot each new token's K/V is written to
    seq_lens: torch.Tensor  # [T] int64 length of the token's sequence after this step
    decode_rows: slice | torch.Tensor | None  # rows of the S_d one-token entries (slice if contiguous)
    decode_slots: torch.Tensor | None  # [S_d * max_ctx] int64 context slots, padded with slot 0
    decode_mask: torch.Tensor | None  # [S_d, 1, 1, max_ctx] bool, True = real context position
    prefills: tuple[PrefillSpan, ...]
    num_tokens: int

    @property
    def all_decode(self) -> bool:
        """True when every row is a one-token entry, in order (pure decode step)."""
        return not self.prefills and isinstance(self.decode_rows, slice)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attn: AttentionMetadata,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend.

    Semantics: ``k_cache[slot_mapping[t]] = k[t]`` (same for v); then for each token t of a
    sequence, ``out[t, h] = softmax(q[t, h] . K_ctx^T / sqrt(d)) V_ctx`` over the sequence's keys at
    positions ``<= pos(t)``, K/V head ``h // (H / KV)`` (GQA).
    Shapes: q ``[T, H, d]``, k/v ``[T, KV, d]``, caches ``[slots, KV, d]`` (changed in place)
    -> ``[T, H, d]``.
    """
    t, heads, d = q.shape
    kv_heads = k.shape[1]
    k_cache.index_copy_(0, attn.slot_mapping, k)
    v_cache.index_copy_(0, attn.slot_mapping, v)
    decoded = None
    if attn.decode_rows is not None:
        q_d = q[attn.decode_rows] if isinstance(attn.decode_rows, slice) else q.index_select(0, attn.decode_rows)
        s_d = q_d.shape[0]
        k_d = k_cache.index_select(0, attn.decode_slots).view(s_d, -1, kv_heads, d).transpose(1, 2)
        v_d = v_cache.index_select(0, attn.decode_slots).view(s_d, -1, kv_heads, d).transpose(1, 2)
        decoded = F.scaled_dot_product_attention(  # [S_d, H, 1, d]
            q_d.unsqueeze(2), k_d, v_d, attn_mask=attn.decode_mask, enable_gqa=True
        ).view(s_d, heads, d)
        if attn.all_decode:
            return decoded
    out = q.new_empty(t, heads, d)  # [T, H, d]
    if decoded is not None:
        if isinstance(attn.decode_rows, slice):
            out[attn.decode_rows] = decoded
        else:
            out.index_copy_(0, attn.decode_rows, decoded)
    for span in attn.prefills:
        q_p = q[span.rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
        if span.context_slots is None:
            k_p = k[span.rows].transpose(0, 1).unsqueeze(0)  # [1, KV, n, d]
            v_p = v[span.rows].transpose(0, 1).unsqueeze(0)
            o_p = F.scaled_dot_product_attention(q_p, k_p, v_p, is_causal=True, enable_gqa=True)
        else:
            k_p = k_cache.index_select(0, span.context_slots).transpose(0, 1).unsqueeze(0)  # [1, KV, ctx, d]
            v_p = v_cache.index_select(0, span.context_slots).transpose(0, 1).unsqueeze(0)
            o_p = F.scaled_dot_product_attention(q_p, k_p, v_p, attn_mask=span.mask, enable_gqa=True)
        out[span.rows] = o_p[0].transpose(0, 1)
    return out
