"""Paged KV cache: the ask-then-do block manager (reference counts, cached blocks, prefix keys) and the
cache tensors' layout and size."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.config import ModelConfig
from loraplex.engine.kv_cache import KVCache
from loraplex.engine.scheduler.block_hash import ROOT, block_key, extend_chain, version_tag
from loraplex.engine.scheduler.block_manager import BlockManager
from tests.fixtures import tiny_config


def test_allocate_until_exhausted_then_free() -> None:
    alloc = BlockManager(5)
    assert (alloc.num_total, alloc.num_free) == (5, 5)
    assert alloc.can_allocate(5) and not alloc.can_allocate(6)
    a = alloc.allocate(3, None)
    b = alloc.allocate(2, None)
    assert sorted(a + b) == [0, 1, 2, 3, 4]
    assert alloc.num_free == 0
    assert not alloc.can_allocate(1) and alloc.can_allocate(0)
    with pytest.raises(RuntimeError, match="0 of 5 free"):
        alloc.allocate(1, None)
    alloc.free(a)
    assert alloc.num_free == 3 and alloc.can_allocate(3) and not alloc.can_allocate(4)
    assert sorted(alloc.allocate(3, None)) == sorted(a)


def test_failed_allocate_changes_nothing() -> None:
    alloc = BlockManager(4)
    alloc.allocate(3, None)
    with pytest.raises(RuntimeError):
        alloc.allocate(2, None)
    assert alloc.num_free == 1
    assert len(alloc.allocate(1, None)) == 1


@pytest.mark.parametrize("bad", [[7], [0, 0], [-1], [2]])
def test_free_rejects_double_or_foreign_blocks_and_frees_nothing(bad: list[int]) -> None:
    alloc = BlockManager(4)
    held = alloc.allocate(2, None)  # blocks 0 and 1
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
        BlockManager(0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=40))
def test_allocator_matches_a_set_model(ops: list[tuple[bool, int]]) -> None:
    """Random allocate/free sequences: never hands out a held block, counts always agree."""
    alloc, held = BlockManager(10), []
    for is_alloc, n in ops:
        if is_alloc:
            assert alloc.can_allocate(n) == (n <= 10 - len(held))
            if alloc.can_allocate(n):
                got = alloc.allocate(n, None)
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


# ---- prefix caching: keys, cached blocks, eviction, pending keys ----

def chain(tokens: list[int], version: int | None, block_size: int = 2) -> list[bytes]:
    return extend_chain([], tokens, version, block_size)


def test_block_keys_hold_tokens_position_and_version() -> None:
    keys = chain([1, 2, 3, 4, 5], 7)
    assert len(keys) == 2 and all(len(k) == 32 for k in keys)  # the partial last block has no key
    assert chain([1, 2, 3, 4], 7) == keys == extend_chain(chain([1, 2, 3], 7), [1, 2, 3, 4], 7, 2)
    others = [chain([1, 2, 3, 4], 8), chain([1, 2, 3, 4], None), chain([1, 2, 4, 3], 7), chain([2, 1, 3, 4], 7)]
    assert all(o[1] != keys[1] for o in others)  # another version, the base, other tokens, another prefix
    assert chain([3, 4, 1, 2], 7)[1] != keys[0]  # the same tokens at another position
    assert version_tag(None) != version_tag(0) and block_key(ROOT, [5], None) != block_key(ROOT, [5], 0)
    assert block_key(ROOT, [1, 2], 3) != block_key(ROOT, [1], 2)  # fixed-width fields, no concatenation ambiguity


def test_released_blocks_stay_cached_and_are_matched_by_their_version_only() -> None:
    m = BlockManager(8, block_size=2)
    tokens = [5, 6, 7, 8, 9]
    table = m.allocate(3, 1)
    m.cache(table[:2], chain(tokens, 1))
    m.commit()
    m.free(table)
    assert (m.num_free, m.num_cached) == (8, 2)
    assert m.key_of(table[2]) is None and m.ref_count(table[0]) == 0
    hit = m.match(chain(tokens, 1), 1, 5)
    assert hit.blocks == tuple(table[:2]) and hit.hit_tokens == 4
    assert m.match(chain(tokens, 2), 2, 5).blocks == m.match(chain(tokens, None), None, 5).blocks == ()
    assert m.match(chain([5, 6, 0, 0], 1), 1, 4).blocks == (table[0],)  # longest common prefix
    assert m.can_allocate(6, hit) and not m.can_allocate(7, hit)  # the hit's 2 cached blocks are taken too
    with pytest.raises(ValueError, match="version"):
        m.allocate(1, 2, hit)
    again = m.allocate(1, 1, hit)
    assert again[:2] == table[:2] and m.ref_count(table[0]) == 1 and m.num_free == 5
    assert (m.totals.queried_tokens, m.totals.hit_tokens) == (5, 4)
    assert {v: (c.queried_tokens, c.hit_tokens) for v, c in m.counts_by_version().items()} == {1: (5, 4)}
    m.check_integrity()


def test_eviction_takes_the_least_recently_released_tail_first() -> None:
    m = BlockManager(4, block_size=2)
    a, b = m.allocate(2, None), m.allocate(2, None)
    m.cache(a, chain([1, 2, 3, 4], None))
    m.cache(b, chain([5, 6, 7, 8], None))
    m.commit()
    m.free(a)
    m.free(b)
    assert m.allocate(1, None) == [a[1]] and m.evictions == 1  # a's tail, released first
    assert m.match(chain([1, 2, 3, 4], None), None, 4).blocks == (a[0],)  # a's head is still there
    hit = m.match(chain([5, 6, 7, 8], None), None, 4)
    m.free(m.allocate(0, None, hit))  # touching b makes a's head the oldest
    assert m.allocate(1, None) == [a[0]]
    assert m.allocate(2, None) == [b[1], b[0]] and m.evictions == 4 and m.num_cached == 0
    m.check_integrity()


def test_retired_version_blocks_are_freed() -> None:
    """A dropped version (its last request ended) gives its cached blocks back at once; other versions' stay."""
    m = BlockManager(4, block_size=2)
    old, new = m.allocate(2, 1), m.allocate(2, 2)
    m.cache(old, chain([1, 2, 3, 4], 1))
    m.cache(new, chain([1, 2, 3, 4], 2))
    m.commit()
    m.free(new)
    with pytest.raises(ValueError, match="still has referenced KV blocks"):
        m.retire(1)  # a sequence of it still runs
    m.free(old)
    m.free(m.allocate(0, 1, m.match(chain([1, 2, 3, 4, 5], 1), 1, 5)))  # a lookup counted for version 1
    assert 1 in m.counts_by_version()
    m.retire(1)
    assert m.num_cached == 2 and m.match(chain([1, 2, 3, 4], 1), 1, 4).blocks == ()
    assert m.match(chain([1, 2, 3, 4], 2), 2, 4).blocks == tuple(new)
    assert 1 not in m.counts_by_version() and m.num_free == 4 and m.evictions == 0
    m.check_integrity()


def test_pending_keys_are_seen_in_their_step_and_forgotten_by_rollback() -> None:
    m = BlockManager(6, block_size=2)
    keys = chain([1, 2, 3, 4, 5], 3)
    first = m.allocate(3, 3)
    m.cache(first[:2], keys)
    sibling = m.match(keys, 3, 5)  # admitted later in the same step: shares the blocks being written
    assert sibling.blocks == tuple(first[:2])
    second = m.allocate(1, 3, sibling)
    assert [m.ref_count(b) for b in first[:2]] == [2, 2]
    m.rollback()  # the step failed: its K/V may be garbage
    assert m.match(keys, 3, 5).blocks == () and m.num_cached == 0
    m.free(second)
    m.free(first)
    assert m.num_free == 6 and m.num_cached == 0  # nothing stays cached
    m.check_integrity()


def test_a_duplicate_block_is_not_keyed_and_not_kept() -> None:
    m = BlockManager(4, block_size=2)
    keys = chain([1, 2], None)
    a, b = m.allocate(1, None), m.allocate(1, None)
    m.cache(a, keys)
    m.cache(b, keys)  # computed twice in one step: the first block keeps the key
    m.commit()
    assert m.key_of(b[0]) is None and m.num_cached == 1
    m.free(b)
    m.free(a)
    assert m.num_cached == 1 and m.match(keys, None, 3).blocks == tuple(a)
    with pytest.raises(ValueError, match="not allocated"):
        m.cache(b, keys)


def test_checks_catch_foreign_kv() -> None:
    m = BlockManager(4, block_size=2)
    keys = chain([1, 2, 3, 4], 1)
    table = m.allocate(2, 1)
    m.cache(table, keys)
    m.check_sequence(table, keys, 1)
    with pytest.raises(AssertionError, match="version 1"):
        m.check_sequence(table, keys, 2)
    with pytest.raises(AssertionError, match="other contents"):
        m.check_sequence(table[::-1], keys, 1)


def test_caching_off_keeps_nothing() -> None:
    m = BlockManager(4, block_size=2, enable_caching=False)
    keys = chain([1, 2, 3, 4], None)
    table = m.allocate(2, None, m.match(keys, None, 4))
    m.cache(table, keys)
    m.commit()
    assert m.num_cached == 0 and m.match(keys, None, 4).blocks == () and m.totals.queried_tokens == 0
    m.free(table)
    assert m.num_free == 4
    m.check_integrity()


def test_integrity_check_compares_references_with_the_tables() -> None:
    m = BlockManager(4, block_size=2)
    a = m.allocate(2, None)
    b = m.allocate(0, None, m.match([], None, 1)) + m.allocate(1, None)
    m.check_integrity([a, b])
    with pytest.raises(AssertionError, match="references"):
        m.check_integrity([a])  # b's block is referenced by no table: a leak
    with pytest.raises(AssertionError, match="references"):
        m.check_integrity([a, b, a[:1]])  # a table holds a block without a reference
