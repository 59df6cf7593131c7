"""CUDA-graph-ready LoRA state, simulated: every step refills the same buffers in place and "replays" the
kernels on the fixed grid over the buffers' whole capacity (what a captured graph does), across a
longer step followed by a shorter one (stale tails) and the seed's slot rotation between two steps
with an unchanged mapping."""

from __future__ import annotations

import pytest
import torch

from loraplex.adapters.slots import SlotTable
from loraplex.layers.lora_linear import LoRALinear
from loraplex.ops.lora_batch import BatchMapping, build_lora_batch
from loraplex.ops.lora_step_buffers import LoRAStepBuffers, StaleLoRAIndices
from loraplex.ops.lora_triton import add_lora_triton

IN, OUTS, NAMES = 24, (16, 8), ("gate_proj", "up_proj")
Pairs = dict[str, tuple[torch.Tensor, torch.Tensor]]


def make_adapters(gen: torch.Generator) -> dict[int, Pairs]:
    """Adapter id -> {projection: (A [r, in], B [out, r])}, ranks differ; adapter 3 skips up_proj."""
    ranks = {1: {"gate_proj": 3, "up_proj": 5}, 2: {"gate_proj": 8, "up_proj": 1}, 3: {"gate_proj": 2}}
    return {aid: {n: (torch.randn(r, IN, generator=gen), torch.randn(OUTS[NAMES.index(n)], r, generator=gen))
                  for n, r in per.items()} for aid, per in ranks.items()}


def expected(y_base: torch.Tensor, x: torch.Tensor, token_ids: tuple[int | None, ...],
             adapters: dict[int, Pairs]) -> torch.Tensor:
    """float64, token by token, from each adapter's own matrices (never from a slot)."""
    out = y_base.double().clone()
    for t, aid in enumerate(token_ids):
        for i, name in enumerate(NAMES):
            if aid is not None and name in adapters[aid]:
                a, b = adapters[aid][name]
                lo = sum(OUTS[:i])
                out[t, lo : lo + OUTS[i]] += b.double() @ (a.double() @ x[t].double())
    return out


def test_replays_with_stale_tails_and_a_slot_write_between_steps(kernel_device: torch.device) -> None:
    gen = torch.Generator().manual_seed(0)
    adapters = make_adapters(gen)
    layer = LoRALinear(IN, OUTS, NAMES, max_loras=2, max_lora_rank=8, device=kernel_device)
    table = SlotTable(2)
    buffers = LoRAStepBuffers(max_tokens=40, max_loras=2, device=kernel_device)
    def addresses() -> list[int]:
        return [t.data_ptr() for t in (buffers.rows, buffers.group_slots, buffers.group_starts, layer.lora_a,
                                       layer.lora_b, layer.slot_ranks_dev, layer.slot_blocks_dev)]

    captured = addresses()

    def activate(aid: int) -> None:
        resident = aid in table.slot_of
        slot, _ = table.acquire(aid)
        if not resident:
            layer.set_slot(slot, {n: (a.to(kernel_device), b.to(kernel_device)) for n, (a, b) in adapters[aid].items()})

    def replay(x: torch.Tensor, y_base: torch.Tensor) -> torch.Tensor:
        """The captured step: the same grid and addresses every time; the buffers hold its indices."""
        y = y_base.clone()
        add_lora_triton(y, x, layer.lora_a, layer.lora_b, layer.slot_ranks_dev, layer.slot_blocks_dev, buffers,
                        block_width=max(OUTS), fixed_grid=True)
        return y

    def step(token_ids: tuple[int | None, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = torch.randn(len(token_ids), IN, generator=gen)
        y_base = torch.randn(len(token_ids), sum(OUTS), generator=gen)
        return x.to(kernel_device), y_base.to(kernel_device), expected(y_base, x, token_ids, adapters)

    def fill(mapping: BatchMapping) -> None:
        buffers.fill(build_lora_batch(mapping, table.slot_of, table.version))
        buffers.check(table.version)  # what the runner asks right before a replay

    activate(1)
    activate(2)  # slots [1, 2]
    long = BatchMapping.from_sequences([(2, 17), (None, 3), (1, 16), (2, 1)])  # 37 tokens, 2 groups
    fill(long)
    x, y_base, want = step(long.token_version_ids)
    assert torch.allclose(replay(x, y_base).double().cpu(), want, rtol=0, atol=1e-4)

    short = BatchMapping.from_sequences([(1, 1), (None, 1), (1, 1)])  # 3 tokens, 1 group: the tails empty
    fill(short)
    x, y_base, want = step(short.token_version_ids)
    got = replay(x, y_base)
    assert torch.equal(got[1], y_base[1]), "the base-only row changed"
    assert torch.allclose(got.double().cpu(), want, rtol=0, atol=1e-4), "a stale tail was read"

    # the seed's rotation between two steps (nothing pinned): 3 evicts 1, 1 evicts 2, 2 evicts 3
    seed_mapping = BatchMapping.from_sequences([(1, 1), (2, 1)])
    fill(seed_mapping)
    before = table.version
    for aid in (1, 2):
        table.release(aid)
    for aid in (3, 1, 2):
        activate(aid)
        table.release(aid)
    assert table.slots == [2, 1] and table.version > before
    with pytest.raises(StaleLoRAIndices):
        buffers.check(table.version)  # a replay without a refill is refused ...
    x, y_base, want = step(seed_mapping.token_version_ids)
    assert not torch.allclose(replay(x, y_base).double().cpu(), want, rtol=0, atol=1e-4)  # ... it would swap them
    fill(seed_mapping)  # the same mapping, derived again at the new version
    assert torch.allclose(replay(x, y_base).double().cpu(), want, rtol=0, atol=1e-4)
    assert addresses() == captured, "a buffer moved: a replayed graph would read the old one"
