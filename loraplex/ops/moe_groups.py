"""Grouping a step's routed tokens by expert, and the LoRA slot groups of those (expert, adapter) pairs.

A mixture-of-experts block sends each token t to ``k`` experts. The ``T * k`` (token, choice) *pairs* are
sorted by expert (stable: token order within an expert), so every expert's pairs are one contiguous run of
rows and its weights are read once for all of them (``ExpertGroups``). LoRA on the experts keeps the co-batching
of the dense layers: pair p of a token with adapter slot s reads the expert's *virtual slot*
``v = s * E + e_p`` (the expert slot buffers are ``[max_loras * E, ...]``, slot-major), so the tokens of
different adapters routed to one expert share its base matmul, and the LoRA delta runs once per
(expert, slot) group through the same batched LoRA ops as a dense layer (``expert_lora_batch``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.ops.lora_batch import LoRABatch


@dataclass(frozen=True)
class ExpertGroups:
    """The step's pairs sorted by expert: pairs ``bounds[e]:bounds[e + 1]`` went to expert e."""

    tokens: torch.Tensor  # [N] int64 token row of each pair (N = T * k), expert-sorted
    experts: torch.Tensor  # [N] int64 expert of each pair, ascending
    weights: torch.Tensor  # [N] routing weight of each pair
    bounds: tuple[int, ...]  # [E + 1]

    def runs(self) -> list[tuple[int, int, int]]:
        """``(expert, lo, hi)`` for every expert with at least one pair."""
        b = self.bounds
        return [(e, b[e], b[e + 1]) for e in range(len(b) - 1) if b[e + 1] > b[e]]


def group_by_expert(top_experts: torch.Tensor, top_weights: torch.Tensor, num_experts: int) -> ExpertGroups:
    """Semantics: pair ``p = t * k + j`` is (token t, its j-th expert ``top_experts[t, j]``, weight
    ``top_weights[t, j]``); the pairs are stably sorted by expert. Shapes: ``top_experts [T, k]`` int64,
    ``top_weights [T, k]`` -> ``ExpertGroups`` over ``N = T * k`` pairs."""
    flat = top_experts.flatten()  # [N]
    order = torch.argsort(flat, stable=True)  # [N]
    counts = torch.bincount(flat, minlength=num_experts)  # [E]
    bounds = (0, *torch.cumsum(counts, 0).tolist())
    return ExpertGroups(tokens=order // top_experts.shape[1], experts=flat.index_select(0, order),
                        weights=top_weights.flatten().index_select(0, order), bounds=bounds)


def lora_batch_from_slots(token_slots: torch.Tensor, slot_version: int) -> LoRABatch:
    """A ``LoRABatch`` from per-row slots (``-1`` = no adapter): rows grouped by slot, stably, as
    ``loraplex.ops.lora_batch.build_lora_batch`` groups a step's tokens. ``token_slots [N]`` int64."""
    adapted = torch.nonzero(token_slots >= 0).flatten()
    sorted_slots, perm = torch.sort(token_slots.index_select(0, adapted), stable=True)
    slots, counts = torch.unique_consecutive(sorted_slots, return_counts=True)
    offsets = (0, *torch.cumsum(counts, 0).tolist())
    return LoRABatch(token_slots=token_slots, order=adapted.index_select(0, perm), group_slots=tuple(slots.tolist()),
                     group_offsets=offsets, slot_version=slot_version)


def expert_lora_batch(groups: ExpertGroups, lora: LoRABatch, num_experts: int) -> LoRABatch:
    """The pairs' LoRA groups: pair p of token t reads virtual slot ``lora.token_slots[t] * E + experts[p]``
    (-1 when the token has no adapter), one group per (slot, expert) that some pair reads. The result's rows
    are the pairs (``groups`` order) and it carries ``lora.slot_version``."""
    slots = lora.token_slots.index_select(0, groups.tokens)  # [N]
    virtual = torch.where(slots >= 0, slots * num_experts + groups.experts, -1)
    return lora_batch_from_slots(virtual, lora.slot_version)
