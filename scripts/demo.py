"""`make demo`: one question, four answers — the base model and the three demo adapters, side by side.

Starts ``loraplex serve`` (the embedded SmolLM2-135M-Instruct with the adapters of
``loraplex/demo_adapters``) on a free port, waits for ``/health``, sends the question to the base
model and to each adapter at the same time (so the server batches them together), prints the
answers in columns and stops the server. Each column must show its own style; a server that mixed
up adapters in the batch would show the wrong style in the wrong column.

    .venv/bin/python scripts/demo.py ["Your question?"] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import httpx

from loraplex.demo_adapters import DEMO_ADAPTERS, DEMO_DESCRIPTIONS

QUESTION = "Why is the sky blue?"
START_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(port: int, log: Path) -> subprocess.Popen:
    adapters = [arg for name, path in DEMO_ADAPTERS.items() for arg in ("--adapter", f"{name}={path}")]
    cmd = [sys.executable, "-m", "loraplex.cli", "serve", "--port", str(port), "--max-loras", "4", *adapters]
    with log.open("wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)


def wait_healthy(server: subprocess.Popen, base_url: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(f"the server exited with code {server.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    sys.exit(f"the server was not healthy after {START_TIMEOUT_S:.0f} s:\n{log.read_text()[-3000:]}")


async def ask_all(base_url: str, models: list[str], question: str, max_tokens: int) -> list[str]:
    """The same chat question to every model at once, greedy."""
    async with httpx.AsyncClient(base_url=base_url, timeout=600.0) as client:

        async def ask(model: str) -> str:
            body = {"model": model, "messages": [{"role": "user", "content": question}],
                    "max_tokens": max_tokens, "temperature": 0.0}  # fmt: skip
            response = await client.post("/v1/chat/completions", json=body)
            response.raise_for_status()
            return response.json()["choices"][0]["message"]["content"].strip()

        return list(await asyncio.gather(*(ask(m) for m in models)))


def print_columns(headers: list[str], answers: list[str]) -> None:
    """Columns when the terminal is wide enough, else one block per answer."""
    width = shutil.get_terminal_size((160, 40)).columns
    col = (width - 3 * (len(answers) - 1)) // len(answers)
    if col < 24:
        for header, answer in zip(headers, answers, strict=True):
            print(f"== {header}\n{textwrap.fill(answer, width)}\n")
        return
    heads = [textwrap.wrap(h, col) for h in headers]
    height = max(len(h) for h in heads)
    cells = [h + [""] * (height - len(h)) + ["-" * col] + textwrap.wrap(a, col)
             for h, a in zip(heads, answers, strict=True)]  # fmt: skip
    for row in range(max(len(c) for c in cells)):
        print(" | ".join((c[row] if row < len(c) else "").ljust(col) for c in cells).rstrip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question", nargs="?", default=QUESTION)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp(prefix="loraplex-demo-")) / "server.log"
    print(f"starting loraplex serve on port {port} (log: {log}) ...", flush=True)
    server = start_server(port, log)
    try:
        wait_healthy(server, base_url, log)
        base = httpx.get(f"{base_url}/v1/models").json()["data"][0]["id"]
        models = [base, *DEMO_ADAPTERS]
        print(f"asking {', '.join(models)}: {args.question!r}\n", flush=True)
        started = time.perf_counter()
        answers = asyncio.run(ask_all(base_url, models, args.question, args.max_tokens))
        headers = [f"{base} (base model)"] + [f"{name}: {DEMO_DESCRIPTIONS[name]}" for name in DEMO_ADAPTERS]
        print_columns(headers, answers)
        print(f"\n{len(models)} answers in one batch, {time.perf_counter() - started:.1f} s")
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


if __name__ == "__main__":
    main()
