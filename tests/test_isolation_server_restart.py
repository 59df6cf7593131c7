"""A dead engine process heals (issue 30, item 6), over a real ``loraplex serve``: after SIGKILL of the engine
process the stream in flight ends with an error event, ``/health`` answers 503 ``restarting`` with a
``Retry-After``, then ``ok``; a new engine process (another pid) serves the start-up adapter, the adapter
loaded at run time, a pin and the base model with HF + PEFT's greedy tokens, under new version ids. With
``--no-engine-restart`` the server exits non-zero instead (on main it stayed up answering 503 forever)."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import httpx
import psutil
from transformers import AutoTokenizer

from tests.reference import with_adapter
from tests.test_graceful_shutdown import Background, serve

PROMPT = [5, 17, 42, 9, 73, 11]  # token ids: no tokenization in the comparison
NEW_TOKENS = 8


def engine_pid(server_pid: int) -> int:
    (pid,) = [p.pid for p in psutil.Process(server_pid).children(recursive=True)
              if "loraplex.engine.core_process" in " ".join(p.cmdline())]
    return pid


def kill_engine_during_a_stream(url: str, server_pid: int) -> tuple[int, list[str]]:
    """SIGKILL the engine while a long stream runs; (the killed pid, the stream's data lines)."""
    stream = Background(url, {"model": "chat", "prompt": "Once upon a time", "max_tokens": 480,
                              "ignore_eos": True, "stream": True})
    assert stream.started.wait(120)
    pid = engine_pid(server_pid)
    psutil.Process(pid).send_signal(signal.SIGKILL)
    status, events = stream.join()
    assert status == 200 and isinstance(events, list)
    return pid, events


def greedy_over_http(url: str, model: str) -> list[str]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
            "logprobs": 1}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["tokens"]


def test_a_killed_engine_is_restarted_with_its_adapters(tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
                                                        tmp_path: Path) -> None:
    root = tiny_llama_adapters["r8_all"].parent
    with serve(tiny_llama, tiny_llama_adapters["r4_attn"], tmp_path / "serve.log", "--allow-runtime-adapters",
               "--adapter-root", str(root), "--max-loras", "3") as (proc, url):
        loaded = httpx.post(f"{url}/v1/load_lora_adapter", timeout=60,
                            json={"lora_name": "rt", "lora_path": str(tiny_llama_adapters["r8_all"])})
        assert loaded.status_code == 200, loaded.text
        pinned = httpx.post(f"{url}/v1/adapters/rt/pin", timeout=60)
        assert pinned.status_code == 200, pinned.text
        before = {a["name"]: a for a in httpx.get(f"{url}/v1/adapters", timeout=30).json()["data"]}
        killed, events = kill_engine_during_a_stream(url, proc.pid)
        error = json.loads(events[-2])["error"]  # then [DONE]
        assert error["code"] == 503 and "restarting" in error["message"], events[-3:]
        health = httpx.get(f"{url}/health", timeout=30)
        assert health.status_code == 503 and health.json()["status"] == "restarting", health.text
        assert int(health.headers["retry-after"]) > 0
        refused = httpx.post(f"{url}/v1/completions", json={"model": "chat", "prompt": "x", "max_tokens": 1},
                             timeout=30)
        assert refused.status_code == 503 and "Retry-After" in refused.headers, refused.text
        deadline = time.monotonic() + 240
        while (health := httpx.get(f"{url}/health", timeout=30)).status_code != 200:
            assert health.json()["status"] == "restarting", health.text
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.2)
        assert engine_pid(proc.pid) != killed
        after = {a["name"]: a for a in httpx.get(f"{url}/v1/adapters", timeout=30).json()["data"]}
        assert sorted(after) == sorted(before) == ["chat", "rt"]
        assert after["rt"]["pinned"] and before["rt"]["pinned"] and not after["chat"]["pinned"]
        old_ids = {int(a["current"][1:]) for a in before.values()}
        assert all(int(a["current"][1:]) > max(old_ids) for a in after.values())  # no id names another adapter
        tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
        for model, folder in (("chat", tiny_llama_adapters["r4_attn"]), ("rt", tiny_llama_adapters["r8_all"]),
                              (None, None)):
            (want,) = with_adapter(tiny_llama, folder, [PROMPT], NEW_TOKENS)
            got = greedy_over_http(url, model or httpx.get(f"{url}/v1/models").json()["data"][0]["id"])
            assert got == [tokenizer.decode([t]) for t in want], model


def test_no_engine_restart_exits_non_zero(tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
                                          tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    with serve(tiny_llama, tiny_llama_adapters["r4_attn"], log, "--no-engine-restart") as (proc, url):
        _, events = kill_engine_during_a_stream(url, proc.pid)
        assert json.loads(events[-2])["error"]["code"] == 503, events[-3:]
        assert proc.wait(60) != 0, log.read_text()
        assert "engine process exited" in log.read_text()
