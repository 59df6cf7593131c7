"""``KVCache``: the paged KV cache's tensors, one per layer in the layout that
``loraplex.layers.attention.kv_cache_shape`` writes down, indexed by the block tables that the
scheduler's ``BlockManager`` (``engine/scheduler/block_manager.py``) hands out."""

from __future__ import annotations

import math

import torch

from loraplex.config import ModelConfig
from loraplex.layers.attention import kv_cache_shape


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
