"""``loraplex serve`` and ``loraplex generate``: flags, clean errors, printed completions, and a
real server process that starts, logs what it serves and answers with its adapters and key."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.cli import build_parser, engine_config, main


def test_serve_defaults() -> None:
    args = build_parser().parse_args(["serve"])
    assert (args.model, args.host, args.port) == ("smollm2-135m-instruct", "127.0.0.1", 8000)
    assert (args.adapter, args.adapter_root, args.allow_runtime_adapters) == ([], [], False)


def test_repeated_adapters_and_roots() -> None:
    args = build_parser().parse_args(["serve", "--adapter", "a=/x/a", "--adapter", "b=rel/b=c", "--adapter-root",
                                      "/r1", "--adapter-root", "/r2", "--allow-runtime-adapters", "--port", "9"])
    assert args.adapter == [("a", "/x/a"), ("b", "rel/b=c")]
    assert (args.adapter_root, args.allow_runtime_adapters, args.port) == (["/r1", "/r2"], True, 9)


def test_threads_flag_reaches_the_engine_config() -> None:
    parser = build_parser()
    assert engine_config(parser.parse_args(["serve", "--threads", "1"]), parser).num_threads == 1
    assert engine_config(parser.parse_args(["serve"]), parser).num_threads is None


def test_quantization_flag_reaches_the_engine_config() -> None:
    parser = build_parser()
    assert engine_config(parser.parse_args(["serve", "--quantization", "int8"]), parser).quantization == "int8"
    assert engine_config(parser.parse_args(["generate", "hi"]), parser).quantization is None


def test_prefix_caching_is_on_unless_turned_off() -> None:
    parser = build_parser()
    assert engine_config(parser.parse_args(["serve"]), parser).enable_prefix_caching is True
    for command in ("serve", "generate x", "serve-ray"):
        args = parser.parse_args([*command.split(), "--no-prefix-caching"])
        assert engine_config(args, parser).enable_prefix_caching is False


@pytest.mark.parametrize("argv", [
    ["serve", "--adapter", "no-equals-sign"],
    ["serve", "--adapter", "=path"],
    ["generate", "--adapter", "name=", "hello"],
    ["serve", "--max-loras", "8", "--max-cpu-loras", "2"],
    ["serve", "--max-loras", "0"],
    ["serve", "--port", "eighty"],
    ["serve", "--threads", "0"],
    ["serve", "--quantization", "int4"],
    ["generate"],
])
def test_bad_arguments_are_clean_argparse_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: loraplex" in err and "error:" in err and "Traceback" not in err


def test_generate_prints_completions(tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
                                     capsys: pytest.CaptureFixture[str]) -> None:
    prompts = ["Hello there", "The sea is"]
    folder = tiny_llama_adapters["r8_all"]
    code = main(["generate", "--model", str(tiny_llama), "--adapter", f"sql={folder}", "--use", "sql",
                 "--max-tokens", "6", "--kv-cache-blocks", "32", "--log-level", "warning", *prompts])
    assert code == 0
    llm = LLM(model=str(tiny_llama), kv_cache_blocks=64)
    llm.load_adapter("sql", folder)
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0), adapters="sql", use_tqdm=False)
    printed = capsys.readouterr().out
    assert printed == "".join(f"### {p}\n{o.text}\n" for p, o in zip(prompts, outs, strict=True))


def test_generate_unknown_adapter_is_a_clean_error(tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["generate", "--model", str(tiny_llama), "--use", "nope", "--kv-cache-blocks", "8", "hi"])
    assert code == 1
    assert "loraplex: error:" in capsys.readouterr().err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float = 300.0) -> None:
    """Until ``loraplex serve`` (``proc``, logging to ``log``) answers ``/health`` with 200; fails with its log
    if it exits first or takes ``timeout`` seconds (start-up imports torch in the engine and each worker:
    slow on a busy host)."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)


def test_serve_process(tiny_llama: Path, tiny_llama_adapters: dict[str, Path], tmp_path: Path) -> None:
    """``loraplex serve`` end to end; Ctrl-C (SIGINT) stops it with status 0 and nothing left behind. At
    DEBUG, no process's log (API, engine, preparation worker: all in the capture) names a key, valid or not.
    SIGTERM's exit (status 0, no process left) is checked on a server of the same shape, with requests in
    flight, by ``tests/test_graceful_shutdown.py`` (and ``test_serve_isolation.py``, after an engine death)."""
    port, folder = free_port(), tiny_llama_adapters["r4_attn"]
    log = tmp_path / "serve.log"
    key, wrong = "sk-serve-7f3a9c1e5b", "sk-wrong-9b1d3f5e7a"
    env = {**os.environ, "LORAPLEX_API_KEY": key}
    cmd = [sys.executable, "-m", "loraplex.cli", "serve", "--model", str(tiny_llama), "--adapter", f"chat={folder}",
           "--port", str(port), "--max-loras", "2", "--kv-cache-blocks", "64", "--allow-runtime-adapters",
           "--adapter-root", str(tmp_path), "--log-level", "DEBUG"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    children: list[psutil.Process] = []
    try:
        url, auth = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {key}"}
        wait_healthy(proc, url, log)
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {wrong}"}).status_code == 401
        models = httpx.get(f"{url}/v1/models", headers=auth).json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [(tiny_llama.name, None), ("chat", tiny_llama.name)]
        r = httpx.post(f"{url}/v1/completions", headers=auth, timeout=60,
                       json={"model": "chat", "prompt": "Hi", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        children = psutil.Process(proc.pid).children(recursive=True)  # the engine, the preparation workers
        engine = next(c for c in children if "loraplex.engine.core_process" in " ".join(c.cmdline()))
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
    _, alive = psutil.wait_procs(children, timeout=30)
    assert code == 0 and not alive, (code, [c.cmdline() for c in alive], log.read_text())
    text = log.read_text()
    for expected in (f"serving on http://127.0.0.1:{port}/v1", "dtype torch.float32", "in its own process",
                     "2 adapter slots",
                     "KV cache 64 blocks x 16 tokens", f"adapters: chat={folder}"):
        assert expected in text, text
    assert f"step loop started (pid {engine.pid})" in text  # the engine process's log is in the capture
    assert key not in text and wrong not in text


def test_embedded_model_serves_the_demo_adapters_by_default(tiny_llama: Path) -> None:
    from loraplex.cli import startup_adapters
    from loraplex.demo_adapters import DEMO_ADAPTERS

    parser = build_parser()
    default = startup_adapters(parser.parse_args(["serve"]))
    assert [name for name, _ in default] == list(DEMO_ADAPTERS)
    assert all((Path(path) / "adapter_config.json").is_file() for _, path in default)
    assert startup_adapters(parser.parse_args(["serve", "--no-demo-adapters"])) == []
    assert startup_adapters(parser.parse_args(["serve", "--adapter", "x=/a"])) == [("x", "/a")]
    assert startup_adapters(parser.parse_args(["serve", "--model", str(tiny_llama)])) == []


def test_num_threads_sets_torch_threads(tiny_llama: Path) -> None:
    before = torch.get_num_threads()
    try:
        LLM(model=str(tiny_llama), num_threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
