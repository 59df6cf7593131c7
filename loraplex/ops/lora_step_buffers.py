"""CUDA-graph-ready LoRA state: fixed-capacity per-step index buffers and device slot tables.

A captured CUDA graph replays the same kernels on the same addresses with the same grid, so every
tensor a LoRA kernel reads must live at a fixed address and be refilled *in place* between steps:

- ``LoRAStepBuffers`` holds the step's slot groups (``LoRABatch.order``, ``group_slots``,
  ``group_offsets``) in device buffers sized for the largest step (``max_tokens`` token rows,
  ``max_loras`` groups). ``fill(batch)`` overwrites them and *empties the tail* (rows -1, groups -1,
  offsets = the step's LoRA token count; ``scales``, each row's entry scale, 1 where the batch has none),
  so a replay launched over the whole capacity reads nothing
  that a longer earlier step left behind.
- It records the slot-table version the buffers were filled from; ``check(version)`` raises
  ``StaleLoRAIndices`` unless it equals the version the reader is about to serve (the seed's
  invariant, carried into replayed graphs: indices derived from an old layout are never read).
- ``slot_tables(...)`` builds the per-layer slot ranks ``[max_loras]`` and B blocks
  ``[max_loras, P, 4]`` as int32 device tensors; ``LoRALinear`` keeps its own copies and rewrites
  them in place with every slot write, so a captured graph sees the new layout.

Slot writes and steps are issued on one stream, so a slot's weights are rewritten only after every
step queued before the write has read them; the adapter manager's pins keep a slot that a queued or
running step reads from being chosen for a write at all.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loraplex.ops.lora import Blocks
from loraplex.ops.lora_batch import LoRABatch


class StaleLoRAIndices(RuntimeError):
    """The index buffers were filled from another slot-table version than the step serves."""


class LoRAStepBuffers:
    """One model's per-step LoRA index buffers (shared by all its layers), refilled in place."""

    def __init__(self, max_tokens: int, max_loras: int, device: torch.device | str) -> None:
        if max_tokens < 1 or max_loras < 1:
            raise ValueError(f"need max_tokens >= 1 and max_loras >= 1, got {max_tokens}, {max_loras}")
        self.max_tokens, self.max_loras = max_tokens, max_loras
        self.rows = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)  # [max_tokens] sorted by slot
        self.scales = torch.ones(max_tokens, dtype=torch.float32, device=device)  # [max_tokens] entry scales
        self.group_slots = torch.full((max_loras,), -1, dtype=torch.int32, device=device)  # [max_loras]
        self.group_starts = torch.zeros(max_loras + 1, dtype=torch.int32, device=device)  # [max_loras + 1]
        self.batch: LoRABatch | None = None  # what the buffers hold now (None: nothing yet)
        self.slot_version: int | None = None
        self.num_groups = 0
        self.max_group_tokens = 0

    def fill(self, batch: LoRABatch) -> None:
        """Overwrite the buffers with ``batch``'s slot groups and empty their tails."""
        n, g = batch.num_lora_tokens, len(batch.group_slots)
        if batch.num_tokens > self.max_tokens or g > self.max_loras:
            raise ValueError(f"a step of {batch.num_tokens} tokens in {g} slot groups exceeds the buffers' "
                             f"capacity of {self.max_tokens} tokens and {self.max_loras} groups")
        self.rows[:n].copy_(batch.order)
        self.rows[n:].fill_(-1)
        if batch.entry_scales is None:
            self.scales.fill_(1.0)
        else:
            self.scales[:n].copy_(batch.entry_scales)
            self.scales[n:].fill_(1.0)
        tables = torch.full((2 * self.max_loras + 1,), -1, dtype=torch.int32)  # [slots | starts], host
        tables[:g] = torch.tensor(batch.group_slots, dtype=torch.int32)
        tables[self.max_loras :].fill_(n)
        tables[self.max_loras : self.max_loras + g + 1] = torch.tensor(batch.group_offsets, dtype=torch.int32)
        self.group_slots.copy_(tables[: self.max_loras])
        self.group_starts.copy_(tables[self.max_loras :])
        offsets = batch.group_offsets
        self.num_groups = g
        self.max_group_tokens = max((offsets[i + 1] - offsets[i] for i in range(g)), default=0)
        self.batch, self.slot_version = batch, batch.slot_version

    def prepare(self, batch: LoRABatch) -> None:
        """Refill unless the buffers already hold ``batch``. The memo key is the batch object itself,
        which carries its slot-table version: the manager hands out the same object only for the same
        (mapping, version), so an equal mapping under a new layout always refills."""
        if self.batch is not batch:
            self.fill(batch)
        self.check(batch.slot_version)

    def check(self, slot_version: int) -> None:
        """Raise ``StaleLoRAIndices`` unless the buffers were filled at ``slot_version``."""
        if self.slot_version != slot_version:
            raise StaleLoRAIndices(f"LoRA index buffers were filled at slot-table version {self.slot_version}, "
                                   f"the step serves version {slot_version}: refill them first")


def slot_tables(slot_ranks: Sequence[int], out_features: int, slot_blocks: Sequence[Blocks] | None,
                num_blocks: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot ranks ``[max_loras]`` and B blocks ``[max_loras, num_blocks, 4]`` (int32, on ``device``).

    Without ``slot_blocks`` every slot has the one block ``(0, out_features, 0, R_s)``; a slot listing
    fewer blocks than ``num_blocks`` (an empty slot lists none) is padded with empty blocks.
    """
    blocks = torch.zeros(len(slot_ranks), num_blocks, 4, dtype=torch.int32)
    for s, rank in enumerate(slot_ranks):
        listed = slot_blocks[s] if slot_blocks is not None else ((0, out_features, 0, rank),)
        if len(listed) > num_blocks:
            raise ValueError(f"slot {s} lists {len(listed)} blocks, more than {num_blocks}")
        if listed:
            blocks[s, : len(listed)] = torch.tensor(listed, dtype=torch.int32)
    return torch.tensor(list(slot_ranks), dtype=torch.int32).to(device), blocks.to(device)
