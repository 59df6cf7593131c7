"""Speculative decoding over HTTP, with the engine in the server's process and in its own (the config crosses to
the engine process): completions and chat equal plain decoding's, streamed or not, with stop strings cut where
plain decoding cuts them; the per-request opt-out; vLLM's spec-decode metrics and the per-adapter acceptance."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loraplex import LLM, SamplingParams
from tests.server_harness import MODES, Server, tiny_server

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
CONFIG = dict(max_loras=2, max_cpu_loras=2, max_lora_rank=8, kv_cache_blocks=256, block_size=4)
PROMPTS = ["one two three one two three one two three one", "red blue red blue red blue", "x y z x y z x y"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def plain(tiny_llama: Path, tiny_llama_adapters: dict[str, Path]) -> dict[tuple[str, str | None], str]:
    """(prompt, adapter) -> the text plain greedy decoding generates."""
    llm = LLM(model=str(tiny_llama), **CONFIG)
    llm.load_adapter("r8_all", tiny_llama_adapters["r8_all"])
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return {(p, a): llm.generate([p], greedy, adapters=[a], use_tqdm=False)[0].text
            for p in PROMPTS for a in ("r8_all", None)}


@pytest.fixture(scope="module", params=MODES)
def server(request: pytest.FixtureRequest, tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with tiny_server(tiny_llama, tiny_llama_adapters, ("r8_all",), (), tmp_path_factory.mktemp("root"),
                     mode=request.param, speculative_config=SPEC, **CONFIG) as srv:
        yield srv


def complete(server: Server, model: str, prompt: str, **fields: object) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            **fields}
    if not fields.get("stream"):
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        return "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                       if line.startswith("data: {") and json.loads(line[6:])["choices"])


def test_outputs_equal_plain_decoding_streamed_or_not(server: Server, plain: dict) -> None:
    before = server.stats().spec_decode_num_accepted_tokens
    for (prompt, adapter), text in plain.items():
        model = adapter or "tiny"
        assert complete(server, model, prompt) == text
        assert complete(server, model, prompt, stream=True) == text
        assert complete(server, model, prompt, speculative_decoding=False) == text
    assert server.stats().spec_decode_num_accepted_tokens > before, "drafts were accepted"


def test_a_stop_string_inside_an_accepted_run_cuts_where_plain_decoding_does(server: Server, plain: dict) -> None:
    for (prompt, adapter), text in plain.items():
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        if not stop.strip():
            continue
        expected = text[: text.index(stop)]
        assert complete(server, adapter or "tiny", prompt, stop=[stop]) == expected
        assert complete(server, adapter or "tiny", prompt, stop=[stop], stream=True) == expected


def test_the_opt_out_is_a_boolean_and_documented(server: Server) -> None:
    r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": "a", "max_tokens": 2, "speculative_decoding": "no"})
    assert r.status_code == 400 and "speculative_decoding" in r.text, r.text
    schema = httpx.get(f"{server.url}/openapi.json", timeout=60).json()["components"]["schemas"]
    for body in ("CompletionRequest", "ChatCompletionRequest"):
        assert "speculative_decoding" in schema[body]["properties"], body


def test_metrics_count_drafts_and_acceptance_per_adapter(server: Server, plain: dict) -> None:
    complete(server, "r8_all", PROMPTS[0])
    text = httpx.get(f"{server.url}/metrics", timeout=60).text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    drafted, accepted = values["vllm:spec_decode_num_draft_tokens_total"], values[
        "vllm:spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted <= drafted
    assert values['loraplex_adapter_spec_decode_draft_tokens_total{adapter="r8_all"}'] > 0
    rate = values['loraplex_adapter_spec_decode_acceptance_rate{adapter="r8_all"}']
    assert 0 < rate <= 1
