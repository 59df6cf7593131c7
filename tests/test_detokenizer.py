"""Incremental detokenization and stop strings, against the tokenizer's one-shot decode."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from loraplex import LLM, SamplingParams
from loraplex.client.output import IncrementalDetokenizer

TEXTS = ["Hello, world! Ünïcödé façade — 日本語のテキスト 🙂 done.", "  leading spaces\nnew line\ttab", "a"]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path):  # noqa: ANN201
    return AutoTokenizer.from_pretrained(tiny_llama)


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_full_decode(tokenizer, text: str) -> None:  # noqa: ANN001
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = []
    for t in ids:
        assert not detok.add(t)
        deltas.append(detok.pop_delta(finished=False))
    deltas.append(detok.pop_delta(finished=True))
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_cuts_and_is_never_streamed(tokenizer) -> None:  # noqa: ANN001
    text = "The answer is 42. STOP here and more text"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=("STOP",))
    streamed = ""
    for t in ids:
        hit = detok.add(t)
        streamed += detok.pop_delta(finished=hit)
        if hit:
            break
    assert hit
    assert detok.text == "The answer is 42. "
    assert streamed == detok.text


def test_stop_string_in_generation(tiny_llama: Path) -> None:
    llm = LLM(model=str(tiny_llama), kv_cache_blocks=64)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    full = llm.generate(["tell me something"], params)[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    cut = llm.generate(["tell me something"], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                             stop=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.find(stop)]


def test_stop_token_ids(tiny_llama: Path) -> None:
    llm = LLM(model=str(tiny_llama), kv_cache_blocks=64)
    full = llm.generate(["x y z"], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    stop_id = full.token_ids[4]
    first = full.token_ids.index(stop_id)
    cut = llm.generate(["x y z"], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                                 stop_token_ids=[stop_id]))[0]
    assert cut.token_ids == full.token_ids[: first + 1]
    assert cut.finish_reason == "stop"
