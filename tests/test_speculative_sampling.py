"""The rejection rule of sampled speculative decoding draws every token from exactly the distribution plain
sampling draws it from: chi-square tests of ``accept_drafts`` on a tiny vocabulary against the probabilities
computed in float64 from the logits (temperature, top-k, top-p), for the first token of a run and for the
token after an accepted draft token; and a greedy row keeps the longest matching prefix."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex import LLM
from loraplex.engine.sampling.params import SamplingParams
from loraplex.engine.speculative.verify import accept_drafts
from tests.fixtures import write_tiny_model
from tests.reference import hf_model

VOCAB = 6
SAMPLES = 3000
CHI2_CRITICAL = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74, 6: 27.86, 7: 29.88}  # P(chi2_df > x) = 1e-4


@dataclass
class Row:
    """What ``accept_drafts`` reads of a request."""

    params: SamplingParams
    generator: torch.Generator


def exact_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """float64 reference of the sampler's distribution: softmax(l / T), top-k, then top-p (smallest set)."""
    p = torch.softmax(logits.double() / params.temperature, dim=-1)
    if params.top_k:
        p[p < torch.topk(p, params.top_k).values[-1]] = 0.0
    order = torch.argsort(p, descending=True)
    mass = torch.cumsum(p[order], 0) - p[order]
    p[order[mass >= params.top_p]] = 0.0
    return p / p.sum()


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    support = probs > 0
    assert counts[~support].sum() == 0, "a token of probability 0 was drawn"
    expected = probs[support] * counts.sum()
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


def draw_runs(logits: torch.Tensor, draft: list[int], params: SamplingParams, n: int) -> list[list[int]]:
    rows = [Row(params, torch.Generator().manual_seed(0))] * n
    stacked = logits.repeat(n, 1)  # [n * (k + 1), vocab]
    firsts = [i * (len(draft) + 1) for i in range(n)]
    return accept_drafts(stacked, firsts, [draft] * n, rows)


def test_sampled_runs_follow_the_plain_sampling_distribution() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, VOCAB, generator=g) * 1.5  # rows for positions 0, 1, 2 of a 2-token draft
    likely, unlikely = int(logits[0].argmax()), int(logits[0].argmin())
    for params, draft in ((SamplingParams(temperature=1.0), [likely, 3]),
                          (SamplingParams(temperature=0.7, top_k=5, top_p=0.8), [likely, 1]),
                          (SamplingParams(temperature=1.3, top_p=0.9), [unlikely, 2])):
        runs = draw_runs(logits, draft, params, SAMPLES)
        firsts = torch.bincount(torch.tensor([r[0] for r in runs]), minlength=VOCAB).double()
        stat, df = chi_square(firsts, exact_probs(logits[0], params))
        assert stat < CHI2_CRITICAL[df], (params, stat)
        # after the first draft token is accepted, the next token follows row 1's distribution
        if draft[0] == likely:
            seconds = torch.bincount(torch.tensor([r[1] for r in runs if r[0] == draft[0] and len(r) > 1]),
                                     minlength=VOCAB).double()
            assert seconds.sum() > 500
            stat, df = chi_square(seconds, exact_probs(logits[1], params))
            assert stat < CHI2_CRITICAL[df], (params, stat)
        assert all(len(r) <= 3 and r[: len(r) - 1] == draft[: len(r) - 1] for r in runs)


def test_greedy_rows_keep_the_longest_matching_prefix_then_the_argmax() -> None:
    logits = torch.full((4, VOCAB), -1.0)
    for position, best in enumerate([2, 5, 1, 4]):
        logits[position, best] = 3.0
    greedy = SamplingParams(temperature=0.0)
    rows = [Row(greedy, torch.Generator())] * 3
    firsts = [0, 0, 0]
    assert accept_drafts(logits, firsts, [[2, 5, 1], [2, 0, 1], [3, 5, 1]], rows) == [[2, 5, 1, 4], [2, 5], [2]]


def test_an_engine_samples_what_plain_sampling_samples(tmp_path: Path) -> None:
    """A tiny model with an 8-token vocabulary, a prompt full of repeats (every step drafts): the first and
    second tokens of many sampled requests, speculation on, against HF's exact probabilities (the second's
    marginal: sum over x1 of p(x1) p(x2 | x1))."""
    folder = write_tiny_model(tmp_path / "v8", "llama", seed=3, vocab_size=8)
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    llm = LLM(model=str(folder), kv_cache_blocks=4096, block_size=4, max_num_seqs=256, debug_checks=False,
              speculative_config={"num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 1,
                                  "disable_by_batch_size": 256})
    outs = llm.generate([prompt] * 1500, SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True),
                        use_tqdm=False)
    totals = llm.engine.scheduler.speculator.totals
    assert 0 < totals.accepted_tokens < totals.draft_tokens
    hf = hf_model(folder, None)
    with torch.inference_mode():
        p1 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1].double(), -1)  # [8]
        p2 = torch.softmax(hf(torch.tensor([prompt + [x] for x in range(8)])).logits[:, -1].double(), -1)  # [8, 8]
    for position, exact in ((0, p1), (1, p1 @ p2)):
        counts = torch.bincount(torch.tensor([o.token_ids[position] for o in outs]), minlength=8).double()
        stat, df = chi_square(counts, exact)
        assert stat < CHI2_CRITICAL[df], (position, stat)
