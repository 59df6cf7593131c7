"""Activated LoRA (issue 37 item 1): a PEFT aLoRA adapter (``alora_invocation_tokens``) applies its delta from
the start of the last occurrence of its invocation sequence in the prompt on; every position before it is
the base model's. Token for token against PEFT's aLoRA forward, in mixed batches (two aLoRA adapters, a plain
LoRA, the base) with prefix caching on and the invariant checks on; the blocks entirely before the invocation
point key as the base model's (so base requests and other aLoRA adapters share them), the blocks at or after
it on the version (never shared with the base)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from loraplex import LLM, AdapterMix, RequestError, SamplingParams
from tests.conftest import make_adapters
from tests.reference import _base, with_adapter

MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
BLOCK = 4
INVOCATIONS = {"intrinsic_a": [101, 202, 303], "intrinsic_b": [404, 505]}


def write_alora_adapter(base_folder: Path, folder: Path, invocation: list[int], seed: int) -> Path:
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0,
                        task_type="CAUSAL_LM", alora_invocation_tokens=invocation)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@torch.inference_mode()
def alora_greedy(base_folder: Path, folder: Path, prompt: list[int]) -> list[int]:
    """PEFT's aLoRA forward: the prompt (PEFT finds the invocation offset), then one token at a time with its
    K/V cache, each new token adapted (``alora_offsets=[1]``: the last position of a one-token input)."""
    model = PeftModel.from_pretrained(_base(str(base_folder)), str(folder)).eval()
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    tokens = []
    for _ in range(MAX_TOKENS):
        tokens.append(int(torch.argmax(out.logits[0, -1])))
        out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True,
                    alora_offsets=[1])
    model.unload()
    return tokens


@pytest.fixture(scope="module")
def folders(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("alora")
    out = {name: write_alora_adapter(tiny_llama, root / name, ids, seed=i + 5)
           for i, (name, ids) in enumerate(INVOCATIONS.items())}
    out["r8_all"] = make_adapters(tiny_llama, root / "plain")["r8_all"]
    return out


@pytest.fixture(scope="module")
def conversation() -> list[int]:
    rng = random.Random(23)
    return [rng.randrange(1000, 49152) for _ in range(22)]  # 5 full blocks of 4, then 2 tokens


def llm_for(tiny_llama: Path, folders: dict[str, Path]) -> LLM:
    llm = LLM(model=str(tiny_llama), max_loras=3, max_lora_rank=16, kv_cache_blocks=256, block_size=BLOCK,
              debug_checks=True)
    for name, folder in folders.items():
        llm.load_adapter(name, folder)
    return llm


def hits(llm: LLM) -> int:
    return llm.stats().prefix_cache_hit_tokens


def test_alora_equals_peft_in_mixed_batches(tiny_llama: Path, folders: dict[str, Path],
                                            conversation: list[int]) -> None:
    """Two intrinsics over one conversation (one with its invocation twice: the last one counts), a plain LoRA
    and the base, in one batch, twice (the second time from cached blocks)."""
    inv_a, inv_b = INVOCATIONS["intrinsic_a"], INVOCATIONS["intrinsic_b"]
    rows = [("intrinsic_a", conversation + inv_a + [7, 8]),
            ("intrinsic_a", conversation[:6] + inv_a + conversation[6:] + inv_a + [9]),
            ("intrinsic_b", conversation + [11] + inv_b),
            ("intrinsic_b", inv_b + conversation),  # invocation at position 0: adapted throughout
            ("r8_all", conversation + inv_a),
            (None, conversation + inv_b)]
    wanted = [alora_greedy(tiny_llama, folders[name], p) if name in INVOCATIONS
              else with_adapter(tiny_llama, folders.get(name) if name else None, [p], MAX_TOKENS)[0]
              for name, p in rows]
    llm = llm_for(tiny_llama, folders)
    for attempt in range(2):
        outs = llm.generate([p for _, p in rows], GREEDY, adapters=[n for n, _ in rows], use_tqdm=False)
        assert [o.token_ids for o in outs] == wanted, f"attempt {attempt}"
    assert hits(llm) > 0


def test_base_blocks_are_shared_and_post_invocation_blocks_are_not(tiny_llama: Path, folders: dict[str, Path],
                                                                   conversation: list[int]) -> None:
    """The base model caches the conversation; an intrinsic invoked after it reuses every block entirely before
    its invocation point; then the base model, given the intrinsic's very prompt, reuses only those blocks
    (never the intrinsic's post-invocation blocks) and equals the base reference; another intrinsic shares
    the base blocks too."""
    llm = llm_for(tiny_llama, folders)
    llm.generate([conversation + [5, 6, 7]], GREEDY, use_tqdm=False)  # 6 full blocks cached as the base's
    inv = INVOCATIONS["intrinsic_a"]
    prompt = conversation + inv + [12, 13, 14, 15, 16]  # invocation at 22: blocks 0-4 are pre-invocation
    before = hits(llm)
    out = llm.generate([prompt], GREEDY, adapters="intrinsic_a", use_tqdm=False)
    assert out[0].token_ids == alora_greedy(tiny_llama, folders["intrinsic_a"], prompt)
    assert hits(llm) - before == (len(conversation) // BLOCK) * BLOCK  # 5 base blocks, not block 5 (post-invocation)
    before = hits(llm)
    base = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert base[0].token_ids == with_adapter(tiny_llama, None, [prompt], MAX_TOKENS)[0]
    assert hits(llm) - before == (len(conversation) // BLOCK) * BLOCK  # the base blocks only
    other = conversation + INVOCATIONS["intrinsic_b"] + [3]
    before = hits(llm)
    out = llm.generate([other], GREEDY, adapters="intrinsic_b", use_tqdm=False)
    assert out[0].token_ids == alora_greedy(tiny_llama, folders["intrinsic_b"], other)
    assert hits(llm) - before == (len(conversation) // BLOCK) * BLOCK


def test_a_prompt_without_the_invocation_is_refused(tiny_llama: Path, folders: dict[str, Path],
                                                    conversation: list[int]) -> None:
    llm = llm_for(tiny_llama, folders)
    with pytest.raises(RequestError) as info:
        llm.generate([conversation + INVOCATIONS["intrinsic_a"][:2]], GREEDY, adapters="intrinsic_a",
                     use_tqdm=False)
    assert info.value.param == "prompt" and "alora_invocation_tokens" in str(info.value)
    assert llm.stats().num_waiting == 0
    for mix in ([("intrinsic_a", 0.5)], [("intrinsic_a", 1.0), ("r8_all", 1.0)]):  # an aLoRA is served alone
        with pytest.raises(RequestError, match="activated LoRA"):
            llm.generate([conversation + INVOCATIONS["intrinsic_a"]], GREEDY, adapters=AdapterMix(mix),
                         use_tqdm=False)


def test_alora_over_http_with_the_engine_in_its_own_process(tiny_llama: Path, folders: dict[str, Path],
                                                            conversation: list[int], tmp_path: Path) -> None:
    """``loraplex serve``'s shape (engine and preparer in their own processes): an intrinsic after the base model
    cached the conversation equals PEFT and reuses the base's blocks; a prompt without the invocation is a 400
    naming ``prompt``."""
    import httpx
    from transformers import AutoTokenizer

    from tests.server_harness import BASE, tiny_server

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    prompt = conversation + INVOCATIONS["intrinsic_b"] + [21, 22]
    with tiny_server(tiny_llama, folders, tuple(folders), (), tmp_path, mode="process", max_loras=3,
                     kv_cache_blocks=128, block_size=BLOCK, debug_checks=True) as server:
        def complete(model: str, ids: list[int]) -> httpx.Response:
            return httpx.post(f"{server.url}/v1/completions", timeout=60, json={
                "model": model, "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})

        assert complete(BASE, conversation + [1, 2]).status_code == 200
        before = server.stats().prefix_cache_hit_tokens
        answer = complete("intrinsic_b", prompt)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == tokenizer.decode(
            alora_greedy(tiny_llama, folders["intrinsic_b"], prompt))
        assert server.stats().prefix_cache_hit_tokens - before == (len(conversation) // BLOCK) * BLOCK
        refused = complete("intrinsic_b", conversation)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt", refused.text
