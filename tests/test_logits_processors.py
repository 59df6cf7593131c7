"""Penalties, logit bias and min_tokens: the vectorised processors against a float64 loop of the documented
formulas, and greedy generation in a mixed-adapter batch against HF ``generate`` with the matching logits
processors, token for token."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from loraplex import LLM, SamplingParams
from loraplex.engine.sampling.logits_processors import apply_logits_processors
from tests.reference import hf_model
from tests.test_sampling import Row

EOS = 2  # the tiny models' EOS id


def reference(logits: torch.Tensor, row: Row, eos: set[int]) -> torch.Tensor:
    """The formulas in ``apply_logits_processors``'s docstring, one token at a time, in float64."""
    x, p = logits.double().clone(), row.params
    for t in set(row.prompt_token_ids + row.output_token_ids):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(row.output_token_ids):
        x[t] -= p.frequency_penalty * row.output_token_ids.count(t) + p.presence_penalty
    for t, bias in p.logit_bias.items():
        x[t] += bias
    if len(row.output_token_ids) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else eos):
            x[t] = float("-inf")
    return x


def random_params(rng: random.Random, vocab: int) -> SamplingParams:
    pick = rng.random
    return SamplingParams(
        max_tokens=20,
        repetition_penalty=rng.choice([1.0, rng.uniform(0.5, 2.0)]),
        presence_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
        frequency_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
        logit_bias={rng.randrange(vocab): rng.uniform(-100, 100) for _ in range(rng.randrange(4))} if pick() < .5
        else {},
        min_tokens=rng.choice([0, rng.randrange(1, 12)]),
        stop_token_ids=tuple(rng.sample(range(vocab), 2)) if pick() < 0.5 else (),
        ignore_eos=pick() < 0.3,
    )


@pytest.mark.parametrize("seed", range(4))
def test_processors_equal_float64_loop(seed: int) -> None:
    """Random rows (some without processors), random histories with repeats, over several steps so the
    per-request token tensors are extended incrementally."""
    rng, vocab = random.Random(seed), 40
    rows = [Row(random_params(rng, vocab), prompt_token_ids=[rng.randrange(vocab) for _ in range(rng.randint(1, 9))])
            for _ in range(12)]
    for _ in range(3):
        for row in rows:
            row.output_token_ids += [rng.randrange(vocab) for _ in range(rng.randint(0, 5))]
        logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(seed))
        ours = logits.clone()
        apply_logits_processors(ours, rows, {EOS})
        for i, row in enumerate(rows):
            torch.testing.assert_close(ours[i].double(), reference(logits[i], row, {EOS}), rtol=1e-6, atol=1e-5)


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties over the generated tokens (HF has none)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids[0, self.prompt_len:].tolist()
        for t in set(generated):
            scores[0, t] -= self.frequency * generated.count(t) + self.presence
        return scores


def hf_processors(params: SamplingParams, prompt_len: int) -> LogitsProcessorList:
    """The HF logits processors matching ``params``, in loraplex's order."""
    procs = LogitsProcessorList()
    if params.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.presence_penalty or params.frequency_penalty:
        procs.append(OpenAIPenalties(prompt_len, params.presence_penalty, params.frequency_penalty))
    if params.logit_bias:
        procs.append(SequenceBiasLogitsProcessor({(t,): b for t, b in params.logit_bias.items()}))
    if params.min_tokens:
        procs.append(MinNewTokensLengthLogitsProcessor(prompt_len, params.min_tokens, EOS))
    return procs


CASES = [
    SamplingParams(),
    SamplingParams(repetition_penalty=1.4),
    SamplingParams(repetition_penalty=0.7),
    SamplingParams(presence_penalty=1.5, frequency_penalty=0.4),
    SamplingParams(frequency_penalty=1.2),
    SamplingParams(presence_penalty=-1.0, repetition_penalty=1.2),
    SamplingParams(logit_bias={100: 8.0, 200: 6.0, 300: -100.0}),
    SamplingParams(min_tokens=5, logit_bias={EOS: 100.0}),  # EOS forced, but only after 5 tokens
]


def test_greedy_with_processors_equals_hf_generate(tiny_llama: Path, tiny_llama_adapters: dict[str, Path]) -> None:
    """Every case in one batch, each on several adapters and the base model: tokens equal HF + PEFT
    ``generate`` with the matching logits processors."""
    llm = LLM(model=str(tiny_llama), max_loras=4, max_lora_rank=16, kv_cache_blocks=256)
    names = ["r8_all", "r4_attn", None]
    for name in names[:-1]:
        llm.load_adapter(name, tiny_llama_adapters[name])
    rng = random.Random(5)
    jobs = [(case, name, [rng.randrange(3, 49152) for _ in range(rng.randint(3, 12))])
            for case in CASES for name in names]
    params = [replace(case, max_tokens=12, temperature=0.0, ignore_eos=not case.min_tokens) for case, _, _ in jobs]
    prompts, adapters = [p for *_, p in jobs], [n for _, n, _ in jobs]
    outs = llm.generate(prompts, params, adapters=adapters, use_tqdm=False)
    for name in names:
        model = hf_model(tiny_llama, tiny_llama_adapters.get(name))
        for (case, job_name, prompt), p, out in zip(jobs, params, outs, strict=True):
            if job_name != name:
                continue
            expected = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                      logits_processor=hf_processors(p, len(prompt)), pad_token_id=0,
                                      eos_token_id=None if p.ignore_eos else EOS)[0, len(prompt):].tolist()
            assert out.token_ids == expected, (case, name)
        if name is not None:
            model.unload()
    # Guards: the min_tokens case stops right after its 5 tokens; each case changes some plain greedy output.
    assert [len(o.token_ids) for o in outs[-len(names):]] == [6] * len(names)
    plain = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), adapters=adapters,
                         use_tqdm=False)
    changed = {CASES.index(case) for (case, *_), o, q in zip(jobs, outs, plain, strict=True)
               if o.token_ids != q.token_ids}
    assert changed == set(range(1, len(CASES))), f"only cases {changed} changed an output"
