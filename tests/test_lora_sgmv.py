"""The C++ LoRA kernel (``loraplex.ops.lora_sgmv``) against the float64 per-token loop of test_lora_ops.

Fresh random inputs per case: ranks 1..64 mixed in one batch, every adapter popularity, decode- and
prefill-sized batches, shapes whose rows and columns are not multiples of the vector width or the
register tiles, packed B blocks, strided x and y. Weights sit in ``LoRALinear``'s layout (B rank-major);
unused slots hold NaN, so reading one poisons the result. Only ``y`` may change, and rows with slot -1
not even by a bit. Then through ``LoRALinear`` (DoRA rows included) and the engine's kernel choice.
"""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from loraplex.layers.lora_linear import LoRALinear, use_lora_kernels
from loraplex.ops import lora_sgmv
from loraplex.ops.lora import add_lora, resolve_lora_kernels
from loraplex.ops.lora_batch import BatchMapping, build_lora_batch
from loraplex.ops.lora_step_buffers import slot_tables
from tests.test_lora_ops import POPULARITY, make_mapping, packed_case, reference, same, stacked_weights


@pytest.fixture(scope="module", autouse=True)
def kernel():  # noqa: ANN201
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("no AVX2: the torch LoRA ops serve every case")
    module = lora_sgmv.kernel()
    assert module is not None, "the LoRA sgmv kernel must build on an AVX2 machine with a compiler"
    return module


BUILDS = ["avx2", "avx512"] if torch.backends.cpu.get_cpu_capability() == "AVX512" else ["avx2"]


@pytest.fixture(params=BUILDS)
def sgmv_build(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs the test on each build this CPU runs (``add_lora_sgmv`` calling it), the AVX2 one included."""
    module = lora_sgmv.kernel_build(request.param)
    assert module is not None, f"the {request.param} build of the LoRA sgmv kernel must build here"
    monkeypatch.setattr(lora_sgmv, "kernel", lambda: module)
    return request.param


def rank_major(b: torch.Tensor) -> torch.Tensor:
    """``b [L, out, R]`` stored as ``LoRALinear`` stores it: ``[L, R, out]`` in memory, NaN kept."""
    return b.transpose(1, 2).contiguous().transpose(1, 2)


def check_sgmv(y0: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ranks: list[int], batch,
               blocks, expected: torch.Tensor, strided_y: bool = False) -> torch.Tensor:
    y = y0.clone()
    if strided_y:  # y as a column slice of a wider buffer
        y = torch.zeros(y0.shape[0], y0.shape[1] + 3)[:, 3:]
        y.copy_(y0)
    num_blocks = max((len(p) for p in blocks), default=1) if blocks is not None else 1
    ranks_table, blocks_table = slot_tables(ranks, y.shape[1], blocks, num_blocks, "cpu")
    before = [t.clone() for t in (x, a, b, ranks_table, blocks_table)]
    assert lora_sgmv.takes(y, x, a, b), "the kernel must compute this case (not the torch fallback)"
    lora_sgmv.add_lora_sgmv(y, x, a, b, ranks, ranks_table, blocks_table, batch, slot_blocks=blocks)
    base_rows = batch.token_slots < 0
    assert torch.equal(y[base_rows], y0[base_rows]), "a base-only row changed"
    assert all(same(t, u) for t, u in zip((x, a, b, ranks_table, blocks_table), before, strict=True))
    scale = (expected - y0.double()).abs().max().item() + 1e-3
    err = (y.double() - expected).abs().max().item()
    assert err <= 2e-4 * scale, f"max error {err} vs delta scale {scale}"
    return y


def oracle_case(tag: str, popularity: str, num_tokens: int, in_f: int, out_f: int, dtype: torch.dtype) -> tuple:
    """A random step over 13 slots (9 adapters mapped at ranks 1..64, unused slots NaN at full rank; slot 12,
    which a wrong read of slot -1 would hit, stays unused), strided x rows, and the float64 oracle of it:
    ``(y0, x, a, b, ranks, batch, expected)`` with b as ``stacked_weights`` makes it (out-major)."""
    seed = zlib.crc32(f"{tag}-{popularity}-{num_tokens}-{in_f}".encode())
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    max_loras, r_max = 13, 64
    mapping = make_mapping(popularity, num_tokens, 9, rng)
    batch = build_lora_batch(mapping, {i: (i * 5 + 1) % max_loras for i in range(9)}, slot_version=1)
    ranks = [r_max] * max_loras
    for s in batch.group_slots:
        ranks[s] = rng.randint(1, r_max)
    ranks[batch.group_slots[0] if batch.group_slots else 0] = r_max
    a, b = stacked_weights(max_loras, set(batch.group_slots), ranks, r_max, in_f, out_f, dtype, gen)
    x = torch.randn(num_tokens, in_f + 5, generator=gen)[:, 2:-3]  # rows strided
    y0 = torch.randn(num_tokens, out_f, generator=gen)
    return y0, x, a, b, ranks, batch, reference(y0, x, a, b, ranks, batch.token_slots)


@pytest.mark.parametrize("popularity", POPULARITY)
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 300])
@pytest.mark.parametrize(("in_f", "out_f"), [(43, 37), (136, 200)])
def test_sgmv_matches_float64_loop(popularity: str, num_tokens: int, in_f: int, out_f: int, sgmv_build: str) -> None:
    y0, x, a, b, ranks, batch, expected = oracle_case("sgmv", popularity, num_tokens, in_f, out_f, torch.float32)
    b = rank_major(b)
    check_sgmv(y0, x, a, b, ranks, batch, None, expected)
    check_sgmv(y0, x, a, b, ranks, batch, None, expected, strided_y=True)


@pytest.mark.parametrize("block_ranks", [
    [(3, 5, 2), (3, 5, 2), (3, 5, 2)],
    [(3, 5, 2), (8, 0, 4), (1, 1, 1)],  # different blocks, a projection left out
    [(0, 6, 0), (0, 6, 0), (0, 6, 0)],  # empty blocks
    [(0, 0, 0), (16, 16, 16), (0, 0, 0)],  # a slot that does not target this layer at all
])
@pytest.mark.parametrize("seq_len", [1, 3, 5, 40])
def test_sgmv_packed_blocks(block_ranks: list[tuple[int, ...]], seq_len: int, sgmv_build: str) -> None:
    seqs = [(0, seq_len), (None, 2), (2, seq_len), (1, seq_len), (0, 3), (2, 1)]
    y0, x, a, b, ranks, slot_blocks, batch = packed_case(block_ranks, (72, 24, 9), seqs, seed=seq_len)
    expected = reference(y0, x, a, b, ranks, batch.token_slots)
    y = check_sgmv(y0, x, a, rank_major(b), ranks, batch, slot_blocks, expected, strided_y=True)
    untouched = torch.tensor([ranks[s] == 0 if s >= 0 else True for s in batch.token_slots.tolist()])
    assert torch.equal(y[untouched], y0[untouched])


def test_sgmv_rows_do_not_depend_on_their_batch(sgmv_build: str) -> None:
    """A row's result is bitwise the same alone and among 1-6 other rows of its slot (other register tiles)."""
    gen = torch.Generator().manual_seed(7)
    a, b = stacked_weights(3, {0, 1, 2}, [48, 17, 33], 48, 100, 90, torch.float32, gen)
    b = rank_major(b)
    ranks_table, blocks_table = slot_tables([48, 17, 33], 90, None, 1, "cpu")
    x, y0 = torch.randn(8, 100, generator=gen), torch.randn(8, 90, generator=gen)
    results = []
    for others in range(7):
        ids = [0] + [0] * others + [1] * (7 - others)
        batch = build_lora_batch(BatchMapping(tuple(ids)), {0: 0, 1: 2}, 0)
        y = y0.clone()
        lora_sgmv.add_lora_sgmv(y, x, a, b, [48, 17, 33], ranks_table, blocks_table, batch)
        results.append(y[0])
    assert all(torch.equal(r, results[0]) for r in results)


def test_other_dtypes_and_layouts_run_the_torch_ops() -> None:
    gen = torch.Generator().manual_seed(3)
    a, b = stacked_weights(2, {0, 1}, [4, 6], 8, 16, 12, torch.float32, gen)
    ranks_table, blocks_table = slot_tables([4, 6], 12, None, 1, "cpu")
    batch = build_lora_batch(BatchMapping((0, None, 1, 1)), {0: 0, 1: 1}, 0)
    x, y0 = torch.randn(4, 16, generator=gen), torch.randn(4, 12, generator=gen)
    for case in ((x.bfloat16(), y0.bfloat16(), a.bfloat16(), rank_major(b).bfloat16()),  # not float32
                 (x, y0, a, b)):  # B with unit stride over rank, not over out
        cx, cy, ca, cb = case
        assert not lora_sgmv.takes(cy, cx, ca, cb)
        ours, torch_ops = cy.clone(), cy.clone()
        lora_sgmv.add_lora_sgmv(ours, cx, ca, cb, [4, 6], ranks_table, blocks_table, batch)
        add_lora(torch_ops, cx, ca, cb, [4, 6], batch)
        assert torch.equal(ours, torch_ops)


@pytest.mark.parametrize("bias", [False, True])
def test_lora_linear_through_sgmv_with_dora(bias: bool) -> None:
    """``LoRALinear`` on "sgmv" equals it on "torch": base rows bitwise, LoRA and DoRA rows to rounding."""
    gen = torch.Generator().manual_seed(11)
    layer = LoRALinear(64, (48, 16, 16), ("q_proj", "k_proj", "v_proj"), 4, 16, bias=bias)
    layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) / 8)
    if bias:
        layer.bias.copy_(torch.randn(80, generator=gen))

    def pair(r: int, out: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(r, 64, generator=gen) / 8, torch.randn(out, r, generator=gen) * 0.3

    layer.set_slot(0, {"q_proj": pair(16, 48), "v_proj": pair(5, 16)})
    layer.set_slot(2, {"k_proj": pair(9, 16)}, dora_scales={"k_proj": torch.rand(16, generator=gen) + 0.5})
    layer.set_slot(3, {"q_proj": pair(2, 48), "k_proj": pair(3, 16), "v_proj": pair(16, 16)})
    batch = build_lora_batch(BatchMapping((0, None, 2, 3, 0, 2, None, 3, 3)), {0: 0, 2: 2, 3: 3}, 0)
    x = torch.randn(9, 64, generator=gen)
    model = torch.nn.ModuleList([layer])
    outputs = {}
    for kernels in ("torch", "sgmv"):
        use_lora_kernels(model, kernels, max_tokens=16)
        outputs[kernels] = layer(x, batch)
    base = batch.token_slots < 0
    assert torch.equal(outputs["sgmv"][base], outputs["torch"][base])
    torch.testing.assert_close(outputs["sgmv"], outputs["torch"], rtol=1e-5, atol=1e-5)
    assert not torch.equal(outputs["sgmv"][~base], layer(x, None)[~base])


def test_avx512_build_is_chosen_where_the_cpu_has_it() -> None:
    expected = "avx512" if torch.backends.cpu.get_cpu_capability() == "AVX512" else "avx2"
    assert lora_sgmv.kernel() is lora_sgmv.kernel_build(expected)


def test_auto_picks_sgmv_on_cpu() -> None:
    assert resolve_lora_kernels("auto", torch.device("cpu")) == "sgmv"
    assert resolve_lora_kernels("sgmv", torch.device("cpu")) == "sgmv"
    with pytest.raises(ValueError, match="runs on CPUs with AVX2"):
        resolve_lora_kernels("sgmv", torch.device("cuda"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sgmv_threads_do_not_change_results(dtype: torch.dtype, sgmv_build: str) -> None:
    """The groups are split across ATen's threads: 1, 2 and 3 threads give bitwise the same y."""
    gen = torch.Generator().manual_seed(17)
    ranks = [16, 5, 33, 64, 1, 9, 16]
    a, b = stacked_weights(7, set(range(7)), ranks, 64, 136, 200, dtype, gen)
    ranks_table, blocks_table = slot_tables(ranks, 200, None, 1, "cpu")
    batch = build_lora_batch(BatchMapping(tuple(i % 7 for i in range(32))), {i: i for i in range(7)}, 0)
    x, y0 = torch.randn(32, 136, generator=gen), torch.randn(32, 200, generator=gen)
    threads, results = torch.get_num_threads(), []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            y = y0.clone()
            lora_sgmv.add_lora_sgmv(y, x, a, rank_major(b), ranks, ranks_table, blocks_table, batch)
            results.append(y)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(r, results[0]) for r in results)
    assert not torch.equal(results[0], y0)


def test_sgmv_refuses_a_row_in_two_groups(kernel) -> None:  # noqa: ANN001
    a, b = torch.zeros(2, 4, 8), torch.zeros(2, 4, 6).transpose(1, 2)
    ranks, blocks = torch.tensor([4, 4], dtype=torch.int32), torch.tensor([[[0, 6, 0, 4]]] * 2, dtype=torch.int32)
    order, slots, offsets = torch.tensor([0, 1, 1]), torch.tensor([0, 1]), torch.tensor([0, 2, 3])
    with pytest.raises(RuntimeError, match="out of range or repeated"):
        kernel.sgmv(torch.zeros(3, 6), torch.zeros(3, 8), a, b, order, slots, offsets, ranks, blocks,
                    torch.empty(0))
