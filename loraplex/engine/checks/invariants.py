"""The engine's per-step invariant checks, run before every forward pass when ``EngineConfig.debug_checks``
is set (the tests turn them on; they cost a Python loop over the step's tokens and the cache's blocks).

- Right weights (design invariant 1): the slots each token's LoRA deltas read hold the adapter versions
  its request's plan asked for, at the plan's scales (float32, as the step holds them).
- Right K/V (invariants 3 and 6 for the prefix cache): every block a request reads was written under its
  adapter version (its whole LoRA plan: ``Request.kv_owner``) and, if keyed, sits at its own place in the
  request's chain; every block's reference count is the number of running requests holding it, and each
  block is free xor referenced xor cached.

Each raises ``AssertionError`` naming the first token or block that breaks it. And once per engine,
``keys_hold_all_kv_inputs`` decides whether prefix caching can be on at all for the model served.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from loraplex.adapters.manager import AdapterManager
from loraplex.engine.request import Request
from loraplex.engine.scheduler.block_manager import BlockManager
from loraplex.layers.rotary import RotaryEmbedding
from loraplex.ops.lora_batch import BatchMapping, LoRABatch

logger = logging.getLogger(__name__)


def check_right_weights(adapters: AdapterManager, mapping: BatchMapping, lora: LoRABatch | None) -> None:
    """Every token of ``mapping`` reads (through ``lora``'s passes of slot indices and scales) exactly its plan:
    the slot of each version it asked for at a non-zero scale, in plan order, at that scale, and nothing else."""
    passes = [] if lora is None else [lora, *lora.more]
    slots = [p.token_slots.tolist() for p in passes]
    scales = [None if p.token_scales is None else p.token_scales.tolist() for p in passes]
    for t, plan in enumerate(mapping.plans()):
        wanted = [(v, float(torch.tensor(c, dtype=torch.float32))) for v, c in plan if c != 0.0]
        read = []
        for k in range(len(passes)):
            if slots[k][t] >= 0:
                read.append((adapters.slot_owner(slots[k][t]), 1.0 if scales[k] is None else scales[k][t]))
        if read != wanted:
            raise AssertionError(f"token {t} asked for (adapter, scale) {wanted} but reads {read} (slot owners)")


def check_right_kv(blocks: BlockManager, running: Sequence[Request], scheduled: Sequence[Request]) -> None:
    """The block manager agrees with the ``running`` requests' block tables, and every ``scheduled`` request
    reads only blocks of its own version and chain."""
    blocks.check_integrity([r.block_table for r in running])
    for request in scheduled:
        blocks.check_sequence(request.block_table, request.block_keys, request.kv_owner,
                              request.base_blocks(blocks.block_size))


def keys_hold_all_kv_inputs(model: nn.Module, max_model_len: int) -> bool:
    """Whether a block key (``block_hash``: the tokens before the block and its own, their positions, the
    adapter version; the model is one per engine) holds everything the block's K/V depends on. Not when a
    rotary table depends on the sequence's length (dynamic NTK, LongRoPE) within the context served: then
    prefix caching stays off, with a warning."""
    limits = [m.length_dependent_above() for m in model.modules() if isinstance(m, RotaryEmbedding)]
    limit = min((x for x in limits if x is not None), default=None)
    if limit is not None and max_model_len > limit:
        logger.warning("prefix caching is off: this model's rotary embedding depends on the sequence length "
                       "past %d tokens (context %d)", limit, max_model_len)
        return False
    return True
