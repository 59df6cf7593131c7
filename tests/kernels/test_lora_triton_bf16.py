"""The Triton LoRA kernels with bfloat16 adapter weights under float32 activations
(``EngineConfig.lora_dtype="bfloat16"``) against the float64 oracle of the rounded weights: the same
math as the sgmv kernel and the torch ops (``tests/test_lora_bf16.py``)."""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from loraplex.ops.lora_batch import build_lora_batch
from tests.kernels.test_lora_triton_ops import run_kernels
from tests.test_lora_ops import make_mapping, reference, stacked_weights


@pytest.mark.parametrize(("num_tokens", "popularity"), [(1, "distinct"), (7, "zipf"), (64, "mixed_none")])
def test_bfloat16_weights_float32_activations(kernel_device: torch.device, num_tokens: int, popularity: str) -> None:
    seed = zlib.crc32(f"triton-bf16-{popularity}-{num_tokens}".encode())
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    max_loras, r_max, in_f, out_f = 13, 64, 136, 200  # slot 12 (= slot -1 read wrongly) stays unused
    batch = build_lora_batch(make_mapping(popularity, num_tokens, 9, rng), {i: (i * 5 + 1) % max_loras
                                                                            for i in range(9)}, slot_version=1)
    ranks = [r_max] * max_loras
    for s in batch.group_slots:
        ranks[s] = rng.randint(1, r_max)
    a, b = stacked_weights(max_loras, set(batch.group_slots), ranks, r_max, in_f, out_f, torch.bfloat16, gen)
    x, y0 = torch.randn(num_tokens, in_f, generator=gen), torch.randn(num_tokens, out_f, generator=gen)
    expected = reference(y0, x, a, b, ranks, batch.token_slots)
    b = b.transpose(1, 2).contiguous().transpose(1, 2)  # rank-major, as LoRALinear stores it
    run_kernels(y0.to(kernel_device), x.to(kernel_device), a.to(kernel_device), b.to(kernel_device), ranks, batch,
                expected)
