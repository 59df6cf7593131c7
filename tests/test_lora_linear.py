"""LoRALinear: packed projections with stacked slots equal separate per-projection layers."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from loraplex.layers.lora_linear import LoRALinear
from loraplex.ops.lora import add_lora
from loraplex.ops.lora_batch import LORA_METHODS, BatchMapping, build_lora_batch

NAMES, OUTS, IN = ("q_proj", "k_proj", "v_proj"), (32, 16, 16), 40
Pairs = dict[str, tuple[torch.Tensor, torch.Tensor]]


def random_pairs(ranks: dict[str, int], gen: torch.Generator) -> Pairs:
    outs = dict(zip(NAMES, OUTS, strict=True))
    return {n: (torch.randn(r, IN, generator=gen) / IN**0.5, torch.randn(outs[n], r, generator=gen) * 0.3)
            for n, r in ranks.items()}


def make_layer(max_loras: int = 4, max_rank: int = 8, bias: bool = False, seed: int = 0,
               dtype: torch.dtype = torch.float32) -> LoRALinear:
    gen = torch.Generator().manual_seed(seed)
    layer = LoRALinear(IN, OUTS, NAMES, max_loras, max_rank, bias=bias, dtype=dtype)
    layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) / IN**0.5)
    if bias:
        layer.bias.copy_(torch.randn(layer.bias.shape, generator=gen))
    return layer


def reference(layer: LoRALinear, x: torch.Tensor, adapters: dict[int, Pairs], token_slots: list[int]) -> torch.Tensor:
    """Float64, per projection and per token: ``x W_p^T + b_p + B_p (A_p x)`` for each projection p."""
    w, xd = layer.weight.double(), x.double()
    bias = layer.bias.double() if layer.bias is not None else torch.zeros(w.shape[0], dtype=torch.float64)
    parts = []
    for i, name in enumerate(NAMES):
        lo, hi = layer.out_offsets[i], layer.out_offsets[i + 1]
        out = xd @ w[lo:hi].t() + bias[lo:hi]
        for t, s in enumerate(token_slots):
            if s >= 0 and name in adapters[s]:
                a, b = adapters[s][name]
                out[t] += b.double() @ (a.double() @ xd[t])
        parts.append(out)
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize("bias", [False, True])
def test_packed_qkv_equals_separate_projections(bias: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    layer = make_layer(bias=bias)
    adapters = {
        0: random_pairs({"q_proj": 8, "k_proj": 2, "v_proj": 5}, gen),  # different rank per projection
        1: random_pairs({"q_proj": 3, "v_proj": 7}, gen),  # k_proj not targeted
        3: random_pairs({"k_proj": 1}, gen),
    }
    for slot, pairs in adapters.items():
        layer.set_slot(slot, pairs)
    assert layer.slot_ranks == [15, 10, 0, 1]
    seqs = [(0, 5), (None, 3), (1, 1), (3, 20), (0, 1), (1, 17), (None, 1)]
    batch = build_lora_batch(BatchMapping.from_sequences(seqs), {0: 0, 1: 1, 3: 3}, 0)
    x = torch.randn(batch.num_tokens, IN, generator=gen)
    expected = reference(layer, x, adapters, batch.token_slots.tolist())
    with torch.no_grad():
        out = layer(x, batch)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    for method in LORA_METHODS:  # every method through the layer's own buffers and blocks
        y = F.linear(x, layer.weight, layer.bias)
        add_lora(y, x, layer.lora_a, layer.lora_b, layer.slot_ranks, batch, slot_blocks=layer.slot_blocks,
                 method=method)
        torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)


def test_no_lora_is_the_base_linear() -> None:
    layer = make_layer(bias=True)
    layer.set_slot(0, random_pairs({"q_proj": 4}, torch.Generator().manual_seed(2)))
    x = torch.randn(6, IN)
    base = F.linear(x, layer.weight, layer.bias)
    assert torch.equal(layer(x, None), base)
    none_batch = build_lora_batch(BatchMapping.from_sequences([(None, 6)]), {}, 0)
    assert torch.equal(layer(x, none_batch), base)


def test_clear_slot_gives_exactly_zero_delta() -> None:
    gen = torch.Generator().manual_seed(3)
    layer = make_layer()
    layer.set_slot(2, random_pairs({"q_proj": 8, "k_proj": 8, "v_proj": 8}, gen))
    batch = build_lora_batch(BatchMapping.from_sequences([(9, 4), (9, 1), (9, 30)]), {9: 2}, 0)
    x = torch.randn(batch.num_tokens, IN, generator=gen)
    assert not torch.equal(layer(x, batch), F.linear(x, layer.weight))
    layer.clear_slot(2)
    assert layer.slot_ranks[2] == 0
    assert torch.equal(layer(x, batch), F.linear(x, layer.weight))
    assert not layer.lora_a[2].any() and not layer.lora_b[2].any()


def test_overwriting_a_slot_leaves_nothing_of_the_old_adapter() -> None:
    gen = torch.Generator().manual_seed(4)
    layer, fresh = make_layer(), make_layer()
    small = random_pairs({"v_proj": 2}, gen)
    layer.set_slot(1, random_pairs({"q_proj": 8, "k_proj": 8, "v_proj": 8}, gen))
    layer.set_slot(1, small)
    fresh.set_slot(1, small)
    assert torch.equal(layer.lora_a, fresh.lora_a) and torch.equal(layer.lora_b, fresh.lora_b)
    assert layer.slot_ranks == fresh.slot_ranks and layer.slot_blocks == fresh.slot_blocks


def test_a_sequence_of_overwrites_equals_fresh_writes() -> None:
    """A write zeroes only the previous adapter's entries it does not overwrite: after any sequence of
    adapters (same blocks, larger or smaller ranks, other projections), the slot equals a fresh write."""
    gen = torch.Generator().manual_seed(6)
    rng = torch.Generator().manual_seed(7)
    layer = make_layer()
    for _ in range(12):
        names = [n for n in ("q_proj", "k_proj", "v_proj") if torch.rand(1, generator=rng) < 0.7] or ["k_proj"]
        pairs = random_pairs({n: int(torch.randint(1, 9, (1,), generator=rng)) for n in names}, gen)
        layer.set_slot(1, pairs)
        fresh = make_layer()
        fresh.set_slot(1, pairs)
        assert torch.equal(layer.lora_a, fresh.lora_a) and torch.equal(layer.lora_b, fresh.lora_b)
        assert layer.slot_ranks == fresh.slot_ranks and layer.slot_blocks == fresh.slot_blocks


def test_bfloat16_layer() -> None:
    gen = torch.Generator().manual_seed(5)
    layer = make_layer(dtype=torch.bfloat16, bias=True)
    adapters = {0: random_pairs({"q_proj": 4, "v_proj": 6}, gen), 1: random_pairs({"k_proj": 3}, gen)}
    for slot, pairs in adapters.items():
        layer.set_slot(slot, pairs)
    batch = build_lora_batch(BatchMapping.from_sequences([(0, 3), (1, 1), (None, 2), (0, 20)]), {0: 0, 1: 1}, 0)
    x = torch.randn(batch.num_tokens, IN, generator=gen).bfloat16()
    out = layer(x, batch)
    assert out.dtype == torch.bfloat16
    bf16_adapters = {s: {n: (a.bfloat16(), b.bfloat16()) for n, (a, b) in p.items()} for s, p in adapters.items()}
    expected = reference(layer, x, bf16_adapters, batch.token_slots.tolist())
    torch.testing.assert_close(out.double(), expected, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("seq_len", [1, 24])  # padded (decode-like) and segments (prefill-like) views
def test_memoised_views_follow_slot_writes_and_dtype_moves(seq_len: int) -> None:
    gen = torch.Generator().manual_seed(6)
    layer = make_layer()
    first = {0: random_pairs({"q_proj": 2, "k_proj": 2, "v_proj": 2}, gen),
             1: random_pairs({"q_proj": 2, "k_proj": 2, "v_proj": 2}, gen)}
    for slot, pairs in first.items():
        layer.set_slot(slot, pairs)
    batch = build_lora_batch(BatchMapping.from_sequences([(0, seq_len), (1, seq_len)] * 4), {0: 0, 1: 1}, 0)
    x = torch.randn(batch.num_tokens, IN, generator=gen)
    layer(x, batch)  # fills the layer's memo for this batch
    second = {0: first[0], 1: random_pairs({"q_proj": 8, "v_proj": 3}, gen)}  # new ranks and blocks
    layer.set_slot(1, second[1])
    expected = reference(layer, x, second, batch.token_slots.tolist())
    torch.testing.assert_close(layer(x, batch).double(), expected, rtol=1e-5, atol=1e-5)
    layer.double()  # new buffers: no view of the old ones may survive
    layer.lora_b[1].mul_(2.0)
    doubled = {0: second[0], 1: {n: (a, 2.0 * b) for n, (a, b) in second[1].items()}}
    expected = reference(layer, x.double(), doubled, batch.token_slots.tolist())
    torch.testing.assert_close(layer(x.double(), batch), expected, rtol=1e-9, atol=1e-9)
