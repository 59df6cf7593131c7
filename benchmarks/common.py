"""Shared benchmark helpers: random PEFT-format adapters written directly, chat prompts, peak RSS, the
decode step's bare matmuls, and the options, clock, header and JSON output of the step benchmarks."""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from loraplex.config import PROJECTIONS, ModelConfig
from loraplex.engine.engine import Engine
from loraplex.layers.lora_linear import LoRALinear
from loraplex.ops.dense import dense_linear

QUESTIONS = [
    "Explain in two sentences why the sky is blue.", "Write a short poem about a lighthouse at night.",
    "What are three tips for learning a new language?", "Describe how a bicycle works to a child.",
    "Give me a recipe idea that uses rice and beans.", "Why do cats purr? Answer briefly.",
    "Summarise the plot of a heist movie you invent.", "What is the difference between weather and climate?",
    "List some ways to save energy at home.", "How do airplanes stay in the air?",
    "Suggest a name for a coffee shop and explain it.", "What makes a good team leader?",
    "Tell me a fun fact about octopuses.", "How should I prepare for a job interview?",
    "Explain what a prime number is with an example.", "Write a friendly reminder about a meeting tomorrow.",
]


def write_random_adapter(folder: Path, model_config: ModelConfig, rank: int, seed: int, b_std: float = 0.09) -> Path:
    """A PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) on all seven projections,
    A ~ N(0, 1/in), B ~ N(0, b_std^2): the format PEFT's save_pretrained writes, without loading the model."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model_config.num_layers):
        for name, projection in model_config.projections().items():
            fan_in, fan_out = projection.in_features, projection.out_features
            prefix = f"base_model.model.model.layers.{layer}.{projection.parent}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * b_std
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank,
              "target_modules": list(PROJECTIONS), "bias": "none", "use_rslora": False, "use_dora": False,
              "modules_to_save": None, "lora_dropout": 0.0, "base_model_name_or_path": "smollm2-135m-instruct"}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return folder


def chat_prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:  # noqa: ANN001
    """``n`` chat-formatted prompts of ~30-60 tokens, as token ids."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        question = QUESTIONS[i % len(QUESTIONS)]
        if rng.random() < 0.5:
            question += " Please keep the answer short and clear."
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]
        prompts.append(list(ids))
    return prompts


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def machine_line() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}, {platform.python_version()}"


def add_step_options(parser: argparse.ArgumentParser, iters: int) -> None:
    """The options every interleaved step benchmark takes: batch, iterations, threads, clock, output."""
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--iters", type=int, default=iters)
    add_clock_options(parser)


def add_clock_options(parser: argparse.ArgumentParser) -> None:
    """``--threads`` and ``--clock`` (read back with ``step_clock``)."""
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall",
                        help="thread: this thread's CPU time (with --threads 1 all compute runs in it), which a "
                             "busy shared host inflates far less than wall time")


def step_clock(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Callable[[], float]:
    """The clock ``--clock`` names (after checking it against ``--threads``); sets torch's threads."""
    if args.clock == "thread" and args.threads != 1:
        parser.error("--clock thread needs --threads 1")
    torch.set_num_threads(args.threads)
    return time.thread_time if args.clock == "thread" else time.perf_counter


def step_header(args: argparse.Namespace) -> str:
    """The first line of a step benchmark's table: machine, load, batch, iterations, clock."""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"# {machine_line()} (load {load}); batch {args.batch}, {args.iters} interleaved steps, {args.clock} clock"


def time_decode_steps(engine: Engine, batch: int) -> tuple[list[float], Callable[[], None]]:
    """Wrap ``engine``'s ``scheduler.schedule`` and ``step``: the wall ms of every step that decoded exactly
    ``batch`` sequences, a token each, are appended to the list returned; the callable unwraps both."""
    times: list[float] = []
    shape: list[tuple[int, int]] = []  # the last schedule's (sequences, tokens)
    schedule, step = engine.scheduler.schedule, engine.step

    def schedule_hook():  # noqa: ANN202
        scheduled = schedule()
        shape.append((len(scheduled), sum(s.num_tokens for s in scheduled)))
        return scheduled

    def step_hook():  # noqa: ANN202
        start = time.perf_counter()
        out = step()
        if shape and shape[-1][0] == shape[-1][1] == batch:
            times.append((time.perf_counter() - start) * 1e3)
        shape.clear()
        return out

    def restore() -> None:
        engine.scheduler.schedule, engine.step = schedule, step

    engine.scheduler.schedule, engine.step = schedule_hook, step_hook
    return times, restore


def write_json(path: str | None, result: dict) -> None:
    """``result`` as indented JSON at ``path`` (its folder made), unless ``path`` is None."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2))


def matmul_floors(model: torch.nn.Module, batch: int) -> dict[str, Callable[[], None]]:
    """Two loops over one decode step's matmuls (every base projection of every layer, then the lm_head,
    on ``batch`` tokens): ``gemm_floor`` with ``F.linear`` on plain weights (what HF transformers runs;
    the issue's floor), ``packed_gemm_floor`` with loraplex's own packed oneDNN weights."""
    linears = [m for m in model.modules() if isinstance(m, LoRALinear)]
    plain = [m.dense_weight() for m in linears]  # copies when packed
    head = model.lm_head_weight
    inputs = {w.shape[1]: torch.randn(batch, w.shape[1]) for w in plain}

    def gemm_floor() -> None:
        for w in plain:
            F.linear(inputs[w.shape[1]], w)
        F.linear(inputs[head.shape[1]], head)

    def packed_gemm_floor() -> None:
        for m in linears:
            dense_linear(inputs[m.in_features], m.weight, m.packed_weight)
        dense_linear(inputs[head.shape[1]], head, model.lm_head_packed)

    return {"gemm_floor": gemm_floor, "packed_gemm_floor": packed_gemm_floor}
