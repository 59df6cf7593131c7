"""``lora_scale`` and ``adapter_mix`` over real HTTP, with the engine in this process and in its own process:
completions equal HF + PEFT (a scale against PEFT's weighted ``cat`` adapter, scale 0 against the base, a blend
against PEFT's ``cat`` blend), all sent at once so they share steps, with prefix caching on; chat takes the
same fields; and each refused plan is a 4xx naming its field."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from tests.conftest import make_adapters
from tests.reference import with_adapter, with_mix
from tests.server_harness import BASE, MODES, Server, tiny_server, wait_until_idle

MAX_TOKENS = 6
HEADER = "x-loraplex-adapter-version"
MIX = [{"name": "r8_all", "scale": 0.7}, {"name": "r16_mlp", "scale": 1.2}]


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_adapters(tiny_llama, tmp_path_factory.mktemp("mix-http-adapters"))


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    rng = random.Random(17)
    return [rng.randrange(3, 49152) for _ in range(18)]


@pytest.fixture(scope="module")
def references(tiny_llama: Path, adapters: dict[str, Path], prompt: list[int]) -> dict[str, str]:
    """Each case's expected text: HF + PEFT token ids, decoded by the base tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    ids = {"base": with_adapter(tiny_llama, None, [prompt], MAX_TOKENS)[0],
           "plain": with_adapter(tiny_llama, adapters["r8_all"], [prompt], MAX_TOKENS)[0],
           "half": with_mix(tiny_llama, [(adapters["r8_all"], 0.5)], [prompt], MAX_TOKENS)[0],
           "mix": with_mix(tiny_llama, [(adapters[e["name"]], e["scale"]) for e in MIX], [prompt], MAX_TOKENS)[0]}
    return {case: tokenizer.decode(tokens) for case, tokens in ids.items()}


def complete(server: Server, **fields: object) -> httpx.Response:
    body = {"prompt": fields.pop("prompt"), "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **fields}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)


@pytest.mark.parametrize("mode", MODES)
def test_scales_and_mixes_over_http(mode: str, tiny_llama: Path, adapters: dict[str, Path], prompt: list[int],
                                    references: dict[str, str], tmp_path: Path) -> None:
    with tiny_server(tiny_llama, adapters, tuple(adapters), (), tmp_path, mode=mode, max_loras=3,
                     kv_cache_blocks=128, block_size=4, debug_checks=True) as server:
        cases = [("base", {"model": BASE}), ("plain", {"model": "r8_all"}),
                 ("plain", {"model": "r8_all", "lora_scale": 1}), ("base", {"model": "r8_all", "lora_scale": 0}),
                 ("half", {"model": "r8_all", "lora_scale": 0.5}), ("mix", {"model": BASE, "adapter_mix": MIX})]
        for _ in range(2):  # the second round finds every case's blocks cached
            with ThreadPoolExecutor(len(cases)) as pool:
                answers = list(pool.map(lambda case: complete(server, prompt=prompt, **case[1]), cases))
            for (case, fields), answer in zip(cases, answers, strict=True):
                assert answer.status_code == 200, (fields, answer.text)
                assert answer.json()["choices"][0]["text"] == references[case], fields
        assert answers[-1].headers[HEADER].count("+") == 1 and answers[-1].headers[HEADER].startswith("v")
        assert answers[-2].headers[HEADER] == answers[1].headers[HEADER]  # a scale keeps the version's header
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_TOKENS, "temperature": 0}
        texts = [httpx.post(f"{server.url}/v1/chat/completions", json={**chat, **fields}, timeout=60).json()
                 ["choices"][0]["message"]["content"]
                 for fields in ({"model": BASE}, {"model": "r8_all", "lora_scale": 0.0},
                                {"model": BASE, "adapter_mix": [{"name": "r8_all", "scale": 0}]})]
        assert texts[0] == texts[1] == texts[2]
        refused = [({"model": "r8_all", "lora_scale": -1}, 400, "lora_scale"),
                   ({"model": BASE, "lora_scale": 0.5}, 400, "lora_scale"),
                   ({"model": "r8_all", "adapter_mix": MIX}, 400, "adapter_mix"),
                   ({"model": BASE, "adapter_mix": MIX, "lora_scale": 2}, 400, "lora_scale"),
                   ({"model": BASE, "adapter_mix": [*MIX, {"name": "nope", "scale": 1}]}, 404, "adapter_mix"),
                   ({"model": BASE, "adapter_mix": [{"name": n, "scale": 1} for n in adapters]}, 400, "adapter_mix"),
                   ({"model": BASE, "adapter_mix": [{"name": "r8_all", "scale": 1, "weight": 2}]}, 400, None)]
        for fields, status, param in refused:
            answer = complete(server, prompt=prompt, **fields)
            assert answer.status_code == status, (fields, answer.text)
            if param is not None:
                assert answer.json()["error"]["param"] == param, (fields, answer.text)
        wait_until_idle(server.engine_client)
        metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
        assert 'loraplex_requests_total{adapter="r16_mlp+r8_all",status="length"}' in metrics  # its members, sorted


def test_blend_labels_are_their_members_and_bounded() -> None:
    """A blend of loaded adapters is labelled by its members (sorted); past ``MAX_MIX_LABELS`` blends with series,
    the rest share ``mix``; a blend with an unloaded member is ``unknown``, and unloading a member drops its blends'
    series."""
    from prometheus_client import CollectorRegistry, Counter

    from loraplex.server.metric_labels import MAX_MIX_LABELS, MIX_LABEL, UNKNOWN_LABEL, AdapterLabels

    loaded = {f"a{i}" for i in range(12)}
    labels = AdapterLabels(loaded.__contains__)
    counter = Counter("requests", "requests", ["adapter"], registry=CollectorRegistry())
    assert labels.label("a3+a1") == "a1+a3" and labels.label("a1+nope") == UNKNOWN_LABEL
    blends = [f"a{i}+a{j}" for i in range(12) for j in range(i + 1, 12)]
    seen = set()
    for blend in blends:
        label = labels.label(blend)
        labels.child(counter, label).inc()
        seen.add(label)
    assert len(seen - {MIX_LABEL}) == MAX_MIX_LABELS and MIX_LABEL in seen
    loaded.discard("a0")
    labels.prune()
    assert not any("a0+" in name for name in labels.names()) and MIX_LABEL in labels.names()
