"""Paged KV cache: the ask-then-do block allocator and the cache tensors' layout and size."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.config import ModelConfig
from loraplex.engine.kv_cache import BlockAllocator, KVCache
from tests.fixtures import tiny_config


def test_allocate_until_exhausted_then_free() -> None:
    alloc = BlockAllocator(5)
    assert (alloc.num_total, alloc.num_free) == (5, 5)
    assert alloc.can_allocate(5) and not alloc.can_allocate(6)
    a = alloc.allocate(3)
    b = alloc.allocate(2)
    assert sorted(a + b) == [0, 1, 2, 3, 4]
    assert alloc.num_free == 0
    assert not alloc.can_allocate(1) and alloc.can_allocate(0)
    with pytest.raises(RuntimeError, match="0 of 5 free"):
        alloc.allocate(1)
    alloc.free(a)
    assert alloc.num_free == 3 and alloc.can_allocate(3) and not alloc.can_allocate(4)
    assert sorted(alloc.allocate(3)) == sorted(a)


def test_failed_allocate_changes_nothing() -> None:
    alloc = BlockAllocator(4)
    alloc.allocate(3)
    with pytest.raises(RuntimeError):
        alloc.allocate(2)
    assert alloc.num_free == 1
    assert len(alloc.allocate(1)) == 1


@pytest.mark.parametrize("bad", [[7], [0, 0], [-1], [2]])
def test_free_rejects_double_or_foreign_blocks_and_frees_nothing(bad: list[int]) -> None:
    alloc = BlockAllocator(4)
    held = alloc.allocate(2)  # blocks 0 and 1
    assert sorted(held) == [0, 1]
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free([held[1]] + bad)
    assert alloc.num_free == 2  # held[1] was not freed by the failed call
    alloc.free(held)
    with pytest.raises(ValueError, match="double free"):
        alloc.free([held[0]])
    assert alloc.num_free == 4


def test_rejects_empty_pool() -> None:
    with pytest.raises(ValueError):
        BlockAllocator(0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=40))
def test_allocator_matches_a_set_model(ops: list[tuple[bool, int]]) -> None:
    """Random allocate/free sequences: never hands out a held block, counts always agree."""
    alloc, held = BlockAllocator(10), []
    for is_alloc, n in ops:
        if is_alloc:
            assert alloc.can_allocate(n) == (n <= 10 - len(held))
            if alloc.can_allocate(n):
                got = alloc.allocate(n)
                assert not set(got) & set(held) and len(set(got)) == n
                held.extend(got)
        elif held:
            give_back, held = held[: n % (len(held) + 1)], held[n % (len(held) + 1):]
            alloc.free(give_back)
        assert alloc.num_free == 10 - len(held)


def test_cache_layout_and_size() -> None:
    cfg = ModelConfig.from_hf(tiny_config("llama").to_dict())
    kv = KVCache(cfg, num_blocks=6, block_size=4, dtype=torch.float32, device="cpu")
    assert len(kv.kv) == cfg.num_layers
    for t in kv.kv:
        assert t.shape == (6, 2, cfg.num_kv_heads, 4, cfg.head_dim) and t.dtype == torch.float32
    per_block = KVCache.bytes_per_block(cfg, 4, torch.float32)
    assert per_block * 6 == kv.nbytes
    assert per_block == 2 * cfg.num_layers * 4 * cfg.num_kv_heads * cfg.head_dim * 4
    assert KVCache.bytes_per_block(cfg, 4, torch.bfloat16) * 2 == per_block
