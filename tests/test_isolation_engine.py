"""Issue 30, the engine half: a fault stays in its row; requests do bounded work.

An adapter whose weights pass the load-time bound (``adapters/reading/overflow_bound.py``) can still overflow
float32 in a step: the bound assumes down_proj's input stays below 2^64, and ``write_overflowing_adapter``
breaks that assumption. Its requests must fail alone (an error naming the non-finite logits), while every
other row of the same step is committed and equals HF + PEFT (in the engine) or the request run alone (over
HTTP, both engine modes). One prompt's choices may generate ``n x max_tokens`` tokens (each choice's real
maximum) up to ``max_request_output_tokens``, and prompt logprobs cover at most ``max_prompt_logprobs_tokens``
prompt tokens: past either, a 400 naming the param, and nothing is queued."""

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
from loraplex.cli import build_parser, engine_config
from loraplex.config import EngineConfig
from loraplex.engine.engine import Engine
from loraplex.engine.request import NewRequest
from loraplex.engine.sampling.sampler import nonfinite_rows
from loraplex.errors import EngineStepFailed, RequestError
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


@pytest.fixture(scope="module", params=["thread", "process"])
def server(request: pytest.FixtureRequest, tiny_llama: Path, tiny_llama_adapters: dict[str, Path], bomb: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    adapters = {**tiny_llama_adapters, "bomb": bomb}
    with tiny_server(tiny_llama, adapters, ("r8_all", "bomb"), (), tmp_path_factory.mktemp("root"),
                     mode=request.param, **CONFIG) as srv:
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


def test_request_bounds_refuse_a_prompts_choices_past_them(tiny_llama: Path,
                                                           tiny_llama_adapters: dict[str, Path]) -> None:
    """``n x max_tokens`` per prompt (summed over the choices of one call with that prompt and version; other
    prompts and other calls do not count) and prompt logprobs per request: at the limit accepted, one past it a
    ``RequestError`` naming the param, the whole call refused and every hold released."""
    engine = Engine(EngineConfig(model=str(tiny_llama), max_request_output_tokens=100, max_prompt_logprobs_tokens=8,
                                 **CONFIG))
    version = engine.load_adapter("r8_all", tiny_llama_adapters["r8_all"]).version_id
    p, q = [1, 2, 3], [4, 5, 6]

    def call(prompt_tokens: list[tuple[list[int], int]], prompt_logprobs: int | None = None) -> list[str]:
        items = [NewRequest(None, ids, SamplingParams(max_tokens=m, prompt_logprobs=prompt_logprobs), version)
                 for ids, m in prompt_tokens]
        return engine.add_requests(items)

    assert len(call([(p, 25)] * 4 + [(q, 100)])) == 5  # each prompt at its limit
    for refused, param in (([(p, 25)] * 3 + [(p, 26)], "n"), ([(p, 101)], "max_tokens")):
        with pytest.raises(RequestError, match="past the limit of 100 .--max-request-output-tokens") as caught:
            call(refused + [(q, 1)])
        assert caught.value.param == param
    assert len(call([(list(range(8)), 1)], prompt_logprobs=0)) == 1
    with pytest.raises(RequestError, match="9-token prompt: past the limit of 8") as caught:
        call([(list(range(9)), 1)], prompt_logprobs=0)
    assert caught.value.param == "prompt_logprobs"
    assert engine.adapters.versions.in_flight == {version: 6}, "a refused call holds nothing"
    default = Engine(EngineConfig(model=str(tiny_llama), **CONFIG))
    assert default.intake.bounds.max_request_output_tokens == 16 * default.max_model_len
    assert default.intake.bounds.max_prompt_logprobs_tokens == default.max_model_len


def test_request_bound_flags_reach_the_engine_config() -> None:
    parser = build_parser()
    args = parser.parse_args(["serve", "--max-request-output-tokens", "5000", "--max-prompt-logprobs-tokens", "64"])
    config = engine_config(args, parser)
    assert (config.max_request_output_tokens, config.max_prompt_logprobs_tokens) == (5000, 64)
    config = engine_config(parser.parse_args(["serve"]), parser)
    assert (config.max_request_output_tokens, config.max_prompt_logprobs_tokens) == (None, None)


def test_over_http_n_128_without_max_tokens_is_a_400_on_n(server: Server) -> None:
    """A chat request with ``n=128`` and no ``max_tokens`` asks 128 choices that may each run to the end of the
    context: a 400 naming ``n`` before any seat is taken; with a small ``max_tokens`` the same ``n`` is served."""
    body = {"model": "r8_all", "messages": [{"role": "user", "content": "Once upon a time"}], "n": 128,
            "temperature": 0}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == "n" and error["type"] == "invalid_request_error", error
    assert "--max-request-output-tokens" in error["message"]
    assert server.stats().num_running == 0
    served = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "max_tokens": 2}, timeout=60)
    assert served.status_code == 200 and len(served.json()["choices"]) == 128, served.text[:300]


def test_nonfinite_rows_flags_nan_and_inf_anywhere_but_not_narrower_vocabularies() -> None:
    """A NaN or +inf at any column, or a row with nothing above -inf, is flagged; -inf columns alone (a narrower
    adapter vocabulary's) and huge finite values are not."""
    logits = torch.randn(6, 49152, generator=torch.Generator().manual_seed(0))
    logits[1, 40000] = float("nan")
    logits[2, 3] = float("inf")
    logits[3, 100:] = float("-inf")  # a narrower vocabulary
    logits[4] = float("-inf")
    logits[5, 7] = 3e38
    assert nonfinite_rows(logits).tolist() == [False, True, True, False, True, False]
    for column in range(0, 49152, 997):  # wherever the NaN sits
        row = torch.zeros(1, 49152)
        row[0, column] = float("nan")
        assert nonfinite_rows(row).tolist() == [True], column
