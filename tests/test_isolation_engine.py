"""Issue 30, the engine half: a fault stays in its row.

An adapter whose weights pass the load-time bound (``adapters/reading/overflow_bound.py``) can still overflow
float32 in a step: the bound assumes down_proj's input stays below 2^64, and ``write_overflowing_adapter``
breaks that assumption. Its requests must fail alone (an error naming the non-finite logits), while every
other row of the same step is committed and equals HF + PEFT (in the engine) or the request run alone (over
HTTP, both engine modes)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex import LLM, SamplingParams
from loraplex.config import EngineConfig
from loraplex.engine.engine import Engine
from loraplex.errors import EngineStepFailed
from tests.engine_harness import Progress, add, gather
from tests.fixtures import write_peft_adapter
from tests.model_harness import random_prompts
from tests.reference import with_adapter
from tests.server_harness import Server, tiny_server, wait_until_idle

CONFIG = dict(max_loras=3, max_cpu_loras=4, max_lora_rank=16, kv_cache_blocks=128, debug_checks=True)


def write_overflowing_adapter(base: Path, folder: Path) -> Path:
    """A rank-2 PEFT adapter on layer 0's MLP, scale 1, within the load-time bound (every module's
    ``||A||_F * ||B||_F = 8e18 < 2^63``), that overflows on every token. With ``x`` the normed hidden state and
    ``u`` a unit vector, gate and up put ``+c (x . u)`` on channel 3 and ``-c (x . u)`` on channel 5
    (``c = 4e18``), so one of them carries ``silu(gate) * up = c^2 (x . u)^2`` (far past 2^64), and down_proj's
    delta (``||A|| = 1``, ``||B|| = 2c``) of that is past float32's 3.4e38: inf, then NaN at the next norm."""
    write_peft_adapter(base, folder, rank=2, alpha=2, target_modules=("gate_proj", "up_proj", "down_proj"), seed=7)
    file = folder / "adapter_model.safetensors"
    tensors = load_file(file)
    u = torch.randn(tensors["base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight"].shape[1],
                    generator=torch.Generator().manual_seed(0))
    c = 4e18
    for key, t in tensors.items():
        t.zero_()
        if ".layers.0." not in key:
            continue
        if "down_proj.lora_A" in key:
            t[0, 3] = t[0, 5] = 2**-0.5
        elif "down_proj.lora_B" in key:
            t[0, 0] = 2 * c
        elif "lora_A" in key:  # gate, up
            t[0], t[1] = u / u.norm(), -u / u.norm()
        else:
            t[3, 0] = t[5, 1] = c
    save_file(tensors, file, metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def bomb(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_overflowing_adapter(tiny_llama, tmp_path_factory.mktemp("bomb") / "bomb")


def test_an_overflowing_adapter_fails_only_its_own_row(tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
                                                       bomb: Path) -> None:
    """Three requests (two adapters and the base) decode; the overflowing adapter's 40-token prompt joins their
    third step. It fails alone in that step, with an error naming the non-finite logits, and no block it wrote
    stays in the prefix cache; the three got a token in that very step and their greedy outputs equal HF + PEFT's."""
    engine = Engine(EngineConfig(model=str(tiny_llama), **CONFIG))
    for name in ("r8_all", "r4_attn"):
        engine.load_adapter(name, tiny_llama_adapters[name])
    bomb_version = engine.load_adapter("bomb", bomb).version_id
    victims = {"a": ("r8_all", 20), "b": (None, 9), "c": ("r4_attn", 33)}
    prompts = dict(zip(victims, random_prompts([n for _, n in victims.values()], 256, seed=3), strict=True))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for rid, (adapter, _) in victims.items():
        add(engine, rid, prompts[rid], params, adapter)
    results: dict[str, Progress] = {}
    for _ in range(2):
        gather(engine.step(), results)
    add(engine, "bomb", random_prompts([40], 256, seed=4)[0], params, "bomb")
    failing_step = gather(engine.step(), results)
    assert {o.request_id for o in failing_step} == {"a", "b", "c", "bomb"}
    assert all(o.new_token_ids for o in failing_step if o.request_id != "bomb")
    while engine.has_unfinished_requests():
        gather(engine.step(), results)
    failed = results["bomb"]
    assert failed.finish_reason == "error" and failed.token_ids == [], failed
    assert isinstance(failed.error, EngineStepFailed) and "non-finite logits" in str(failed.error)
    for rid, (adapter, _) in victims.items():
        folder = tiny_llama_adapters[adapter] if adapter else None
        assert results[rid].token_ids == with_adapter(tiny_llama, folder, [prompts[rid]], 12)[0], rid
    keyed = [b for b in range(engine.allocator.num_total)
             if engine.allocator.key_of(b) is not None and engine.allocator.version_of(b) == bomb_version]
    assert keyed == [], "the failed row's blocks must not be matchable"
    assert engine.step_failures == 1 and "non-finite" in engine.last_step_error
    engine.allocator.check_integrity([])
    engine.adapters.check_integrity()
    assert engine.adapters.slot_table.pinned() == 0


def _stream(url: str, model: str, prompt: str, max_tokens: int, events: list[dict], ended: list[float]) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        events.extend(json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {"))
    ended.append(time.monotonic())


@pytest.fixture(params=["thread", "process"])
def server(request: pytest.FixtureRequest, tiny_llama: Path, tiny_llama_adapters: dict[str, Path], bomb: Path,
           tmp_path: Path) -> Iterator[Server]:
    adapters = {**tiny_llama_adapters, "bomb": bomb}
    with tiny_server(tiny_llama, adapters, ("r8_all", "bomb"), (), tmp_path, mode=request.param,
                     **CONFIG) as srv:
        yield srv


def test_over_http_the_other_streams_keep_running(server: Server, tiny_llama: Path,
                                                  tiny_llama_adapters: dict[str, Path]) -> None:
    """Two streams (an adapter and the base) run; a request of the overflowing adapter arrives while they do:
    it gets a 500 with an OpenAI error body naming the non-finite logits, before either stream ends, and both
    streams end normally with the text each gets alone."""
    victims = [("r8_all", "Once upon a time"), ("tiny", "The weather today")]
    events: list[list[dict]] = [[], []]
    ended: list[float] = []
    threads = [threading.Thread(target=_stream, args=(server.url, model, prompt, 160, events[i], ended))
               for i, (model, prompt) in enumerate(victims)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while server.stats().num_running < 2:
        assert time.monotonic() < deadline, "both streams running"
        time.sleep(0.01)
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "bomb", "prompt": "Dear diary, today I",
                                                         "max_tokens": 8, "temperature": 0}, timeout=60)
    answered = time.monotonic()
    for thread in threads:
        thread.join(120)
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert "non-finite logits" in error["message"] and set(error) >= {"message", "type", "param", "code"}, error
    assert len(ended) == 2 and min(ended) > answered, "the streams were running when the bad request failed"
    llm = LLM(model=str(tiny_llama), **CONFIG)
    llm.load_adapter("r8_all", tiny_llama_adapters["r8_all"])
    solo = SamplingParams(max_tokens=160, temperature=0.0, ignore_eos=True)
    for (model, prompt), got in zip(victims, events, strict=True):
        assert all("error" not in e for e in got), got[-1]
        text = "".join(e["choices"][0]["text"] for e in got)
        adapter = None if model == "tiny" else model
        assert text == llm.generate([prompt], solo, adapters=[adapter], use_tqdm=False)[0].text, model
    wait_until_idle(server.engine_client)
