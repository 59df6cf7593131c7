"""Activated LoRA (issue 37): four "intrinsic" adapters evaluated over one cached conversation, as aLoRA (their
delta starts at their invocation sequence, so the base model's cached K/V of the conversation is reused) and
as plain LoRA with the same weights (each prefills the whole conversation under its own version).

The embedded SmolLM2; a ``--context``-token conversation (chat text), prefilled once by the base model (its
blocks cached); then per intrinsic the conversation + its invocation tokens + a few tokens, ``--tokens`` new
tokens, greedy: time to first token and total time, one request at a time. Each round takes a fresh
conversation (nothing carries over). Goal: aLoRA TTFT <= 0.2x the plain-LoRA TTFT. Prints a table and writes
JSON (``--out``).

    .venv/bin/python -m benchmarks.alora [--context 1000] [--rounds 3] [--tokens 8] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.common import QUESTIONS, add_clock_options, machine_line, step_clock, write_json, write_random_adapter
from loraplex.config import EngineConfig
from loraplex.engine.engine import Engine
from loraplex.engine.request import SamplingParams

INTRINSICS = ("answerability", "citation", "safety", "uncertainty")


def timed_request(engine: Engine, rid: str, prompt: list[int], version_id: int | None, tokens: int,
                  clock: Callable[[], float] = time.perf_counter) -> tuple[float, float]:
    """(time to first token, total time) of one request run alone, in seconds of ``clock``."""
    start = clock()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True), version_id)
    first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.new_token_ids and first is None:
                first = clock() - start
    return first or 0.0, clock() - start


def write_intrinsics(root: Path, engine: Engine, tokenizer) -> dict[str, tuple[Path, Path]]:  # noqa: ANN001
    """Each intrinsic twice, the same weights: as aLoRA (with its invocation tokens) and as plain LoRA."""
    out = {}
    for i, name in enumerate(INTRINSICS):
        plain = write_random_adapter(root / f"{name}-lora", engine.model_config, 16, seed=i)
        alora = root / f"{name}-alora"
        alora.mkdir()
        (alora / "adapter_model.safetensors").write_bytes((plain / "adapter_model.safetensors").read_bytes())
        config = json.loads((plain / "adapter_config.json").read_text())
        config["alora_invocation_tokens"] = tokenizer.encode(f"<|start_of_role|>{name}<|end_of_role|>",
                                                             add_special_tokens=False)
        (alora / "adapter_config.json").write_text(json.dumps(config))
        out[name] = (alora, plain)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=8)
    add_clock_options(parser)
    parser.add_argument("--out", default="benchmarks/results/alora.json")
    args = parser.parse_args()
    clock = step_clock(parser, args)
    engine = Engine(EngineConfig(max_loras=8, max_cpu_loras=8, max_lora_rank=16, kv_cache_bytes=1 << 30))
    tokenizer = engine.tokenizer
    versions: dict[str, dict[str, int]] = {"aLoRA": {}, "plain LoRA": {}}
    invocations: dict[str, list[int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (alora, plain) in write_intrinsics(Path(tmp), engine, tokenizer).items():
            versions["aLoRA"][name] = engine.load_adapter(f"{name}-alora", alora).version_id
            versions["plain LoRA"][name] = engine.load_adapter(f"{name}-lora", plain).version_id
            invocations[name] = json.loads((alora / "adapter_config.json").read_text())["alora_invocation_tokens"]
    rng = random.Random(0)
    times: dict[str, dict[str, list[float]]] = {kind: {"ttft": [], "total": []} for kind in versions}
    for r in range(args.rounds + 1):  # round 0 warms up
        text = " ".join(rng.sample(QUESTIONS, len(QUESTIONS)) * 12)
        conversation = tokenizer.encode(f"round {r}: {text}", add_special_tokens=False)[:args.context]
        timed_request(engine, f"base-{r}", conversation, None, 1)  # the base model caches the conversation
        for kind, ids in versions.items():
            for name, version_id in ids.items():
                prompt = conversation + invocations[name] + tokenizer.encode(" Answer:", add_special_tokens=False)
                ttft, total = timed_request(engine, f"{kind}-{name}-{r}", prompt, version_id, args.tokens, clock)
                if r:
                    times[kind]["ttft"].append(ttft)
                    times[kind]["total"].append(total)
    med = {kind: {k: statistics.median(v) for k, v in t.items()} for kind, t in times.items()}
    ratio = med["aLoRA"]["ttft"] / med["plain LoRA"]["ttft"]
    result = {"machine": machine_line(), "date": time.strftime("%Y-%m-%d %H:%M"), "context": args.context,
              "tokens": args.tokens, "rounds": args.rounds, "clock": args.clock, "seconds": times, "median": med,
              "ttft_ratio_alora_over_lora": ratio, "goal": "<= 0.2"}
    write_json(args.out, result)
    print(f"# {result['machine']}; {args.context}-token cached conversation, 4 intrinsics, {args.tokens} new tokens, "
          f"{args.clock} clock")
    print(f"{'adapters':12} {'TTFT ms (median)':>18} {'total ms (median)':>18}")
    for kind, m in med.items():
        print(f"{kind:12} {m['ttft'] * 1e3:18.1f} {m['total'] * 1e3:18.1f}")
    print(f"aLoRA / plain LoRA TTFT = {ratio:.3f} (goal <= 0.2)")


if __name__ == "__main__":
    main()
