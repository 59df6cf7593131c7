"""The load generator's request bodies (llama.cpp's per-request ``lora`` list) and the scaling benchmark's
Zipf draws, against values written out by hand."""

from __future__ import annotations

import random
from collections import Counter

from benchmarks.peers import loadgen
from benchmarks.scale.adapters import zipf


def test_llamacpp_body_names_the_adapter_by_its_lora_id():
    body = loadgen.request_body("a2", [5, 6], 3, {"a1": 0, "a2": 7})
    assert body["lora"] == [{"id": 7, "scale": 1.0}]
    assert body["model"] == "llamacpp" and body["cache_prompt"] is False
    assert body["prompt"] == [5, 6] and body["max_tokens"] == 3 and body["temperature"] == 0.0


def test_llamacpp_body_for_the_base_model_has_an_empty_lora_list():
    assert loadgen.request_body("smollm2-135m-instruct", [1], 2, {"a1": 0})["lora"] == []


def test_openai_body_names_the_adapter_as_its_model():
    body = loadgen.request_body("a2", [1], 2, None)
    assert body["model"] == "a2" and "lora" not in body and "cache_prompt" not in body


def test_zipf_draws_follow_one_over_rank():
    names = ["a0", "a1", "a2", "a3"]
    counts = Counter(zipf(names, 40_000, random.Random(0)))
    harmonic = 1 + 1 / 2 + 1 / 3 + 1 / 4
    for k, name in enumerate(names):
        assert abs(counts[name] / 40_000 - (1 / (k + 1)) / harmonic) < 0.01


def test_llamacpp_base_body_turns_the_slot_prompt_cache_off():
    body = loadgen.request_body("llamacpp", [1], 2, {})
    assert body["lora"] == [] and body["cache_prompt"] is False
