"""Adapter formats trainers emit, served in mixed batches and held to HF transformers + PEFT: DoRA
(rank-heterogeneous, with q/k/v bias on qwen2), LoRA on embed_tokens/lm_head, modules_to_save, trainable
tokens, DoRA on embed_tokens/lm_head, plain LoRA and base rows together; under slot and host-tier pressure;
through unload and reload; and adapters that add tokens, with their own tokenizer."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from loraplex import LLM, SamplingParams
from tests.fixtures import write_peft_adapter, write_tiny_model
from tests.format_fixtures import (
    ADDED_TOKENS,
    FORMATS,
    format_config,
    peft_model,
    write_added_tokens_adapter,
    write_format_adapter,
)
from tests.reference import hf_greedy

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
VOCAB = 512  # the format tests' tiny models: a small vocabulary keeps PEFT's reference fast


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 20))] for _ in range(n)]


@pytest.fixture(scope="module", params=["llama", "qwen2", "llama3", "qwen3", "gemma3", "phi3"])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    """A tiny base of each family (llama, qwen2, qwen3 and gemma3 tie their embeddings, llama3 and phi3 do
    not; gemma3 scales them) and one adapter per format."""
    extra = {"pad_token_id": 0} if request.param == "phi3" else {}  # Phi-3's default pad id is past VOCAB
    base = write_tiny_model(tmp_path_factory.mktemp(f"fmt-{request.param}"), request.param, vocab_size=VOCAB, **extra)
    root = tmp_path_factory.mktemp(f"fmt-{request.param}-adapters")
    adapters = {name: write_format_adapter(base, root / name, seed=i + 1, **format_config(base, name))
                for i, name in enumerate(FORMATS)}
    adapters["plain"] = write_peft_adapter(base, root / "plain", rank=8, alpha=16.0, seed=9)  # every projection
    return base, adapters


def test_formats_equal_peft_in_mixed_batches(family: tuple[Path, dict[str, Path]]) -> None:
    """Every format with plain LoRA and base rows in one batch: first-step logits within 1e-4 relative of
    PEFT's and greedy tokens equal to PEFT's; then 2 slots and 3 host entries for 6 adapters (evictions,
    re-reads from disk) and every adapter unloaded and reloaded (new versions) with another mix of
    adapters over the same prompts: still PEFT's tokens."""
    base, adapters = family
    names = [*adapters, None]
    batch = prompts(len(names) + 2, seed=1)
    mixes = [[names[(i + shift) % len(names)] for i in range(len(batch))] for shift in (0, 3)]
    refs: dict[tuple[str | None, int], tuple[list[int], torch.Tensor]] = {}
    for name in names:
        model = peft_model(base, adapters.get(name))
        for i in {i for mix in mixes for i, c in enumerate(mix) if c == name}:
            refs[(name, i)] = hf_greedy(model, batch[i], GREEDY.max_tokens)
    assert len({tuple(refs[(n, i)][0]) for (n, i) in refs}) > len(refs) // 2, "formats should change outputs"

    roomy = LLM(model=str(base), max_loras=len(adapters), kv_cache_blocks=256, debug_checks=True)
    for name, folder in adapters.items():
        roomy.load_adapter(name, folder)
    captured: list[torch.Tensor] = []
    execute = roomy.engine.runner.execute
    roomy.engine.runner.execute = lambda entries, lora: captured.append(execute(entries, lora)) or captured[-1]
    outs = roomy.generate(batch, GREEDY, adapters=mixes[0], use_tqdm=False)
    assert captured[0].shape[0] == len(batch), "one step prefills every request"
    for i, name in enumerate(mixes[0]):
        tokens, logits = refs[(name, i)]
        assert outs[i].token_ids == tokens, f"prompt {i}, adapter {name}"
        torch.testing.assert_close(captured[0][i], logits[0], rtol=0.0, atol=1e-4 * float(logits[0].abs().max()))

    tight = LLM(model=str(base), max_loras=2, max_cpu_loras=3, kv_cache_blocks=256, debug_checks=True)
    for round_, mix in enumerate(mixes):
        for name, folder in adapters.items():
            if round_:
                tight.unload_adapter(name)
            tight.load_adapter(name, folder)
        outs = tight.generate(batch, GREEDY, adapters=mix, use_tqdm=False)
        for i, name in enumerate(mix):
            assert outs[i].token_ids == refs[(name, i)][0], f"round {round_}, prompt {i}, adapter {name}"
    counters = tight.engine.stats().adapter_counters
    assert counters.device_evictions > 0 and counters.disk_reads > 0


def test_added_tokens_use_the_adapters_tokenizer(tiny_llama: Path, tmp_path: Path) -> None:
    """Resized vocabularies shipped with the adapter in PEFT's three layouts, one batch with a base row:
    the adapter's tokenizer encodes the prompt (its added token becomes an id >= the base vocabulary),
    greedy decoding emits an added token (its logit row, then its embedding row), the text decodes with
    the adapter's tokenizer, and each equals PEFT on the resized base; the base row is unaffected; the
    chat template comes from the adapter's folder."""
    template = "{% for m in messages %}<|think|>{{ m['content'] }}\n{% endfor %}"
    text = f"Call {ADDED_TOKENS[0]} then"
    layouts = ("saved", "tokens", "lora")
    llm = LLM(model=str(tiny_llama), max_loras=2, kv_cache_blocks=64)
    prompt = llm.tokenize(text)  # the base tokenizer's ids of the same text
    v = llm.engine.model_config.vocab_size
    folders = {layout: write_added_tokens_adapter(tiny_llama, tmp_path / layout, layout, prompt, seed=i,
                                                  chat_template=template) for i, layout in enumerate(layouts)}
    for layout, folder in folders.items():
        llm.load_adapter(layout, folder)
        assert llm.list_adapters()[-1].vocab_size == v + len(ADDED_TOKENS)
    ids = llm.tokenize(text, "saved")
    assert ids != prompt and any(t >= v for t in ids), "the adapter's tokenizer encodes its added token"
    outs = llm.generate([text] * 4, GREEDY, adapters=[*layouts, None], use_tqdm=False)
    for out, layout in zip(outs, layouts, strict=False):
        reference = peft_model(tiny_llama, folders[layout], v + len(ADDED_TOKENS))
        assert out.prompt_token_ids == ids
        assert out.token_ids == hf_greedy(reference, ids, GREEDY.max_tokens)[0], layout
        assert any(t >= v for t in out.token_ids) and ADDED_TOKENS[0] in out.text, layout
    assert outs[3].token_ids == hf_greedy(peft_model(tiny_llama, None), prompt, GREEDY.max_tokens)[0]
    assert ADDED_TOKENS[0] not in outs[3].text
    chat = llm.current_version("tokens").tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                                                       tokenize=False)
    assert chat == "<|think|>hi\n" and llm.current_version(None).tokenizer.chat_template != template
