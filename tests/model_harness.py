"""Helpers for model/runner tests: a runner over a shuffled block pool, HF references, tolerances."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from loraplex.engine.kv_cache import KVCache
from loraplex.engine.runner import ModelRunner, StepEntry
from loraplex.models.loader import load_model
from loraplex.ops.lora_batch import LoRABatch

# Logits tolerance: max |ours - ref| <= REL * max |ref| (float32 throughout).
REL = 1e-4


def make_runner(folder: Path, num_blocks: int = 160, block_size: int = 4, max_loras: int = 4,
                max_lora_rank: int = 16) -> ModelRunner:
    model = load_model(folder, None, max_loras, max_lora_rank, torch.float32, "cpu")
    return ModelRunner(model, KVCache(model.config, num_blocks, block_size, torch.float32, "cpu"), block_size)


class ShuffledBlocks:
    """Hands out physical blocks in a random order, so block tables are non-contiguous and unsorted."""

    def __init__(self, runner: ModelRunner, seed: int = 0) -> None:
        self.block_size = runner.block_size
        self.free = list(range(runner.kv_cache.num_blocks))
        random.Random(seed).shuffle(self.free)

    def table(self, num_positions: int) -> tuple[int, ...]:
        n = -(-num_positions // self.block_size)
        taken, self.free = self.free[:n], self.free[n:]
        assert len(taken) == n, "test block pool exhausted"
        return tuple(taken)


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, rel: float = REL) -> None:
    torch.testing.assert_close(ours, ref.float(), rtol=0.0, atol=rel * float(ref.abs().max()))


@torch.inference_mode()
def hf_logits(hf: torch.nn.Module, ids: Sequence[int]) -> torch.Tensor:
    """HF full forward (no cache) of one sequence: ``[len(ids), vocab]`` float32."""
    return hf(torch.tensor([list(ids)])).logits[0].float()


def random_prompts(lengths: Sequence[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def greedy(runner: ModelRunner, prompts: Sequence[Sequence[int]], steps: int, blocks: ShuffledBlocks,
           lora_for: Callable[[list[int]], LoRABatch | None] = lambda lens: None,
           ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Batched greedy decoding through the runner: all prompts prefilled in one step, then one decode
    entry per sequence per step. ``lora_for(tokens_per_entry)`` gives each step's LoRA batch.
    Returns the generated tokens per sequence and each step's logits ``[S, vocab]``."""
    seqs = [list(p) for p in prompts]
    tables = [blocks.table(len(p) + steps) for p in prompts]
    entries = [StepEntry(tuple(p), 0, t) for p, t in zip(prompts, tables, strict=True)]
    all_logits = []
    for _ in range(steps):
        logits = runner.execute(entries, lora_for([len(e.token_ids) for e in entries]))
        all_logits.append(logits)
        for seq, tok in zip(seqs, logits.argmax(-1).tolist(), strict=True):
            seq.append(tok)
        entries = [StepEntry((s[-1],), len(s) - 1, t) for s, t in zip(seqs, tables, strict=True)]
    return [s[len(p):] for s, p in zip(seqs, prompts, strict=True)], all_logits
