"""An RL loop over HTTP (issue 31): a trainer PUTs a new version of one adapter's tensors after every few
answers while clients stream requests of that name. Every answer equals what HF transformers + PEFT
compute with the version its ``x-loraplex-adapter-version`` header names; every request accepted is
answered; versions beyond the held bound are dropped once their last request ends (host memory bounded)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import safetensors.torch
import torch
from peft import PeftModel, set_peft_model_state_dict
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.reference import hf_greedy
from tests.server_harness import Server, tiny_server, wait_until_idle

CONFIG = dict(max_loras=2, max_cpu_loras=2, max_lora_rank=16, kv_cache_blocks=128, max_num_seqs=8)
UPDATES = 50
STREAMS = 3
PROMPT = [5, 17, 99, 3, 250, 41, 8]
MAX_TOKENS = 6
HEADER = "x-loraplex-adapter-version"


def versions(folder: Path) -> list[dict[str, torch.Tensor]]:
    """``UPDATES`` state dicts of one adapter: its A, a fresh random B each (a trainer's steps)."""
    tensors = safetensors.torch.load_file(folder / "adapter_model.safetensors")
    out = []
    for step in range(UPDATES):
        generator = torch.Generator().manual_seed(100 + step)
        out.append({k: torch.randn(v.shape, generator=generator) * 0.3 if "lora_B" in k else v
                    for k, v in tensors.items()})
    return out


def references(base: Path, folder: Path, steps: list[dict[str, torch.Tensor]]) -> list[list[int]]:
    """HF + PEFT greedy tokens of ``PROMPT`` under each state dict (one PEFT model, its weights swapped)."""
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                      str(folder)).eval()
    out = []
    for tensors in steps:
        result = set_peft_model_state_dict(model, tensors)
        assert not result.unexpected_keys
        out.append(hf_greedy(model, PROMPT, MAX_TOKENS)[0])
    return out


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with tiny_server(tiny_llama, tiny_llama_adapters, (), (), tmp_path_factory.mktemp("root"),
                     app_options={"max_request_bytes": 8 << 20}, **CONFIG) as srv:
        yield srv


def stream_once(client: httpx.Client, url: str) -> tuple[str, str]:
    """(version header, text) of one streamed greedy completion of the live adapter."""
    return stream_once_of(client, url, "live")


def stream_once_of(client: httpx.Client, url: str, model: str) -> tuple[str, str]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert all("error" not in c for c in chunks), chunks
        return r.headers[HEADER], "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


def test_updates_while_streaming_serve_each_answer_its_version(server: Server, tiny_llama: Path,
                                                               tiny_llama_adapters: dict[str, Path]) -> None:
    folder = tiny_llama_adapters["r8_all"]
    config = (folder / "adapter_config.json").read_text()
    steps = versions(folder)
    decode = AutoTokenizer.from_pretrained(tiny_llama).decode
    expected = [decode(tokens, skip_special_tokens=True) for tokens in references(tiny_llama, folder, steps)]
    assert len(set(expected)) >= UPDATES // 2, "the versions must answer differently for the test to bite"
    answers: list[tuple[str, str]] = []
    changed = threading.Condition()
    done = threading.Event()
    labels: dict[str, int] = {}
    held: list[int] = []

    def trainer() -> None:
        with httpx.Client(timeout=60) as client:
            for step, tensors in enumerate(steps):
                with changed:  # a new version after every 2 answers (the first at once)
                    changed.wait_for(lambda s=step: len(answers) >= 2 * s)
                body = safetensors.torch.save(tensors, metadata={"adapter_config": config})
                r = client.put(f"{server.url}/v1/adapters/live", content=body,
                               headers={"Content-Type": "application/octet-stream"})
                assert r.status_code == 200, r.text
                with changed:
                    labels[r.json()["current"]] = step
                    changed.notify_all()
                held.append(len(server.engine.adapters.host))  # versions in host memory now
        done.set()

    def streamer() -> None:
        with changed:
            changed.wait_for(lambda: labels)  # the first version is loaded
        with httpx.Client(timeout=60) as client:
            while not done.is_set() or len(answers) < 2 * UPDATES:
                answer = stream_once(client, server.url)
                with changed:
                    answers.append(answer)
                    changed.notify_all()

    with ThreadPoolExecutor(STREAMS + 1) as pool:
        futures = [pool.submit(trainer)] + [pool.submit(streamer) for _ in range(STREAMS)]
        for future in futures:
            future.result(timeout=300)
    assert len(answers) >= 2 * UPDATES
    for header, text in answers:
        assert text == expected[labels[header]], (header, labels[header])
    assert len({header for header, _ in answers}) >= UPDATES // 2, "answers must span the versions"
    wait_until_idle(server.engine_client)
    manager = server.engine.adapters
    bound = manager.versions.max_held
    assert max(held) <= bound + STREAMS, held  # the held versions, and one per request in flight at most
    kept = manager.versions.all_held()
    assert len(kept) == bound and len(manager.host) == bound  # the rest were dropped with their last request
    assert f"v{kept[-1].version_id}" == max(labels, key=labels.__getitem__)
    manager.check_integrity()


def test_a_request_keeps_its_version_through_a_burst_of_updates(server: Server, tiny_llama: Path,
                                                                 tiny_llama_adapters: dict[str, Path]) -> None:
    """The step loop is held while one request, accepted on version v, waits: a burst of more updates than
    the held bound retires v, which must still serve that request exactly, then be dropped."""
    folder = tiny_llama_adapters["r8_all"]
    config = (folder / "adapter_config.json").read_text()
    steps = versions(folder)[: server.engine.adapters.versions.max_held + 2]
    decode = AutoTokenizer.from_pretrained(tiny_llama).decode
    expected = [decode(tokens, skip_special_tokens=True) for tokens in references(tiny_llama, folder, steps)]
    manager, engine = server.engine.adapters, server.engine
    gate, step = threading.Event(), engine.step

    def held_step() -> list:
        gate.wait(60)
        return step()

    def put(client: httpx.Client, tensors: dict[str, torch.Tensor]) -> int:
        r = client.put(f"{server.url}/v1/adapters/live2", headers={"Content-Type": "application/octet-stream"},
                       content=safetensors.torch.save(tensors, metadata={"adapter_config": config}))
        assert r.status_code == 200, r.text
        return int(r.json()["current"][1:])

    with httpx.Client(timeout=60) as client, ThreadPoolExecutor(1) as pool:
        first = put(client, steps[0])
        engine.step = held_step  # the step loop's next step waits for the gate
        try:
            answer = pool.submit(lambda: stream_once_of(client, server.url, "live2"))
            while not manager.versions.in_use(first):  # accepted: it holds its version
                threading.Event().wait(0.01)
            later = [put(client, tensors) for tensors in steps[1:]]
            assert not manager.versions.is_held(first) and manager.failure(first) is None  # retired, still served
        finally:
            gate.set()
            engine.step = step
        header, text = answer.result(60)
    assert header == f"v{first}" and text == expected[0]
    wait_until_idle(server.engine_client)
    assert manager.failure(first) is not None and not manager.host.contains(first)  # dropped after its request
    assert [i.version_id for i in manager.versions.held("live2")] == later[-manager.versions.max_held:]
    assert httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "live2"}).status_code == 200
    manager.check_integrity()
