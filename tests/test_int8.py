"""Weight-only int8 base weights: the op against a float64 loop, and int8 engines against HF + PEFT on the
dequantized checkpoint (the float model the int8 one stands for), token for token, on every family."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from loraplex import LLM, SamplingParams
from loraplex.ops.int8 import Int8Weight, dequantize, kernel, kernel_build, quantize
from tests.conftest import ADAPTER_SPECS, family_targets
from tests.engine_harness import capture_step_logits
from tests.fixtures import write_peft_adapter
from tests.reference import hf_model, with_adapter
from tests.test_engine_reference import random_prompts


def reference_quantize(w: torch.Tensor) -> torch.Tensor:
    """The int8 format restated: per row s = max|w| / 127 (1 for a zero row), q = round(w / s) in
    [-127, 127]; returns q * s, the float weight an int8 model computes with."""
    out = torch.empty_like(w)
    for n, row in enumerate(w):
        s = row.abs().max() / 127 if row.abs().max() > 0 else torch.tensor(1.0)
        out[n] = torch.clamp(torch.round(row / s), -127, 127) * s
    return out


@pytest.mark.parametrize("rows", [1, 3, 6, 7, 13, 32])
@pytest.mark.parametrize("shape", [(48, 64), (37, 130), (5, 16)])
def test_int8_linear_matches_float64(rows: int, shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + shape[0])
    w = torch.randn(shape, generator=gen)
    w[1] = 0.0  # an all-zero channel
    x, bias = torch.randn(rows, shape[1], generator=gen), torch.randn(shape[0], generator=gen)
    q, scale = quantize(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
    torch.testing.assert_close(q.float() * scale[:, None], reference_quantize(w), rtol=0, atol=0)
    expected = x.double() @ reference_quantize(w).double().t() + bias.double()
    paths = [Int8Weight.from_float(w), Int8Weight(q, scale, packed=False)]
    for weight in paths:
        assert torch.equal(weight.q, q)
        got = weight.linear(x, bias)
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
        strided = torch.randn(rows, shape[1] + 3, generator=gen)[:, 3:]  # rows with a stride, as in the model
        expected_strided = strided.double() @ reference_quantize(w).double().t()
        torch.testing.assert_close(weight.linear(strided).double(), expected_strided, rtol=1e-5, atol=1e-5)


def test_kernel_is_used_on_avx2() -> None:
    """On this project's CPUs the compiled kernel must build; elsewhere the dequantizing path is used."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("no AVX2: the dequantizing path serves int8")
    assert kernel() is not None and Int8Weight.from_float(torch.randn(20, 8)).packed


# The kernel builds this CPU runs: AVX2 on every supported CPU, AVX-512 too where torch reports it.
BUILDS = ["avx2", "avx512"] if torch.backends.cpu.get_cpu_capability() == "AVX512" else ["avx2"]


@pytest.mark.parametrize("isa", BUILDS)
def test_kernel_builds_match_float64_and_do_not_depend_on_the_batch(isa: str) -> None:
    """Each build against the float64 product on shapes that exercise every tile (1-33 rows: register and
    scratch paths, uneven row splits; 1-11 blocks: groups of 8, 4, 2 and 1, a partial last block), and
    every row of a batch bitwise equal to that row multiplied alone."""
    module = kernel_build(isa)
    assert module is not None
    gen = torch.Generator().manual_seed(17)
    for n, k in ((5, 16), (37, 130), (176, 64), (100, 33)):
        q, scale = quantize(torch.randn(n, k, generator=gen))
        packed, bias = module.pack(q), torch.randn(n, generator=gen)
        x = torch.randn(33, k + 2, generator=gen)[:, 2:]  # strided rows, as in the model
        full = module.linear(x, packed, scale, bias)
        expected = x.double() @ dequantize(q, scale).double().t() + bias.double()
        torch.testing.assert_close(full.double(), expected, rtol=1e-5, atol=1e-5)
        for rows in (1, 2, 3, 4, 5, 7, 12, 13, 23, 32):
            assert torch.equal(module.linear(x[:rows], packed, scale, bias), full[:rows]), (n, k, rows)


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="needs an AVX-512 CPU")
def test_avx512_build_is_chosen_and_bitwise_equal_to_avx2() -> None:
    """On AVX-512 CPUs ``kernel()`` is the AVX-512 build, and it gives bitwise the AVX2 build's results
    (the same FMA chain per element), for every batch size from 1 to 40."""
    avx2, avx512 = kernel_build("avx2"), kernel_build("avx512")
    assert kernel() is avx512 and avx2 is not avx512
    gen = torch.Generator().manual_seed(3)
    for n, k in ((48, 64), (37, 130), (200, 576)):
        q, scale = quantize(torch.randn(n, k, generator=gen))
        packed, bias = avx2.pack(q), torch.randn(n, generator=gen)
        assert torch.equal(avx512.pack(q), packed)
        for rows in range(1, 41):
            x = torch.randn(rows, k, generator=gen)
            for b in (bias, None):
                assert torch.equal(avx512.linear(x, packed, scale, b), avx2.linear(x, packed, scale, b)), (n, k, rows)


def dequantized_checkpoint(base: Path, folder: Path) -> Path:
    """``base`` with every projection and the lm_head (the tied embedding) replaced by its int8 value."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}":  # every projection, fused or not
                module.weight.copy_(reference_quantize(module.weight))
        head = model.get_output_embeddings()
        head.weight.copy_(reference_quantize(head.weight))  # tied: the embedding too
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def int8_setup(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("int8-adapters")
    adapters = {name: write_peft_adapter(tiny_model, root / name, rank=rank, alpha=2 * rank, seed=i + 1,
                                         target_modules=family_targets(tiny_model, ADAPTER_SPECS[name][1]))
                for i, (name, rank) in enumerate((("r8_all", 8), ("r4_attn", 4)))}
    return dequantized_checkpoint(tiny_model, tmp_path_factory.mktemp("dequantized")), adapters


def test_int8_engine_equals_dequantized_hf_peft(tiny_model: Path, int8_setup: tuple[Path, dict[str, Path]]) -> None:
    """Mixed adapters and base requests on int8 base weights, every family: greedy tokens equal HF + PEFT
    on the dequantized checkpoint; the first step's logits within 1e-4 of its scale."""
    reference, adapters = int8_setup
    names = ["r8_all", "r4_attn", None]
    prompts = random_prompts(6, seed=5)
    chosen = [names[i % len(names)] for i in range(len(prompts))]
    llm = LLM(model=str(tiny_model), max_loras=2, kv_cache_blocks=128, quantization="int8", debug_checks=True)
    for name in names[:-1]:
        llm.load_adapter(name, adapters[name])
    captured = capture_step_logits(llm.engine)
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), adapters=chosen)
    for name in names:
        idx = [i for i, c in enumerate(chosen) if c == name]
        expected = with_adapter(reference, adapters.get(name), [prompts[i] for i in idx], 8)
        for i, exp in zip(idx, expected, strict=True):
            assert outs[i].token_ids == exp, f"prompt {i} adapter {name}"
    for row, (prompt, name) in enumerate(zip(prompts, chosen, strict=True)):
        model = hf_model(reference, adapters.get(name))
        ref = model(torch.tensor([prompt])).logits[0, -1]
        if name is not None:
            model.unload()
        assert torch.allclose(captured[0][row], ref, atol=1e-4 * float(ref.abs().max()), rtol=0), (row, name)


def test_perplexity_harness_sized_down(tiny_llama: Path) -> None:
    """``benchmarks/int8.py`` at toy size: its windowed perplexity equals HF's loss on the same windows, and
    int8 stays within 2 % of float32 (the benchmark's quality target, checked there on SmolLM2)."""
    from benchmarks.int8 import TEXT, perplexity

    engines = {name: LLM(model=str(tiny_llama), max_loras=1, kv_cache_blocks=64, quantization=q)
               for name, q in (("float32", None), ("int8", "int8"))}
    ids = engines["float32"].tokenizer.encode(TEXT.read_text())[:300]
    ppl = {name: perplexity(llm, ids, window=128) for name, llm in engines.items()}
    model = hf_model(tiny_llama, None)
    nll = sum(float(model(torch.tensor([ids[s : s + 128]]), labels=torch.tensor([ids[s : s + 128]])).loss)
              * (len(ids[s : s + 128]) - 1) for s in range(0, len(ids), 128))
    assert abs(ppl["float32"] - math.exp(nll / (len(ids) - 3))) < 1e-3 * ppl["float32"]
    assert abs(ppl["int8"] / ppl["float32"] - 1) < 0.02
