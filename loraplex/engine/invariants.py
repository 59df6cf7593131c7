"""The engine's per-step invariant checks, run before every forward pass when ``EngineConfig.debug_checks``
is set (the tests turn them on; they cost a Python loop over the step's tokens and the cache's blocks).

- Right weights (design invariant 1): the slot each token's LoRA delta reads holds the adapter version
  its request asked for.
- Right K/V (invariants 3 and 6 for the prefix cache): every block a request reads was written under its
  adapter version and, if keyed, sits at its own place in the request's chain; every block's reference
  count is the number of running requests holding it, and each block is free xor referenced xor cached.

Each raises ``AssertionError`` naming the first token or block that breaks it. And once per engine,
``keys_hold_all_kv_inputs`` decides whether prefix caching can be on at all for the model served.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from torch import nn

from loraplex.adapters.manager import AdapterManager
from loraplex.engine.request import Request
from loraplex.engine.scheduler.block_manager import BlockManager
from loraplex.layers.rotary import RotaryEmbedding
from loraplex.ops.lora_batch import BatchMapping, LoRABatch

logger = logging.getLogger(__name__)


def check_right_weights(adapters: AdapterManager, mapping: BatchMapping, lora: LoRABatch | None) -> None:
    """Every token of ``mapping`` reads (through ``lora``'s slot indices) the slot of the version it asked for."""
    slots = lora.token_slots.tolist() if lora is not None else [-1] * len(mapping.token_version_ids)
    for t, (wanted, slot) in enumerate(zip(mapping.token_version_ids, slots, strict=True)):
        held = None if slot < 0 else adapters.slot_owner(slot)
        if held != wanted:
            raise AssertionError(f"token {t} asked for adapter {wanted} but reads slot {slot} holding {held}")


def check_right_kv(blocks: BlockManager, running: Sequence[Request], scheduled: Sequence[Request]) -> None:
    """The block manager agrees with the ``running`` requests' block tables, and every ``scheduled`` request
    reads only blocks of its own version and chain."""
    blocks.check_integrity([r.block_table for r in running])
    for request in scheduled:
        blocks.check_sequence(request.block_table, request.block_keys, request.version_id)


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
