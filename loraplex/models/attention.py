"""Attention over a flat ragged batch and a paged KV cache.

The runner builds one ``AttentionMetadata`` per step; every layer reuses it. Entries that compute
one token (decodes, and one-token prompts) are batched into one attention per layer: a single
index op gathers every such sequence's K and V, head-major, through a padded row index
``[2, S_d, KV, max_ctx]`` into the layer's cache, then two batched GEMMs do GQA attention with the
G = H / KV query heads of a K/V head as the rows of one small GEMM (each K/V row is read once) and
an additive 0/-inf bias hides the padding. Entries with several tokens (prefills or prefill chunks)
each get their own causal SDPA call: a fresh prompt (start 0) attends to its own new K/V directly,
a chunk that continues a sequence gathers its context from the cache with an offset causal mask.
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
    # [2 * S_d * KV * max_ctx] int64 rows of the layer cache viewed as [slots * 2 * KV, d], in the
    # order (K or V, sequence, K/V head, context position); padding points at arbitrary valid rows
    decode_kv_rows: torch.Tensor | None
    decode_bias: torch.Tensor | None  # [S_d * KV, 1, max_ctx] 0 for real context, -inf for padding
    prefills: tuple[PrefillSpan, ...]
    num_tokens: int

    @property
    def all_decode(self) -> bool:
        """True when every row is a one-token entry, in order (pure decode step)."""
        return not self.prefills and isinstance(self.decode_rows, slice)


def _decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, attn: AttentionMetadata,
                      kv_heads: int) -> torch.Tensor:
    """One-token entries: ``q [S_d, H, d]`` -> ``[S_d, H, d]``.

    Semantics, per sequence s and K/V head k with query heads ``g = k*G .. k*G+G-1``:
    ``scores = q[s, g] @ K[s, k]^T / sqrt(d) + bias[s, k]``, ``out[s, g] = softmax(scores) @ V[s, k]``,
    with K/V ``[max_ctx, d]`` gathered by ``attn.decode_kv_rows``.
    """
    s_d, heads, d = q.shape
    max_ctx = attn.decode_bias.shape[-1]
    kv = kv_cache.view(-1, d).index_select(0, attn.decode_kv_rows).view(2, s_d * kv_heads, max_ctx, d)
    scores = torch.baddbmm(  # [S_d * KV, G, max_ctx]
        attn.decode_bias, q.reshape(s_d * kv_heads, heads // kv_heads, d), kv[0].transpose(1, 2), alpha=d**-0.5
    )
    return torch.bmm(scores.softmax(-1), kv[1]).view(s_d, heads, d)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    attn: AttentionMetadata,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend.

    Semantics: ``kv_cache[slot_mapping[t], 0] = k[t]``, ``kv_cache[slot_mapping[t], 1] = v[t]``; then
    for each token t of a sequence, ``out[t, h] = softmax(q[t, h] . K_ctx^T / sqrt(d)) V_ctx`` over the
    sequence's keys at positions ``<= pos(t)``, K/V head ``h // (H / KV)`` (GQA).
    Shapes: q ``[T, H, d]``, k/v ``[T, KV, d]``, kv_cache ``[slots, 2, KV, d]`` (changed in place)
    -> ``[T, H, d]``.
    """
    t, heads, d = q.shape
    kv_heads = k.shape[1]
    kv_cache[:, 0].index_copy_(0, attn.slot_mapping, k)
    kv_cache[:, 1].index_copy_(0, attn.slot_mapping, v)
    decoded = None
    if attn.decode_rows is not None:
        q_d = q[attn.decode_rows] if isinstance(attn.decode_rows, slice) else q.index_select(0, attn.decode_rows)
        decoded = _decode_attention(q_d, kv_cache, attn, kv_heads)
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
            ctx = kv_cache.index_select(0, span.context_slots)  # [ctx, 2, KV, d]
            k_p = ctx[:, 0].transpose(0, 1).unsqueeze(0)  # [1, KV, ctx, d]
            v_p = ctx[:, 1].transpose(0, 1).unsqueeze(0)
            o_p = F.scaled_dot_product_attention(q_p, k_p, v_p, attn_mask=span.mask, enable_gqa=True)
        out[span.rows] = o_p[0].transpose(0, 1)
    return out
