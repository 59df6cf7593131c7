"""DoRA in ``LoRALinear``: a slot's folded per-feature scale g gives ``(x W^T + x A^T B^T) * g + b`` on its
rows (float64 reference), for prefill runs and decode gathers, with q/k/v bias, in batches that mix DoRA,
plain LoRA and base rows; the other rows stay bit for bit what they are without DoRA; and the fold
itself equals PEFT's DoRA layer."""

from __future__ import annotations

import pytest
import torch
from peft.tuners.lora.dora import DoraLinearLayer

from loraplex.models.fold import dora_scale
from loraplex.ops.lora_batch import SEGMENTS, BatchMapping, build_lora_batch
from tests.test_lora_linear import NAMES, OUTS, make_layer, random_pairs, reference

SLOTS = {0: ({"q_proj": 3, "v_proj": 2}, False),  # plain LoRA
         1: ({"q_proj": 4, "k_proj": 1}, True),  # DoRA on q and k; v untargeted
         2: ({"q_proj": 2, "k_proj": 6, "v_proj": 8}, True)}  # DoRA, ranks differ per projection
BATCHES = {
    "prefill_runs": [0] * 20 + [-1] * 17 + [1] * 18 + [2] * 21,  # long runs: the segments method
    "decode_mix": [2, -1, 0, 1, 1, 2, -1, 0, 2, 1, 0, -1, 2, 2],  # interleaved: one gather of scales
}


def scales(gen: torch.Generator, targets: dict[str, int]) -> dict[str, torch.Tensor]:
    outs = dict(zip(NAMES, OUTS, strict=True))
    return {n: 0.5 + torch.rand(outs[n], generator=gen) for n in targets}


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("batch", BATCHES)
def test_dora_rows_scaled_other_rows_untouched(bias: bool, batch: str) -> None:
    gen = torch.Generator().manual_seed(3)
    dora, plain = make_layer(max_loras=4, bias=bias), make_layer(max_loras=4, bias=bias)
    adapters, gs = {}, {}
    for slot, (ranks, is_dora) in SLOTS.items():
        adapters[slot] = random_pairs(ranks, gen)
        gs[slot] = scales(gen, ranks) if is_dora else {}
        dora.set_slot(slot, adapters[slot], gs[slot])
        plain.set_slot(slot, adapters[slot])
    assert dora.dora_slots == {1, 2}
    token_slots = BATCHES[batch]
    x = torch.randn(len(token_slots), dora.in_features, generator=gen)
    lora = build_lora_batch(BatchMapping(tuple(None if s < 0 else s for s in token_slots)), {0: 0, 1: 1, 2: 2}, 1)
    assert (lora.method == SEGMENTS) == (batch == "prefill_runs")
    with torch.inference_mode():
        y, y_plain, y_base = dora(x, lora), plain(x, lora), dora(x, None)

    expected = reference(dora, x, adapters, token_slots)  # float64, LoRA included
    b = dora.bias.double() if bias else torch.zeros(sum(OUTS), dtype=torch.float64)
    for t, s in enumerate(token_slots):
        g = torch.ones(sum(OUTS), dtype=torch.float64)
        for i, name in enumerate(NAMES):
            if name in gs.get(s, {}):
                g[dora.out_offsets[i] : dora.out_offsets[i + 1]] = gs[s][name].double()
        expected[t] = (expected[t] - b) * g + b
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)
    for t, s in enumerate(token_slots):  # bit for bit: base rows as without LoRA, plain rows as without DoRA
        if s < 0:
            assert torch.equal(y[t], y_base[t]), t
        elif s == 0:
            assert torch.equal(y[t], y_plain[t]), t

    dora.clear_slot(2)
    assert dora.dora_slots == {1} and bool((dora.dora_scale[3] == 1).all())


def test_fold_equals_peft_dora_layer() -> None:
    """``m / ||W + s B A||`` as PEFT's ``DoraLinearLayer`` computes it (B carries the scale here)."""
    gen = torch.Generator().manual_seed(5)
    base = torch.nn.Linear(24, 40, bias=False)
    lora_a, lora_b = torch.nn.Linear(24, 6, bias=False), torch.nn.Linear(6, 40, bias=False)
    torch.nn.init.normal_(lora_b.weight, std=0.3, generator=gen)
    scaling = 1.7
    layer = DoraLinearLayer(fan_in_fan_out=False)
    layer.update_layer(base_layer=base, lora_A=lora_a.weight, lora_B=lora_b.weight, scaling=scaling)
    with torch.no_grad():
        layer.weight.mul_(0.5 + torch.rand(40, generator=gen))
        x = torch.randn(5, 24, generator=gen)
        peft_out = base(x) + layer(x, lora_A=lora_a, lora_B=lora_b, scaling=scaling, base_layer=base,
                                   base_result=base(x))
        b = lora_b.weight * scaling
        g = dora_scale(base.weight, b @ lora_a.weight, layer.weight, 1, "test")
        ours = (x @ base.weight.t() + x @ lora_a.weight.t() @ b.t()) * g
    torch.testing.assert_close(ours, peft_out, rtol=1e-5, atol=1e-6)
