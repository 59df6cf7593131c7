"""lm-eval's ``local-completions`` model against ``loraplex serve``, with ``tokenizer_backend=remote`` (the
tokenizer read over ``/tokenizer_info`` and ``/tokenize``): its log-likelihoods (and greedy flags) equal HF +
PEFT's on the base model and on an adapter, to 5e-5, asked directly (lm-eval's ``Instance`` objects) and
through ``simple_evaluate`` on a small local multiple-choice task (whose accuracy is then HF's)."""

from __future__ import annotations

import json
from pathlib import Path

import lm_eval
import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.models.openai_completions import LocalCompletionsAPI
from transformers import AutoTokenizer

from tests.clients.conftest import ADAPTER, Served
from tests.reference import hf_model

PAIRS = [("The capital of France is", " Paris"), ("Once upon a time", " there was a king"),
         ("2 + 2 =", " 4")]


@torch.inference_mode()
def hf_loglikelihood(model: Path, adapter: Path | None, context: str, continuation: str) -> tuple[float, bool]:
    """Sum of the continuation's token log-probabilities after the context, and whether each was the argmax.
    Split as lm-eval does: the whole text encoded once, the context's own encoding as the cut."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    cut = len(tokenizer.encode(context, add_special_tokens=False))
    lm = hf_model(model, adapter)
    logprobs = torch.log_softmax(lm(torch.tensor([whole])).logits[0].double(), dim=-1)
    targets = torch.tensor(whole[cut:])
    rows = logprobs[cut - 1: len(whole) - 1]
    if adapter is not None:
        lm.unload()
    return float(rows.gather(1, targets[:, None]).sum()), bool((rows.argmax(-1) == targets).all())


@pytest.mark.parametrize("adapter", [False, True])
def test_loglikelihood_equals_hf_peft(served: Served, adapter: bool) -> None:
    name = ADAPTER if adapter else served.base
    lm = LocalCompletionsAPI(base_url=f"{served.v1}/completions", model=name, tokenizer_backend="remote",
                             num_concurrent=1, max_retries=1, max_length=64)
    assert lm.tokenizer_backend == "remote"
    requests = [Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i)
                for i, pair in enumerate(PAIRS)]
    got = lm.loglikelihood(requests, disable_tqdm=True)
    for (context, continuation), (logprob, greedy) in zip(PAIRS, got, strict=True):
        expected, expected_greedy = hf_loglikelihood(served.model, served.adapter if adapter else None, context,
                                                     continuation)
        assert logprob == pytest.approx(expected, abs=5e-5), (context, continuation)
        assert greedy == expected_greedy


def test_a_local_task_through_simple_evaluate(served: Served, tmp_path: Path) -> None:
    docs = [{"q": "The capital of France is", "choices": [" Paris", " Rome"], "label": 0},
            {"q": "2 + 2 =", "choices": [" 4", " 5"], "label": 1}]
    data = tmp_path / "docs.jsonl"
    data.write_text("\n".join(json.dumps(doc) for doc in docs))
    task = {"task": "tiny_mc", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "{{q}}",
            "doc_to_choice": "{{choices}}", "doc_to_target": "label", "target_delimiter": "",
            "metric_list": [{"metric": "acc"}]}
    args = f"base_url={served.v1}/completions,model={ADAPTER},tokenizer_backend=remote,num_concurrent=1,max_retries=1"
    out = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=[task], log_samples=True)
    right = 0
    for doc, sample in zip(docs, out["samples"]["tiny_mc"], strict=True):
        expected = [hf_loglikelihood(served.model, served.adapter, doc["q"], c)[0] for c in doc["choices"]]
        got = [resp[0][0] for resp in sample["resps"]]
        assert got == pytest.approx(expected, abs=5e-5)
        right += max(range(len(expected)), key=expected.__getitem__) == doc["label"]
    assert out["results"]["tiny_mc"]["acc,none"] == right / len(docs)
