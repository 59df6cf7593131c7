"""Sampling: greedy, top-k, top-p, min-p against explicit reference distributions, alone and mixed in one
batch; seeded reproducibility."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from loraplex import LLM, RequestError, SamplingParams
from loraplex.engine.sampling.logits_processors import ProcessorState
from loraplex.engine.sampling.sampler import sample


@dataclass
class Row:
    """What the sampler reads of a request."""

    params: SamplingParams
    generator: torch.Generator = field(default_factory=torch.Generator)
    prompt_token_ids: list[int] = field(default_factory=lambda: [0])
    output_token_ids: list[int] = field(default_factory=list)
    processor_state: ProcessorState | None = None


def draws(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    """``n`` draws: one batch of ``n`` copies of the row sharing one generator."""
    generator = torch.Generator().manual_seed(seed)
    return torch.tensor(sample(logits.expand(n, -1).clone(), [Row(params, generator) for _ in range(n)]))


def test_greedy_is_argmax_per_row() -> None:
    logits = torch.randn(5, 100)
    rows = [Row(SamplingParams(temperature=0.0)) for _ in range(5)]
    assert sample(logits.clone(), rows) == logits.argmax(-1).tolist()


def nucleus_reference(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    probs = torch.softmax(logits.double(), -1)
    nucleus, mass = [], 0.0
    for i in torch.argsort(probs, descending=True).tolist():
        if mass >= top_p:
            break
        nucleus.append(i)
        mass += float(probs[i])
    expected = torch.zeros_like(probs)
    expected[nucleus] = probs[nucleus] / probs[nucleus].sum()
    return expected


def test_mixed_warpers_in_one_batch_match_their_references() -> None:
    """Rows with top-k, top-p, min-p, a temperature and a greedy row share each call: every row's empirical
    frequencies match its own reference distribution (computed independently, in float64)."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0, -3.0]] * 5)
    logits[3] = torch.tensor([0.5, 3.0, 1.0, 2.5, -1.0, 0.0])
    shared = torch.Generator().manual_seed(1)  # unseeded rows share the engine's generator
    params = [SamplingParams(top_k=3), SamplingParams(top_p=0.8), SamplingParams(min_p=0.3, temperature=0.5),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.7)]
    probs = torch.softmax(logits.double(), -1)
    top3 = torch.where(torch.arange(6) < 3, probs[0], 0.0)
    cold = torch.softmax(logits[2].double() / 0.5, -1)
    cold_kept = torch.where(cold >= 0.3 * cold.max(), cold, 0.0)
    expected = [top3 / top3.sum(), nucleus_reference(logits[1], 0.8), cold_kept / cold_kept.sum(),
                torch.nn.functional.one_hot(logits[3].argmax(), 6).double(),
                torch.softmax(logits[4].double() / 1.7, -1)]
    n = 4000  # copies of the five rows in one batch; a few seeded rows have their own generators
    rows = [Row(p, torch.Generator().manual_seed(j) if j % 500 == 0 else shared) for j in range(n) for p in params]
    chosen = torch.tensor(sample(logits.repeat(n, 1), rows)).view(n, 5)
    counts = torch.stack([torch.bincount(chosen[:, i], minlength=6) for i in range(5)]).double()
    for i in range(5):
        assert torch.allclose(counts[i] / n, expected[i], atol=0.03), (i, counts[i] / n, expected[i])


def test_top_k_one_equals_greedy() -> None:
    logits = torch.randn(50)
    assert set(draws(logits, SamplingParams(temperature=1.5, top_k=1), 20).tolist()) == {int(logits.argmax())}


def test_top_k_restricts_support() -> None:
    logits = torch.randn(64)
    allowed = set(torch.topk(logits, 5).indices.tolist())
    assert set(draws(logits, SamplingParams(temperature=2.0, top_k=5), 300).tolist()) <= allowed


def test_top_p_matches_nucleus_reference() -> None:
    """Empirical frequencies match the renormalised nucleus distribution computed independently."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -3.0])
    top_p = 0.8
    expected = nucleus_reference(logits, top_p)
    n = 6000
    got = torch.bincount(draws(logits, SamplingParams(top_p=top_p), n), minlength=6).double() / n
    assert torch.allclose(got, expected, atol=0.03)


def test_temperature_sharpens() -> None:
    logits = torch.tensor([1.0, 0.0, -1.0])
    cold = (draws(logits, SamplingParams(temperature=0.3), 2000) == 0).double().mean()
    hot = (draws(logits, SamplingParams(temperature=1.5), 2000) == 0).double().mean()
    assert cold > 0.9 > hot


@pytest.mark.parametrize(("field", "value"), [
    ("max_tokens", -1), ("temperature", -0.1), ("temperature", 2.5), ("top_p", 0.0), ("top_p", 1.2), ("top_k", -1),
    ("min_p", 1.5), ("n", 0), ("n", 129), ("logprobs", 21), ("logprobs", -1), ("prompt_logprobs", 21),
    ("presence_penalty", 2.5), ("frequency_penalty", -2.1), ("repetition_penalty", 0.0), ("min_tokens", -1),
    ("logit_bias", {5: 101.0}), ("logit_bias", {-1: 1.0}), ("logit_bias", {100: 1.0}), ("stop_token_ids", [100]),
    ("temperature", float("nan")), ("max_tokens", True)])
def test_invalid_params_name_the_field(field: str, value: object) -> None:
    with pytest.raises(RequestError) as err:
        SamplingParams(**{field: value}).validate(vocab_size=100)
    assert err.value.param == field


def test_seeded_sampling_reproducible_across_batches(tiny_llama: Path) -> None:
    llm = LLM(model=str(tiny_llama), kv_cache_blocks=128)
    seeded = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate(["hello there"], seeded)[0].token_ids
    other = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    batch = llm.generate(["a different prompt", "hello there", "third"], [other, seeded, other])
    assert batch[1].token_ids == alone
    different_seed = llm.generate(["hello there"], SamplingParams(max_tokens=10, seed=99, ignore_eos=True))
    assert different_seed[0].token_ids != alone


def test_top_k_one_generation_equals_greedy(tiny_llama: Path) -> None:
    llm = LLM(model=str(tiny_llama), kv_cache_blocks=128)
    greedy = llm.generate(["count to ten"], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    topk1 = llm.generate(["count to ten"], SamplingParams(max_tokens=12, temperature=1.3, top_k=1, ignore_eos=True))
    assert greedy[0].token_ids == topk1[0].token_ids
