"""Multi-entry LoRA plans (a row reads 0..K deltas, each at its own scale: ``lora_scale``, adapter mixes)
through the torch ops (every method) and the C++ kernel, against a float64 loop over the entries
(``tests/lora_plans.py``). Unused slots hold NaN; rows no entry reads stay bit for bit."""

from __future__ import annotations

import zlib

import pytest
import torch

from loraplex.ops import lora_sgmv
from loraplex.ops.lora import add_lora
from loraplex.ops.lora_batch import LORA_METHODS, BatchMapping, build_lora_batch
from loraplex.ops.lora_step_buffers import slot_tables
from tests.lora_plans import KINDS, plan_case, untouched_rows
from tests.test_lora_ops import TOLERANCE

METHODS = (None, *LORA_METHODS)


def check(y: torch.Tensor, y0: torch.Tensor, expected: torch.Tensor, batch, what: str) -> None:
    keep = untouched_rows(batch)
    assert torch.equal(y[keep], y0[keep]), f"{what}: a row no entry reads changed"
    scale = (expected - y0.double()).abs().max().item() + 1e-3
    err = (y.double() - expected).abs().max().item()
    assert err <= TOLERANCE[y.dtype] * scale, f"{what}: max error {err} vs delta scale {scale}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_tokens", [1, 9, 96])
def test_torch_ops_match_entry_loop(dtype: torch.dtype, kind: str, num_tokens: int) -> None:
    y0, x, a, b, ranks, batch, expected = plan_case(kind, num_tokens, zlib.crc32(f"{dtype}{kind}{num_tokens}".encode()),
                                                    dtype)
    for method in METHODS:
        y = y0.clone()
        add_lora(y, x, a, b, ranks, batch, method=method)
        check(y, y0, expected, batch, f"method {method}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_tokens", [1, 5, 96])
def test_sgmv_kernel_matches_entry_loop(kind: str, num_tokens: int) -> None:
    if lora_sgmv.kernel() is None:
        pytest.fail("the LoRA sgmv kernel must build here (AVX2 and a compiler)")
    y0, x, a, b, ranks, batch, expected = plan_case(kind, num_tokens, zlib.crc32(f"sgmv{kind}{num_tokens}".encode()))
    b = b.transpose(1, 2).contiguous().transpose(1, 2)  # rank-major, LoRALinear's layout
    ranks_t, blocks_t = slot_tables(ranks, y0.shape[1], None, 1, "cpu")
    y = y0.clone()
    assert lora_sgmv.takes(y, x, a, b)
    lora_sgmv.add_lora_sgmv(y, x, a, b, ranks, ranks_t, blocks_t, batch)
    check(y, y0, expected, batch, "sgmv")


def test_plan_passes_and_scales() -> None:
    # seq 0: a mix (7 at 0.5, 5 at 2.0), 2 tokens; seq 1: base; seq 2: 5 at scale 0 (= base); seq 3: plain 7
    mapping = BatchMapping.from_sequences([(None, 2), (None, 1), (None, 1), (7, 1)],
                                          [((7, 0.5), (5, 2.0)), None, ((5, 0.0),), None])
    assert mapping.token_version_ids == (None, None, None, None, 7)
    assert mapping.version_ids() == {5, 7}
    batch = build_lora_batch(mapping, {5: 0, 7: 2}, slot_version=3)
    assert batch.token_slots.tolist() == [2, 2, -1, -1, 2]
    assert batch.token_scales.tolist() == [0.5, 0.5, 0.0, 0.0, 1.0]
    assert batch.runs == ((0, 2, 2), (4, 5, 2)) and batch.run_scales == (0.5, 1.0)
    assert len(batch.more) == 1
    second = batch.more[0]
    assert second.token_slots.tolist() == [0, 0, -1, -1, -1] and second.token_scales.tolist()[:2] == [2.0, 2.0]
    assert second.slot_version == 3 and second.more == ()
    plain = build_lora_batch(BatchMapping.from_sequences([(7, 2), (None, 1)]), {7: 2}, 0)
    assert plain.token_scales is None and plain.more == ()  # the plain step is what it always was
