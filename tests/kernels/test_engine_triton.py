"""The engine's HF + PEFT reference tests with the LoRA delta forced onto the Triton kernels (float32;
in the interpreter on CPU, or on CUDA); the torch LoRA op is made to fail if anything still calls it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraplex.layers import lora_linear
from tests.test_engine_reference import assert_first_step_logits_match_peft, assert_mixed_batch_equals_hf_peft


@pytest.fixture
def triton_only(monkeypatch: pytest.MonkeyPatch, kernel_device: torch.device) -> dict:
    def torch_op_called(*args, **kwargs) -> None:
        raise AssertionError("the torch LoRA op ran although lora_kernels='triton'")

    monkeypatch.setattr(lora_linear, "add_lora", torch_op_called)
    return {"lora_kernels": "triton", "device": kernel_device.type, "dtype": "float32"}


def test_mixed_batch_equals_hf_peft(tiny_llama: Path, tiny_llama_adapters: dict[str, Path], triton_only: dict) -> None:
    """Adapters of ranks 2..16 on different projections (packed blocks of rank 0 included), base-only
    requests, prefill and decode in one batch: greedy tokens equal HF + PEFT's (sized for the interpreter:
    one prompt per adapter and one without, 6 tokens each)."""
    assert_mixed_batch_equals_hf_peft(tiny_llama, tiny_llama_adapters, num_prompts=5, max_tokens=6, **triton_only)


def test_first_step_logits_match_peft(tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
                                      triton_only: dict) -> None:
    assert_first_step_logits_match_peft(tiny_llama, tiny_llama_adapters, **triton_only)
