"""ModelRunner: mixed prefill/chunk/decode steps, LoRA slots vs HF + PEFT, and input validation."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from loraplex.adapters.reading.peft_format import read_peft_adapter
from loraplex.config import ModelConfig
from loraplex.engine.kv_cache import KVCache
from loraplex.engine.runner import ModelRunner, StepEntry, prepare_step
from loraplex.errors import AdapterRankTooLarge, AdapterShapeMismatch, UnsupportedAdapter
from loraplex.layers.attention import paged_attention
from loraplex.models.loader import load_model
from loraplex.ops import cpu_kernels
from loraplex.ops.lora_batch import BatchMapping, build_lora_batch
from tests.conftest import make_adapters
from tests.fixtures import tiny_config
from tests.model_harness import ShuffledBlocks, assert_logits_close, greedy, hf_logits, make_runner, random_prompts


def use_decode_path(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """"kernel": the CPU kernels must be built and used (skipped without AVX2); "gather": the torch ops."""
    if path == "gather":
        monkeypatch.setattr(cpu_kernels, "for_tensors", lambda *tensors: None)
    elif torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("no AVX2: the torch ops serve every case")
    else:
        assert cpu_kernels.kernels() is not None


def hf_model(base: Path, adapter: Path | None) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    return model if adapter is None else PeftModel.from_pretrained(model, str(adapter)).eval()


@pytest.mark.parametrize("only_decodes", [False, True])
@pytest.mark.parametrize("decode_path", ["kernel", "gather"])
@pytest.mark.parametrize(("window", "scale", "decode_blocks"), [(None, None, 3), (3, 0.3, 2), (6, None, 2)])
def test_paged_attention_matches_float64_loop(window: int | None, scale: float | None, decode_blocks: int,
                                              decode_path: str, only_decodes: bool,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Attention alone, on random q/k/v and cache contents: decodes (non-contiguous rows), a fresh
    prompt and continuing chunks, GQA with 3 query heads per K/V head, full or sliding-window (keys at
    positions (p - W, p]: a fresh prompt longer than W, chunks across the window's edge, a decode whose
    window skips blocks), default or explicit scale, vs a float64 per-token loop; decodes through the CPU
    kernel that reads the cache in place and through the gather path, in a mixed step and in a decode-only
    step (where the kernel also writes the new K/V)."""
    use_decode_path(decode_path, monkeypatch)
    raw = tiny_config("mistral", hidden_size=48, num_attention_heads=6, num_key_value_heads=2,
                      sliding_window=window).to_dict()
    cfg = ModelConfig.from_hf(raw)
    assert cfg.attention_windows() == (window,)
    heads, kv_heads, d, bs = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 4
    g = torch.Generator().manual_seed(12)
    entries = [StepEntry((1,), 9, (7, 2, 11)), StepEntry((1,) * 6, 0, (4, 0)), StepEntry((1,), 0, (9,)),
               StepEntry((1,) * 5, 3, (1, 10)), StepEntry((1,), 4, (5, 3)), StepEntry((1,) * 3, 9, (6, 8, 12))]
    if only_decodes:
        entries = [e for e in entries if len(e.token_ids) == 1]
    step = prepare_step(entries, bs, cfg, torch.float32, torch.device("cpu"))
    # a sliding layer gathers only the blocks its window reaches (the decode at position 9: blocks 1-2)
    assert step.attn.plan(window).decode.gather[1].shape[-1] == decode_blocks * bs
    t = step.attn.num_tokens
    q, k, v = (torch.randn(t, n, d, generator=g) for n in (heads, kv_heads, kv_heads))
    cache = torch.randn(13, 2, kv_heads, bs, d, generator=g)  # [blocks, K/V, KV, block_size, d]
    at = [(e.block_table[p // bs], p % bs) for e in entries for p in range(e.start_pos, e.start_pos + len(e.token_ids))]
    expect_cache = cache.clone()
    for row, (b, o) in enumerate(at):
        expect_cache[b, 0, :, o], expect_cache[b, 1, :, o] = k[row], v[row]
    out = paged_attention(q, k, v, cache, step.attn, window, scale)
    assert torch.equal(cache, expect_cache)
    row = 0
    for e in entries:
        for i in range(len(e.token_ids)):
            pos = e.start_pos + i
            first = 0 if window is None else max(0, pos - window + 1)
            blocks = [(e.block_table[p // bs], p % bs) for p in range(first, pos + 1)]
            keys = torch.stack([cache[b, 0, :, o] for b, o in blocks]).double()  # [ctx, KV, d]
            vals = torch.stack([cache[b, 1, :, o] for b, o in blocks]).double()
            for h in range(heads):
                w = torch.softmax(keys[:, h // 3] @ q[row, h].double() * (scale or d**-0.5), 0)
                torch.testing.assert_close(out[row, h].double(), w @ vals[:, h // 3], rtol=0, atol=1e-5)
            row += 1
    with pytest.raises(ValueError, match="no attention plan for window 5"):
        paged_attention(q, k, v, cache, step.attn, 5)


def test_mixed_step_equals_separate_steps(tiny_model: Path) -> None:
    """One step holding decodes, a fresh prompt, a prompt's second chunk and a one-token prompt (decode
    rows not contiguous) gives the same logits and cache as running each entry alone."""
    mixed = make_runner(tiny_model)
    solo = ModelRunner(mixed.model, KVCache(mixed.model.config, 160, 4, torch.float32, "cpu"), 4)
    blocks = ShuffledBlocks(mixed, seed=3)
    vocab = mixed.model.config.vocab_size
    b, d, c, a, e = random_prompts([6, 10, 13, 9, 1], vocab, seed=4)
    tables = [blocks.table(len(p) + 2) for p in (b, d, c, a, e)]
    for runner in (mixed, solo):  # history: b and d prefilled, c's first chunk of 6 tokens
        runner.execute([StepEntry(tuple(b[:-1]), 0, tables[0]), StepEntry(tuple(d[:-1]), 0, tables[1]),
                        StepEntry(tuple(c[:6]), 0, tables[2])], None)
    step = [StepEntry((b[-1],), 5, tables[0]), StepEntry(tuple(a), 0, tables[3]),
            StepEntry((d[-1],), 9, tables[1]), StepEntry(tuple(c[6:]), 6, tables[2]),
            StepEntry(tuple(e), 0, tables[4])]
    together = mixed.execute(step, None)
    alone = torch.cat([solo.execute([entry], None) for entry in step])
    torch.testing.assert_close(together, alone, rtol=0, atol=1e-5)
    hf = hf_model(tiny_model, None)
    assert_logits_close(together, torch.stack([hf_logits(hf, p)[-1] for p in (b, a, d, c, e)]))
    # The mixed step wrote every entry's K/V: one more decode step for all five still matches HF.
    nxt = together.argmax(-1).tolist()
    seqs = [p + [t] for p, t in zip((b, a, d, c, e), nxt, strict=True)]
    tabs = [tables[0], tables[3], tables[1], tables[2], tables[4]]
    out = mixed.execute([StepEntry((s[-1],), len(s) - 1, t) for s, t in zip(seqs, tabs, strict=True)], None)
    assert_logits_close(out, torch.stack([hf_logits(hf, s)[-1] for s in seqs]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs_near_hf_float32(tiny_qwen2: Path, dtype: torch.dtype) -> None:
    """No dtype is hard-coded: a prefill + decode step in half precision stays near HF's float32 logits."""
    model = load_model(tiny_qwen2, None, 2, 8, dtype, "cpu")
    runner = ModelRunner(model, KVCache(model.config, 32, 4, dtype, "cpu"), 4)
    p, q = random_prompts([9, 4], model.config.vocab_size, seed=11)
    runner.execute([StepEntry(tuple(p[:-1]), 0, (5, 2)), StepEntry(tuple(q), 0, (7,))], None)
    got = runner.execute([StepEntry((p[-1],), 8, (5, 2, 9))], None)
    assert got.dtype == torch.float32
    assert_logits_close(got[0], hf_logits(hf_model(tiny_qwen2, None), p)[-1], rel=3e-2)


@pytest.fixture(scope="module")
def arch_adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_adapters(tiny_model, tmp_path_factory.mktemp("adapters"))


def test_mixed_adapters_match_hf_peft(tiny_model: Path, arch_adapters: dict[str, Path]) -> None:
    """Four adapters (ranks 2-16, different targets) in shuffled slots plus base-only sequences in one
    batch: every sequence's logits at every step equal HF + PEFT with its adapter (or the base model)."""
    runner = make_runner(tiny_model, max_loras=4)
    cfg = runner.model.config
    slot_of = {10: 2, 11: 0, 12: 3, 13: 1}
    names = {10: "r8_all", 11: "r4_attn", 12: "r16_mlp", 13: "r2_qv"}
    for aid, slot in slot_of.items():
        runner.model.set_slot(slot, read_peft_adapter(arch_adapters[names[aid]], cfg, 16))
    ids = [10, None, 11, 12, 10, 13, None]
    prompts = random_prompts([7, 5, 12, 3, 9, 4, 1], cfg.vocab_size, seed=5)

    def lora_for(lens: list[int]):
        return build_lora_batch(BatchMapping.from_sequences(list(zip(ids, lens, strict=True))), slot_of, 0)

    outs, steps = greedy(runner, prompts, 5, ShuffledBlocks(runner, seed=6), lora_for)
    for aid in (None, *names):
        hf = hf_model(tiny_model, None if aid is None else arch_adapters[names[aid]])
        for j in (j for j, x in enumerate(ids) if x == aid):
            ref = hf_logits(hf, prompts[j] + outs[j])[len(prompts[j]) - 1 : -1]  # [5, vocab]
            assert_logits_close(torch.stack([s[j] for s in steps]), ref)


def test_rewritten_and_cleared_slots(tiny_llama: Path, tiny_llama_adapters: dict[str, Path]) -> None:
    """Overwriting a slot leaves nothing of the old adapter; a cleared slot gives the base model."""
    runner = make_runner(tiny_llama, max_loras=2)
    cfg = runner.model.config
    runner.model.set_slot(1, read_peft_adapter(tiny_llama_adapters["r8_all"], cfg, 16))
    runner.model.set_slot(1, read_peft_adapter(tiny_llama_adapters["r16_mlp"], cfg, 16))
    prompt = random_prompts([8], cfg.vocab_size, seed=7)[0]
    blocks = ShuffledBlocks(runner, seed=8)
    lora = build_lora_batch(BatchMapping.from_sequences([(5, 8)]), {5: 1}, 0)
    got = runner.execute([StepEntry(tuple(prompt), 0, blocks.table(8))], lora)
    assert_logits_close(got[0], hf_logits(hf_model(tiny_llama, tiny_llama_adapters["r16_mlp"]), prompt)[-1])
    runner.model.clear_slot(1)
    got = runner.execute([StepEntry(tuple(prompt), 0, blocks.table(8))], lora)
    assert_logits_close(got[0], hf_logits(hf_model(tiny_llama, None), prompt)[-1])


@dataclasses.dataclass
class FakeAdapter:
    modules: dict
    path: str = "fake-adapter"


@pytest.mark.parametrize(("key", "a_shape", "b_shape", "error"), [
    ((0, "q_proj"), (4, 63), (64, 4), AdapterShapeMismatch),
    ((0, "q_proj"), (4, 64), (64, 3), AdapterShapeMismatch),
    ((5, "q_proj"), (4, 64), (64, 4), AdapterShapeMismatch),
    ((0, "lm_head"), (4, 64), (256, 4), UnsupportedAdapter),
    ((1, "down_proj"), (17, 128), (64, 17), AdapterRankTooLarge),
])
def test_set_slot_rejects_bad_weights_and_writes_nothing(tiny_llama: Path, key, a_shape, b_shape, error) -> None:
    model = make_runner(tiny_llama, max_loras=2).model
    good = {(1, "v_proj"): (torch.randn(4, 64), torch.randn(32, 4))}
    model.set_slot(0, FakeAdapter(good))
    before = [t.clone() for layer in model.layers for lin in layer.adapted() for t in (lin.lora_a, lin.lora_b)]
    with pytest.raises(error, match="fake-adapter"):
        model.set_slot(0, FakeAdapter({**good, key: (torch.randn(*a_shape), torch.randn(*b_shape))}))
    after = [t for layer in model.layers for lin in layer.adapted() for t in (lin.lora_a, lin.lora_b)]
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
    with pytest.raises(IndexError):
        model.set_slot(2, FakeAdapter(good))


def test_execute_rejects_malformed_steps(tiny_llama: Path) -> None:
    runner = make_runner(tiny_llama)
    with pytest.raises(ValueError, match="at least one entry"):
        runner.execute([], None)
    with pytest.raises(ValueError, match=">= 1 token"):
        runner.execute([StepEntry((), 0, (0,))], None)
    with pytest.raises(ValueError, match="cannot hold 9 positions"):
        runner.execute([StepEntry(tuple(range(9)), 0, (0, 1))], None)
    vocab = runner.model.config.vocab_size
    with pytest.raises(ValueError, match=rf"\[0, {vocab}\)"):
        runner.execute([StepEntry((vocab,), 0, (0,))], None)
    with pytest.raises(ValueError, match=rf"\[0, {vocab}\)"):
        runner.execute([StepEntry((-1,), 0, (0,))], None)
    lora = build_lora_batch(BatchMapping.from_sequences([(None, 2)]), {}, 0)
    with pytest.raises(ValueError, match="LoRA batch has 2 tokens"):
        runner.execute([StepEntry((1, 2, 3), 0, (0,))], lora)
    with pytest.raises(ValueError, match="block_size"):
        ModelRunner(runner.model, runner.kv_cache, 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        StepEntry((1,), 0, (0,)).start_pos = 3  # type: ignore[misc]
