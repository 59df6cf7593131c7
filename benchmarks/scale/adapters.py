"""The adapters axis of ``benchmarks/scaling.py``: ``n`` registered PEFT adapters (rank 8 and 16 alternating,
all seven projections), drawn Zipf(1.0) per request.

Sixteen distinct weight files per model are written once into ``$LORAPLEX_HOME/bench/scaling-adapters/<model
shape>/w<k>``; adapter ``i`` is a folder whose files are hard links to ``w<i % 16>`` (1,000 rank-16 adapters on
SmolLM2 would be 19 GB of disk otherwise). The engine reads each adapter from its own folder: a cache miss in
``max_cpu_loras`` costs a real file read and validation, whatever the file's content.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

from benchmarks.common import write_random_adapter
from benchmarks.peers.shared import adapter_rank, bench_home
from loraplex import LLM
from loraplex.config import ModelConfig

DISTINCT = 16


def folders(config: ModelConfig, n: int) -> list[Path]:
    """``n`` adapter folders for models of ``config``'s shape (written on first use)."""
    shape = f"{config.architecture}-{config.hidden_size}x{config.num_layers}"
    root = bench_home() / "scaling-adapters" / shape
    out = []
    for i in range(n):
        source = root / f"w{i % DISTINCT}"
        if not (source / "adapter_model.safetensors").is_file():
            write_random_adapter(source, config, rank=adapter_rank(i % DISTINCT), seed=2000 + i % DISTINCT)
        folder = root / f"a{i}"
        if not (folder / "adapter_model.safetensors").is_file():
            folder.mkdir(parents=True, exist_ok=True)
            for name in ("adapter_model.safetensors", "adapter_config.json"):
                os.link(source / name, folder / name)
        out.append(folder)
    return out


def register(llm: LLM, config: ModelConfig, n: int) -> list[str]:
    """Register ``n`` adapters ``a0 .. a{n-1}`` on ``llm``; their names."""
    names = []
    for i, folder in enumerate(folders(config, n)):
        llm.load_adapter(f"a{i}", folder)
        names.append(f"a{i}")
    return names


def zipf(names: list[str], n: int, rng: random.Random) -> list[str]:
    """``n`` draws from ``names`` with P(rank k) ~ 1 / k (``names`` in popularity order)."""
    return rng.choices(names, weights=[1.0 / (k + 1) for k in range(len(names))], k=n)
