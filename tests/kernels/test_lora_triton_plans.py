"""Multi-entry LoRA plans (per-entry scales, rows reading 2-3 deltas) through the Triton kernels, one launch
pair per pass as ``LoRALinear`` runs them, against the float64 entry loop of ``tests/lora_plans.py``."""

from __future__ import annotations

import zlib

import pytest
import torch

from loraplex.ops.lora_step_buffers import LoRAStepBuffers, slot_tables
from loraplex.ops.lora_triton import add_lora_triton
from tests.lora_plans import KINDS, plan_case, untouched_rows
from tests.test_lora_ops import TOLERANCE


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_tokens", [1, 9, 40])
def test_passes_match_entry_loop(kernel_device: torch.device, kind: str, num_tokens: int) -> None:
    y0, x, a, b, ranks, batch, expected = plan_case(kind, num_tokens, zlib.crc32(f"triton{kind}{num_tokens}".encode()))
    y0, x, a, b = (t.to(kernel_device) for t in (y0, x, a, b))
    buffers = LoRAStepBuffers(num_tokens, a.shape[0], kernel_device)
    ranks_t, blocks_t = slot_tables(ranks, y0.shape[1], None, 1, kernel_device)
    y = y0.clone()
    for part in (batch, *batch.more):
        if part.has_lora:
            buffers.prepare(part.to(kernel_device))
            add_lora_triton(y, x, a, b, ranks_t, blocks_t, buffers)
    keep = untouched_rows(batch).to(kernel_device)
    assert torch.equal(y[keep], y0[keep])
    scale = (expected - y0.double().cpu()).abs().max().item() + 1e-3
    assert (y.double().cpu() - expected).abs().max().item() <= TOLERANCE[torch.float32] * scale
