"""The model and runner against HF transformers (float32): ragged prefill, paged decode through
shuffled block tables, greedy generation, every rope_scaling type, and the real SmolLM2 checkpoint.

Tolerance: max |ours - HF| <= 1e-4 * max |HF logit| (``tests.model_harness.REL``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from loraplex.config import ModelConfig
from loraplex.engine.runner import StepEntry
from loraplex.layers.rotary import RotaryEmbedding
from loraplex.models.embedded import embedded_checkpoint
from tests.fixtures import tiny_config, write_tiny_model
from tests.model_harness import (
    ShuffledBlocks,
    assert_logits_close,
    greedy,
    hf_logits,
    make_runner,
    random_prompts,
)


def hf_model(folder: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_ragged_prefill_then_paged_decode_match_hf(tiny_model: Path) -> None:
    runner, hf = make_runner(tiny_model), hf_model(tiny_model)
    blocks = ShuffledBlocks(runner, seed=1)
    prompts = random_prompts([7, 1, 19, 12, 2], runner.model.config.vocab_size, seed=2)
    decode_steps = 6
    tables = [blocks.table(len(p) + decode_steps) for p in prompts]
    logits = runner.execute([StepEntry(tuple(p), 0, t) for p, t in zip(prompts, tables, strict=True)], None)
    assert logits.shape == (5, runner.model.config.vocab_size) and logits.dtype == torch.float32
    assert_logits_close(logits, torch.stack([hf_logits(hf, p)[-1] for p in prompts]))

    # Decode random (not greedy) tokens: every position's logits equal HF's full forward.
    seqs = [list(p) for p in prompts]
    new_tokens = random_prompts([decode_steps] * len(prompts), runner.model.config.vocab_size, seed=3)
    steps = []
    for i in range(decode_steps):
        entries = [StepEntry((toks[i],), len(s), t) for s, toks, t in zip(seqs, new_tokens, tables, strict=True)]
        for s, toks in zip(seqs, new_tokens, strict=True):
            s.append(toks[i])
        steps.append(runner.execute(entries, None))
    for j, (seq, prompt) in enumerate(zip(seqs, prompts, strict=True)):
        ref = hf_logits(hf, seq)[len(prompt):]  # [decode_steps, vocab]
        assert_logits_close(torch.stack([s[j] for s in steps]), ref)


def test_greedy_generation_matches_hf_generate(tiny_model: Path) -> None:
    """Tokens and every step's logits (tied-embedding tiny models tend to repeat one token, so the
    logits are what makes this discriminating)."""
    runner, hf = make_runner(tiny_model), hf_model(tiny_model)
    prompts = random_prompts([5, 11, 3], runner.model.config.vocab_size, seed=4)
    ours, step_logits = greedy(runner, prompts, 16, ShuffledBlocks(runner, seed=5))
    eos = set(runner.model.config.eos_token_ids)
    for j, (prompt, out) in enumerate(zip(prompts, ours, strict=True)):
        with torch.inference_mode():
            gen = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, output_logits=True,
                              return_dict_in_generate=True)
        ref = gen.sequences[0, len(prompt):].tolist()
        assert out[: len(ref)] == ref
        assert len(ref) == 16 or ref[-1] in eos  # HF stops at EOS; we decode on
        for ours_step, ref_step in zip(step_logits, gen.logits, strict=False):
            assert_logits_close(ours_step[j], ref_step[0])


@pytest.mark.parametrize("rope_type", ["default", "linear", "dynamic", "llama3"])
def test_rotary_frequencies_match_hf(rope_type: str) -> None:
    """cos/sin of one sequence, positions past max_position_embeddings included."""
    scaling = {"linear": {"rope_type": "linear", "factor": 2.0},
               "dynamic": {"rope_type": "dynamic", "factor": 3.0},
               "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 16}}.get(rope_type)
    hf_cfg = tiny_config("llama", head_dim=32, max_position_embeddings=48, rope_theta=5000.0,
                         rope_scaling=scaling)
    ours = RotaryEmbedding(ModelConfig.from_hf(hf_cfg.to_dict()), "cpu")
    for seq_len in (20, 48, 100):
        ref_rope = LlamaRotaryEmbedding(AutoConfig.for_model(**hf_cfg.to_dict()))  # fresh: HF dynamic is stateful
        positions = torch.arange(seq_len)
        cos_ref, sin_ref = ref_rope(torch.zeros(1), positions[None])  # [1, L, d]
        cos, signed_sin = ours.cos_sin(positions, torch.full((seq_len,), seq_len), torch.float32)
        half = cos.shape[-1] // 2
        torch.testing.assert_close(cos[:, 0], cos_ref[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(signed_sin[:, 0, half:], sin_ref[0, :, half:], rtol=0, atol=1e-6)
        torch.testing.assert_close(signed_sin[:, 0, :half], -sin_ref[0, :, :half], rtol=0, atol=1e-6)


@pytest.mark.parametrize("scaling", [{"rope_type": "linear", "factor": 2.0},
                                     {"rope_type": "dynamic", "factor": 2.0}], ids=["linear", "dynamic"])
def test_scaled_rope_models_match_hf_past_max_positions(scaling: dict, tmp_path: Path) -> None:
    """A 30-token prompt and 16 greedy tokens on a model with max_position_embeddings=32: dynamic NTK
    rescales from the prompt on (HF generate recomputes per step; so do we, per sequence)."""
    folder = write_tiny_model(tmp_path, "llama", max_position_embeddings=32, rope_scaling=scaling)
    runner = make_runner(folder)
    prompt = random_prompts([30], runner.model.config.vocab_size, seed=6)[0]
    (ours,), step_logits = greedy(runner, [prompt], 16, ShuffledBlocks(runner, seed=7))
    hf = hf_model(folder)
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, output_logits=True,
                          return_dict_in_generate=True)
    ref = out.sequences[0, len(prompt):].tolist()
    assert ours[: len(ref)] == ref
    for ours_step, ref_step in zip(step_logits, out.logits, strict=False):
        assert_logits_close(ours_step[0], ref_step[0])


@pytest.mark.slow
def test_smollm2_matches_hf() -> None:
    """The real checkpoint: ragged prefill of chat-length prompts, then 8 greedy steps; logits and tokens."""
    folder = embedded_checkpoint()
    runner, hf = make_runner(folder, num_blocks=64, block_size=16), hf_model(folder)
    prompts = random_prompts([37, 9, 58], runner.model.config.vocab_size, seed=8)
    ours, step_logits = greedy(runner, prompts, 8, ShuffledBlocks(runner, seed=9))
    for j, (prompt, out) in enumerate(zip(prompts, ours, strict=True)):
        ref = hf_logits(hf, prompt + out)[len(prompt) - 1 : -1]  # [8, vocab]
        assert ref.argmax(-1).tolist() == out
        assert_logits_close(torch.stack([s[j] for s in step_logits]), ref)
