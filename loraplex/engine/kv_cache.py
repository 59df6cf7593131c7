"""Paged KV cache: fixed-size blocks of token slots, handed out by an ask-then-do allocator.

A sequence owns a *block table* (a list of physical block numbers); the K/V of its token at
position ``p`` live in block ``block_table[p // block_size]`` at offset ``p % block_size`` of every
layer's cache tensor. Blocks need not be contiguous or ordered.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from loraplex.config import ModelConfig
from loraplex.layers.attention import kv_cache_shape


class BlockAllocator:
    """Hands out physical block numbers ``0 .. num_blocks-1``.

    Contract: ask first (``can_allocate``), then commit (``allocate``); allocating more blocks than
    are free is a programming error and raises without changing anything. ``free`` rejects a block
    that is not currently allocated (double free, out of range) before freeing any of the batch.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"BlockAllocator needs at least one block, got {num_blocks}")
        self._num_total = num_blocks
        # Popping from the end hands out low block numbers first (deterministic layouts in tests).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._allocated = [False] * num_blocks

    @property
    def num_total(self) -> int:
        return self._num_total

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks. Raises ``RuntimeError`` if ``can_allocate(n)`` is false."""
        if not self.can_allocate(n):
            raise RuntimeError(f"cannot allocate {n} KV blocks: {len(self._free)} of {self._num_total} free")
        blocks = [self._free.pop() for _ in range(n)]
        for b in blocks:
            self._allocated[b] = True
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        """Return ``blocks``. Raises ``ValueError`` (freeing nothing) on a block that is not allocated."""
        blocks = list(blocks)
        seen: set[int] = set()
        for b in blocks:
            if not (0 <= b < self._num_total) or not self._allocated[b] or b in seen:
                raise ValueError(f"KV block {b} is not allocated (double free or foreign block)")
            seen.add(b)
        for b in blocks:
            self._allocated[b] = False
            self._free.append(b)


class KVCache:
    """One tensor per layer, ``kv[layer]`` in the layout of ``loraplex.layers.attention.kv_cache_shape``;
    the model reads and writes them through ``paged_attention``."""

    def __init__(
        self,
        model_config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KVCache needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = kv_cache_shape(num_blocks, model_config.num_kv_heads, block_size, model_config.head_dim)
        self.kv = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model_config.num_layers)]

    @staticmethod
    def bytes_per_block(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block costs over all layers, K and V together."""
        elem = torch.empty((), dtype=dtype).element_size()
        per_layer = math.prod(kv_cache_shape(1, model_config.num_kv_heads, block_size, model_config.head_dim))
        return model_config.num_layers * per_layer * elem

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv)
