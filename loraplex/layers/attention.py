"""Attention over a flat ragged batch and a paged KV cache, full or sliding-window.

The cache of a layer is ``[num_blocks, 2 (K, V), KV, block_size, d]``; row indices below refer to
two flat views of it: *token rows* ``[num_blocks * 2 * KV * block_size, d]`` (one position of one
head) and *block rows* ``[num_blocks * 2 * KV, block_size * d]`` (one head's whole block).

The runner builds one ``AttentionMetadata`` per step; every layer reuses it. It holds one
``ContextPlan`` per distinct attention window of the model's layers (``None`` = full attention; a
window W lets position p see keys at positions ``(p - W, p]``), so a sliding layer reads only the
blocks its window overlaps. Entries that compute one token (decodes, and one-token prompts) are
batched into one attention per layer. On a CPU with the step kernels (``loraplex.ops.cpu_kernels``,
float32) it reads each sequence's K/V blocks in place, with no copy; elsewhere a single index op
gathers every such sequence's K and V block rows, already head-major, padded to the longest, then two
batched GEMMs do GQA attention with the G = H / KV query heads of a K/V head as the rows of one small
GEMM (each K/V row is read once), and an additive 0/-inf bias hides the padding and what lies outside
the window. Entries with several tokens (prefills or prefill chunks) each get their own SDPA call: a
fresh prompt (start 0) attends to its own new K/V directly (causal, in query chunks that read only the
keys they can see; or with a windowed mask once it is longer than the window), a chunk that continues
a sequence gathers its context's block rows with an offset (and windowed) mask.

Soft-capped attention (Gemma 2; ``softcap`` set) computes ``scores = tanh(scale * q.k / cap) * cap``
before the mask, as HF's eager attention does: SDPA and the CPU kernels cannot, so its one-token entries
take the gather path and its multi-token entries one eager attention each.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch
import torch.nn.functional as F

from loraplex.layers.softcap import soft_cap
from loraplex.ops import cpu_kernels


def kv_cache_shape(num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int) -> tuple[int, ...]:
    """The one place the paged KV layout is written: one tensor per layer of this shape,
    ``[num_blocks, 2 (K, V), KV, block_size, d]`` (block-major; within a block each K/V head's
    positions are contiguous, so a context is gathered in rows of ``block_size * d``)."""
    return (num_blocks, 2, num_kv_heads, block_size, head_dim)


@dataclass(frozen=True)
class PrefillSpan:
    """One multi-token entry: rows ``rows`` of the flat batch, positions ``start_pos ..``."""

    rows: slice
    start_pos: int
    # [2 * KV * blocks] block rows of the context from the first block the window reaches, ordered
    # (K/V, head, block); None when the entry attends only to its own new K/V (start 0)
    context_rows: torch.Tensor | None
    # [n, ctx] bool, True = attend (key in the query's window and not after it); None = plain causal
    mask: torch.Tensor | None


def block_rows(tables: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Block rows of each (K/V, head, block): ``tables [..., n]`` -> ``[2, ..., KV, n]`` with
    ``row = (block * 2 + kv) * KV + head`` (the cache viewed as ``[blocks * 2 * KV, block_size * d]``)."""
    base = tables.unsqueeze(-2) * 2  # [..., 1, n]
    return torch.stack((base, base + 1)) * kv_heads + torch.arange(kv_heads, device=tables.device)[:, None]


@dataclass(frozen=True)
class DecodeKeys:
    """The cached keys the one-token entries read under one window: sequence s reads positions
    ``[first[s], end[s])`` through its block table. Index tensors live on the CPU (the kernels read them
    there); the gather path's rows and bias are derived once, on first use, on ``device``."""

    block_tables: torch.Tensor  # [S_d, max_blocks] int64 physical block of each logical one (padding: 0)
    first: torch.Tensor  # [S_d] int64 first key position inside the window
    end: torch.Tensor  # [S_d] int64 the new token's position + 1
    block_size: int
    kv_heads: int
    dtype: torch.dtype
    device: torch.device

    @cached_property
    def gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows, bias)``: block rows ``[2 * S_d * KV * blocks]`` ordered (K/V, sequence, head, block) from
        each sequence's first block in the window (padding blocks: arbitrary valid ones), and the additive
        bias ``[S_d * KV, 1, blocks * block_size]`` (0 = attend, -inf = padding or outside the window)."""
        bs, seqs = self.block_size, self.first.shape[0]
        lo = self.first // bs  # [S_d] first block read
        num_blocks = int(((self.end - 1) // bs - lo).max()) + 1
        block_idx = (lo[:, None] + torch.arange(num_blocks)).clamp(max=self.block_tables.shape[1] - 1)
        rows = block_rows(self.block_tables.gather(1, block_idx), self.kv_heads)  # [2, S_d, KV, blocks]
        pos = lo[:, None] * bs + torch.arange(num_blocks * bs)  # [S_d, blocks * bs] key positions
        hidden = (pos >= self.end[:, None]) | (pos < self.first[:, None])
        bias = torch.zeros(seqs, self.kv_heads, 1, pos.shape[1], dtype=self.dtype)
        bias.masked_fill_(hidden[:, None, None, :], float("-inf"))
        return rows.flatten().to(self.device), bias.view(seqs * self.kv_heads, 1, -1).to(self.device)


@dataclass(frozen=True)
class ContextPlan:
    """Which cached keys the step's queries read under one attention window (None = full)."""

    window: int | None
    decode: DecodeKeys | None  # the one-token entries' keys (None when there are none)
    prefills: tuple[PrefillSpan, ...]


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs for one step, shared by all layers."""

    write_rows: torch.Tensor  # [2 * T * KV] token rows the new K/V go to, ordered (K/V, token, head)
    seq_lens: torch.Tensor  # [T] int64 length of the token's sequence after this step
    decode_rows: slice | torch.Tensor | None  # rows of the S_d one-token entries (slice if contiguous)
    plans: Mapping[int | None, ContextPlan]  # one per distinct window of the model's layers
    num_tokens: int

    @property
    def all_decode(self) -> bool:
        """True when every row is a one-token entry, in order (pure decode step)."""
        rows = self.decode_rows
        return isinstance(rows, slice) and rows.start == 0 and rows.stop == self.num_tokens

    def plan(self, window: int | None) -> ContextPlan:
        if window not in self.plans:
            raise ValueError(f"no attention plan for window {window}; the step was built for {list(self.plans)}")
        return self.plans[window]


def _decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, keys: DecodeKeys, scale: float,
                      softcap: float | None = None) -> torch.Tensor:
    """One-token entries: ``q [S_d, H, d]`` -> ``[S_d, H, d]``.

    Semantics, per sequence s and K/V head k with query heads ``g = k*G .. k*G+G-1``:
    ``scores = scale * q[s, g] @ K[s, k]^T`` (then ``tanh(scores / softcap) * softcap`` when given),
    ``out[s, g] = softmax(scores) @ V[s, k]``, over the keys at positions ``[keys.first[s], keys.end[s])``:
    read in place by the CPU kernel (not soft-capped), else gathered (``keys.gather``: padded to the
    longest, the bias hiding the padding).
    """
    kernels = cpu_kernels.for_tensors(q, kv_cache) if softcap is None else None
    if kernels is not None:
        return kernels.paged_decode_attention(q, kv_cache, keys.block_tables, keys.first, keys.end, scale)
    s_d, heads, d = q.shape
    kv_heads, block_size = kv_cache.shape[2], kv_cache.shape[3]
    rows, bias = keys.gather
    kv = kv_cache.view(-1, block_size * d).index_select(0, rows).view(2, s_d * kv_heads, -1, d)
    q_g = q.reshape(s_d * kv_heads, heads // kv_heads, d)
    if softcap is None:
        scores = torch.baddbmm(bias, q_g, kv[0].transpose(1, 2), alpha=scale)  # [S_d * KV, G, max_ctx]
    else:
        scores = soft_cap(torch.bmm(q_g, kv[0].transpose(1, 2)) * scale, softcap) + bias
    return torch.bmm(scores.softmax(-1), kv[1]).view(s_d, heads, d)


def _eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                     softcap: float) -> torch.Tensor:
    """Soft-capped attention of one entry, HF's eager order: ``q [1, H, n, d]``, ``k/v [1, KV, m, d]``, ``mask``
    ``[n, m]`` bool (True = attend; None = causal, the n queries being the last n of the m keys) ->
    ``[1, H, n, d]``. Semantics: ``softmax(tanh(scale * q k^T / softcap) * softcap + mask_bias) v`` (K/V head
    ``h // (H / KV)``)."""
    n, m = q.shape[2], k.shape[2]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = soft_cap(torch.matmul(q, k.transpose(2, 3)) * scale, softcap)  # [1, H, n, m]
    if mask is None:
        mask = torch.arange(m, device=q.device)[None, :] <= torch.arange(m - n, m, device=q.device)[:, None]
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1, dtype=torch.float32).to(q.dtype), v)


# A fresh prompt's causal attention runs in query chunks of this many rows, chunk i reading only the keys up
# to its last query: PyTorch's CPU flash kernel skips masked key blocks only at 512-key granularity, so
# one causal call over n <= 512 tokens computes all n^2 scores; chunks compute ~(n^2 / 2 + 32 n).
CAUSAL_CHUNK = 64


@lru_cache(maxsize=8)
def _causal_chunks(n: int, dtype: torch.dtype, device: torch.device) -> tuple[tuple[int, int, torch.Tensor], ...]:
    """``(start, end, bias [end - start, end])`` per query chunk of an n-token causal attention: an additive
    mask of ``dtype``, 0 where the key position <= the query position, -inf after it (SDPA would turn a
    bool mask into this on every call)."""
    chunks = []
    for start in range(0, n, CAUSAL_CHUNK):
        end = min(start + CAUSAL_CHUNK, n)
        hidden = torch.arange(end)[None, :] > torch.arange(start, end)[:, None]
        bias = torch.zeros(end - start, end, dtype=dtype).masked_fill_(hidden, float("-inf"))
        chunks.append((start, end, bias.to(device)))
    return tuple(chunks)


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """A fresh prompt attending to its own keys, causally: ``q [1, H, n, d]``, ``k/v [1, KV, n, d]`` ->
    ``[1, H, n, d]``, chunked over the queries (``CAUSAL_CHUNK``)."""
    n = q.shape[2]
    if n <= CAUSAL_CHUNK:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    out = q.new_empty(q.shape)
    for start, end, bias in _causal_chunks(n, q.dtype, q.device):
        out[:, :, start:end] = F.scaled_dot_product_attention(q[:, :, start:end], k[:, :, :end], v[:, :, :end],
                                                              attn_mask=bias, scale=scale, enable_gqa=True)
    return out


def _context_attention(q: torch.Tensor, kv_cache: torch.Tensor, span: PrefillSpan, scale: float,
                       softcap: float | None = None) -> torch.Tensor:
    """A chunk continuing a sequence: ``q [1, H, n, d]`` attends to its gathered context under ``span.mask``."""
    kv_heads, block_size, d = kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4]
    ctx = span.mask.shape[1]
    kv = kv_cache.view(-1, block_size * d).index_select(0, span.context_rows).view(2, 1, kv_heads, -1, d)
    if softcap is not None:
        return _eager_attention(q, kv[0, :, :, :ctx], kv[1, :, :, :ctx], span.mask, scale, softcap)
    return F.scaled_dot_product_attention(q, kv[0, :, :, :ctx], kv[1, :, :, :ctx], attn_mask=span.mask,
                                          scale=scale, enable_gqa=True)


def fused_decode_attention(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, kv_cache: torch.Tensor,
                           attn: AttentionMetadata, heads: int, window: int | None = None,
                           scale: float | None = None) -> torch.Tensor | None:
    """A pure decode step on the CPU in one kernel: ``qkv [T, (H + 2 KV) d]`` (the packed projection's
    output) -> ``[T, H * d]``, equal to rotary on q and k (``apply_rotary``), then ``paged_attention``, then
    a reshape. None (nothing done) where that kernel does not apply: the caller runs those steps."""
    if not (attn.all_decode and cos.is_contiguous() and signed_sin.is_contiguous()):
        return None
    kernels = cpu_kernels.for_tensors(qkv, kv_cache, cos, signed_sin)
    if kernels is None:
        return None
    keys = attn.plan(window).decode
    d = kv_cache.shape[-1]
    return kernels.decode_attention_qkv(qkv, cos, signed_sin, kv_cache, keys.block_tables, keys.first, keys.end,
                                        d**-0.5 if scale is None else scale, heads)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    attn: AttentionMetadata,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend.

    Semantics: ``cache_token_rows[write_rows] = stack(k, v)``; then for each token t of a sequence,
    ``out[t, h] = softmax(c(scale * q[t, h] . K_ctx^T)) V_ctx`` over the sequence's keys at positions p with
    ``pos(t) - window < p <= pos(t)`` (no lower bound when ``window`` is None), K/V head ``h // (H / KV)``
    (GQA); ``scale`` defaults to ``1 / sqrt(d)``; ``c(s) = tanh(s / softcap) * softcap`` when ``softcap`` is
    given, else ``c(s) = s``. ``attn`` must hold a plan for ``window``.
    Shapes: q ``[T, H, d]``, k/v ``[T, KV, d]``, kv_cache ``[blocks, 2, KV, block_size, d]`` (changed in
    place) -> ``[T, H, d]``.
    """
    t, heads, d = q.shape
    scale = d**-0.5 if scale is None else scale
    plan = attn.plan(window)
    kernels = cpu_kernels.for_tensors(q, kv_cache) if attn.all_decode and softcap is None else None
    if kernels is not None:  # a decode step on the CPU: the kernel writes each new K/V row, then attends
        keys = plan.decode
        return kernels.paged_decode_attention(q, kv_cache, keys.block_tables, keys.first, keys.end, scale, k, v)
    kv_cache.view(-1, d).index_copy_(0, attn.write_rows, torch.stack((k, v)).view(-1, d))
    decoded = None
    if attn.decode_rows is not None:
        q_d = q[attn.decode_rows] if isinstance(attn.decode_rows, slice) else q.index_select(0, attn.decode_rows)
        decoded = _decode_attention(q_d, kv_cache, plan.decode, scale, softcap)
        if attn.all_decode:
            return decoded
    out = q.new_empty(t, heads, d)  # [T, H, d]
    if decoded is not None:
        if isinstance(attn.decode_rows, slice):
            out[attn.decode_rows] = decoded
        else:
            out.index_copy_(0, attn.decode_rows, decoded)
    for span in plan.prefills:
        q_p = q[span.rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
        if span.context_rows is None:
            k_p = k[span.rows].transpose(0, 1).unsqueeze(0)  # [1, KV, n, d]
            v_p = v[span.rows].transpose(0, 1).unsqueeze(0)
            if softcap is not None:
                o_p = _eager_attention(q_p, k_p, v_p, span.mask, scale, softcap)
            elif span.mask is None:
                o_p = _causal_attention(q_p, k_p, v_p, scale)
            else:
                o_p = F.scaled_dot_product_attention(q_p, k_p, v_p, attn_mask=span.mask, scale=scale, enable_gqa=True)
        else:
            o_p = _context_attention(q_p, kv_cache, span, scale, softcap)
        out[span.rows] = o_p[0].transpose(0, 1)
    return out
