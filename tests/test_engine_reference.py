"""Invariant 4: greedy outputs of mixed batches equal HF transformers + PEFT, token for token, and equal
each request run alone."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from loraplex import LLM, SamplingParams
from tests.conftest import ADAPTER_SPECS, make_adapters
from tests.reference import hf_greedy, hf_model, with_adapter

MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def random_prompts(n: int, seed: int, vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 40))] for _ in range(n)]


@pytest.fixture(scope="module")
def arch_adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_adapters(tiny_model, tmp_path_factory.mktemp("adapters"))


def assert_mixed_batch_equals_hf_peft(tiny_model: Path, arch_adapters: dict[str, Path], num_prompts: int = 10,
                                      max_tokens: int = MAX_TOKENS, **engine_config) -> None:
    """Several adapters of different ranks and target sets, base-only requests and different prompt
    lengths in one batch generate what HF + PEFT generates for each alone; ``engine_config`` adds
    ``EngineConfig`` fields (the Triton kernel tests force ``lora_kernels="triton"``)."""
    names = [*ADAPTER_SPECS, None]
    prompts = random_prompts(num_prompts, seed=1)
    chosen = [names[i % len(names)] for i in range(len(prompts))]
    llm = LLM(model=str(tiny_model), max_loras=4, max_lora_rank=16, kv_cache_blocks=256, debug_checks=True,
              **engine_config)
    for name, folder in arch_adapters.items():
        llm.load_adapter(name, folder)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, adapters=chosen)
    for name in names:
        idx = [i for i, c in enumerate(chosen) if c == name]
        expected = with_adapter(tiny_model, arch_adapters.get(name), [prompts[i] for i in idx], max_tokens)
        for i, exp in zip(idx, expected, strict=True):
            assert outs[i].token_ids == exp, f"prompt {i} adapter {name}"


def test_mixed_batch_equals_hf_peft(tiny_model: Path, arch_adapters: dict[str, Path]) -> None:
    """Every architecture (llama, llama3 rope scaling, mistral, qwen2 bias)."""
    assert_mixed_batch_equals_hf_peft(tiny_model, arch_adapters)


def assert_first_step_logits_match_peft(tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
                                        **engine_config) -> None:
    """float32 logits of the prefill step within 1e-4 relative of PEFT's, per adapter, in one batch."""
    llm = LLM(model=str(tiny_llama), max_loras=4, kv_cache_blocks=64, **engine_config)
    names = list(tiny_llama_adapters)
    for name in names:
        llm.load_adapter(name, tiny_llama_adapters[name])
    prompts = random_prompts(len(names) + 1, seed=7)
    engine = llm.engine
    captured: list[torch.Tensor] = []
    execute = engine.runner.execute
    engine.runner.execute = lambda entries, lora: captured.append(execute(entries, lora)) or captured[-1]
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), adapters=[*names, None])
    logits = captured[0]
    for row, (prompt, name) in enumerate(zip(prompts, [*names, None], strict=True)):
        model = hf_model(tiny_llama, tiny_llama_adapters.get(name))
        ref = model(torch.tensor([prompt])).logits[0, -1]
        if name is not None:
            model.unload()
        scale = ref.abs().max()
        assert torch.allclose(logits[row].cpu(), ref, atol=1e-4 * float(scale), rtol=0), name


def test_first_step_logits_match_peft(tiny_llama: Path, tiny_llama_adapters: dict[str, Path]) -> None:
    assert_first_step_logits_match_peft(tiny_llama, tiny_llama_adapters)


def test_batch_independence(tiny_llama: Path, tiny_llama_adapters: dict[str, Path]) -> None:
    """Each request's output equals its output when run alone (invariant 4)."""
    llm = LLM(model=str(tiny_llama), max_loras=2, max_cpu_loras=4, kv_cache_blocks=256, debug_checks=True)
    for name, folder in tiny_llama_adapters.items():
        llm.load_adapter(name, folder)
    names = [*tiny_llama_adapters, None]
    prompts = random_prompts(12, seed=3)
    chosen = [names[i % len(names)] for i in range(len(prompts))]
    mixed = llm.generate(prompts, GREEDY, adapters=chosen)
    for prompt, name, out in zip(prompts, chosen, mixed, strict=True):
        assert llm.generate([prompt], GREEDY, adapters=[name])[0].token_ids == out.token_ids


def test_smollm2_mixed_batch_equals_peft(smollm2_adapters: dict[str, Path]) -> None:
    """The real embedded model with two rank-16 adapters on all seven projections."""
    from loraplex.models.embedded import embedded_checkpoint

    llm = LLM(max_loras=2, kv_cache_blocks=64, debug_checks=True)
    for name, folder in smollm2_adapters.items():
        llm.load_adapter(name, folder)
    tok = llm.tokenizer
    questions = ["What is the capital of France?", "Name a color.", "Write a haiku about rain."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                       tokenize=True, return_dict=True)["input_ids"] for q in questions]
    names = [*smollm2_adapters, None]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, adapters=names)
    base = embedded_checkpoint()
    for prompt, name, out in zip(prompts, names, outs, strict=True):
        assert out.token_ids == with_adapter(base, smollm2_adapters.get(name), [prompt], 8)[0], name
    assert len({tuple(o.token_ids) for o in outs}) == 3, "adapters should change the output"


def test_hf_greedy_reference_sanity(tiny_llama: Path) -> None:
    """The reference itself: incremental greedy equals HF generate with a KV cache."""
    model = hf_model(tiny_llama, None)
    prompt = random_prompts(1, seed=11)[0]
    ours, _ = hf_greedy(model, prompt, 6)
    gen = model.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert gen[0, len(prompt):].tolist() == ours
