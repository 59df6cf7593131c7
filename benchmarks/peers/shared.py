"""What every peer benchmark shares: the adapter set, the prompts, the peer venv, and result helpers.

Adapters are random PEFT-format LoRAs on all seven projections, rank 8 (even index) and 16 (odd
index), written once per seed into ``$LORAPLEX_HOME/bench/adapters`` (outside the repository) and
reused. The vLLM side runs in its own virtualenv (``.venv-vllm``, made by ``setup_peers.sh``); it
never imports loraplex, so everything it needs travels as JSON: model folder, adapter folders,
prompt token ids.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
from pathlib import Path

from benchmarks.common import chat_prompts, machine_line, write_random_adapter
from loraplex.config import ModelConfig
from loraplex.models.embedded import embedded_checkpoint

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
VLLM_PYTHON = Path(os.environ.get("VLLM_VENV", REPO / ".venv-vllm")) / "bin" / "python"
LORAPLEX_BIN = REPO / ".venv" / "bin" / "loraplex"
MODEL_NAME = "smollm2-135m-instruct"
SEED = 0
NEW_TOKENS = 64

# vLLM's CPU build: 1 GiB of KV cache, OpenMP threads on both cores, no core held back.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def bench_home() -> Path:
    return Path(os.environ.get("LORAPLEX_HOME", "~/.cache/loraplex")).expanduser() / "bench"


def adapter_rank(index: int) -> int:
    return 8 if index % 2 == 0 else 16


def adapter_set(n: int) -> dict[str, Path]:
    """``a0 .. a{n-1}`` -> PEFT folders (rank 8 / 16 alternating), written on first use."""
    config = ModelConfig.from_hf(embedded_checkpoint())
    root = bench_home() / "adapters"
    out = {}
    for i in range(n):
        folder = root / f"a{i}"
        if not (folder / "adapter_model.safetensors").exists():
            write_random_adapter(folder, config, rank=adapter_rank(i), seed=1000 + i)
        out[f"a{i}"] = folder
    return out


def model_folder() -> Path:
    """The embedded SmolLM2 checkpoint (HF format, float32); vLLM's transformers (5.x) reads it as is."""
    return Path(embedded_checkpoint())


def prompts(tokenizer, n: int) -> list[list[int]]:  # noqa: ANN001
    return chat_prompts(tokenizer, n, seed=SEED)


def summarize(values: list[float]) -> dict:
    """Median and spread (min, max) of repeated measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def header() -> dict:
    return {"machine": machine_line(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "load_avg": os.getloadavg(), "seed": SEED, "new_tokens": NEW_TOKENS,
            "gomp_cpu_affinity": os.environ.get("GOMP_CPU_AFFINITY")}


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))


def print_table(rows: list[list[str]], head: list[str]) -> None:
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, ["-" * w for w in widths], *rows]:
        cells = [str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        print("  ".join(cells))
