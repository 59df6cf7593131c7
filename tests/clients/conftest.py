"""One real ``loraplex serve`` (engine process, preparation worker) of the tiny model for every client test:
the base model and the adapter ``chat`` (``r8_all``), runtime loading off, no key."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.test_cli import free_port, wait_healthy

ADAPTER = "chat"


@dataclass(frozen=True)
class Served:
    url: str  # http://127.0.0.1:PORT
    base: str  # the served name of the base model
    model: Path  # the base checkpoint
    adapter: Path  # the folder of the adapter served as ``ADAPTER``

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"


@pytest.fixture(scope="package")
def served(tiny_llama: Path, tiny_llama_adapters: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    port, adapter = free_port(), tiny_llama_adapters["r8_all"]
    log = tmp_path_factory.mktemp("clients") / "serve.log"
    cmd = [sys.executable, "-m", "loraplex.cli", "serve", "--model", str(tiny_llama), "--adapter",
           f"{ADAPTER}={adapter}", "--port", str(port), "--kv-cache-blocks", "256", "--max-num-seqs", "4",
           "--prepare-workers", "1"]
    env = {k: v for k, v in os.environ.items() if k != "LORAPLEX_API_KEY"}
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, log)
        yield Served(url, tiny_llama.name, tiny_llama, adapter)
    finally:
        proc.terminate()
        proc.wait(60)
