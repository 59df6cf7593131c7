"""A fresh prompt's causal attention, run in query chunks (``CAUSAL_CHUNK``), against a float64 oracle."""

from __future__ import annotations

import pytest
import torch

from loraplex.config import ModelConfig
from loraplex.engine.runner import StepEntry, prepare_step
from loraplex.layers import attention
from loraplex.layers.attention import paged_attention
from tests.fixtures import tiny_config


@pytest.mark.parametrize("n", [attention.CAUSAL_CHUNK, 2 * attention.CAUSAL_CHUNK + 9])
def test_chunked_causal_prefill_matches_float64(n: int) -> None:
    """One fresh n-token prompt next to a decode (GQA, 3 query heads per K/V head): every query row sees
    exactly the keys at or before its position, across chunk edges (n not a multiple of the chunk)."""
    cfg = ModelConfig.from_hf(tiny_config("llama", hidden_size=48, num_attention_heads=6,
                                          num_key_value_heads=2).to_dict())
    heads, kv_heads, d, bs = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 16
    blocks = -(-n // bs)
    entries = [StepEntry((1,) * n, 0, tuple(range(blocks))), StepEntry((1,), 0, (blocks,))]
    step = prepare_step(entries, bs, cfg, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    t = n + 1
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (heads, kv_heads, kv_heads))
    cache = torch.zeros(blocks + 1, 2, kv_heads, bs, d)
    out = paged_attention(q, k, v, cache, step.attn)  # [T, H, d]
    kd, vd = k[:n].double().repeat_interleave(3, 1), v[:n].double().repeat_interleave(3, 1)  # [n, H, d]
    scores = torch.einsum("qhd,khd->hqk", q[:n].double(), kd) * d**-0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    expect = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vd)
    torch.testing.assert_close(out[:n].double(), expect, rtol=0, atol=1e-5)
    torch.testing.assert_close(out[n].double(), v[n].double().repeat_interleave(3, 0), rtol=0, atol=1e-5)
