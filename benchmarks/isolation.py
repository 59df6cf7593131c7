"""Isolation under attack: the victims' time per output token while another tenant sends each bomb of issue 30.

``loraplex serve`` (the embedded SmolLM2 unless ``--model``; engine in its own process, ``--threads 1``)
serves ``--victims`` streamed chat completions that decode ``--tokens`` tokens each. For every attack in
``ATTACKS`` (and once with no attacker) the victims start, the attack is sent once they all stream, and
each victim's gaps between chunks while the attack is in flight are kept; the table prints their TPOT
p50 / p99 / max against the no-attacker run of the same process, the attack's status and how long it took.
On a shared host the absolute numbers move with the load; the ratios to the quiet run are the result.

    python -m benchmarks.isolation [--victims 4] [--tokens 96] [--model PATH] [--attacks "NAME;..."]
                                   [--max-num-batched-tokens N] [--out benchmarks/results/isolation.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from safetensors.torch import save_file
from tqdm import tqdm

from benchmarks.common import machine_line, write_json
from benchmarks.peers.serving import start, stop

LONG_PROMPT = 4000  # token ids
ATTACK_TIMEOUT_S = 120  # an attack still unanswered then is reported as "timeout"
Attack = Callable[[Path], tuple[str, dict]]  # the adapter root -> (path, JSON body)


def long_prompt(_: Path) -> tuple[str, dict]:
    return "/v1/completions", {"model": "base", "prompt": [100 + i % 1000 for i in range(LONG_PROMPT)],
                               "max_tokens": 4}


def many_choices(_: Path) -> tuple[str, dict]:
    return "/v1/chat/completions", {"model": "base", "messages": [{"role": "user", "content": "hi"}], "n": 128}


def prompt_logprobs(_: Path) -> tuple[str, dict]:
    return "/v1/completions", {"model": "base", "prompt": "lorem ipsum " * 400, "max_tokens": 1, "n": 16,
                               "prompt_logprobs": 5}


def huge_enum(_: Path) -> tuple[str, dict]:
    schema = {"type": "object", "properties": {"v": {"enum": [f"value-{i}" for i in range(30_000)]}}}
    response_format = {"type": "json_schema", "json_schema": {"name": "e", "schema": schema}}
    return "/v1/chat/completions", {"model": "base", "messages": [{"role": "user", "content": "pick"}],
                                    "max_tokens": 8, "response_format": response_format}


def slow_schema(_: Path) -> tuple[str, dict]:
    """Within every static limit, long to compile: 512 properties with a ``pattern`` of twelve optional letters."""
    schema = {"type": "object", "required": [f"p{i}" for i in range(512)],
              "properties": {f"p{i}": {"type": "string", "pattern": "[a-z]?" * 12} for i in range(512)}}
    return "/v1/completions", {"model": "base", "prompt": "Answer:", "max_tokens": 8,
                               "structured_outputs": {"json": schema}}


def catastrophic_regex(root: Path) -> tuple[str, dict]:
    folder = root / "regex-bomb"
    folder.mkdir(exist_ok=True)
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": r"m([\w.]+)+!",
              "base_model_name_or_path": "x"}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file({}, str(folder / "adapter_model.safetensors"))
    return "/v1/load_lora_adapter", {"lora_name": "regex-bomb", "lora_path": str(folder)}


def sparse_weights(root: Path) -> tuple[str, dict]:
    """A 2 GiB sparse weight file whose header declares one float32 tensor filling it."""
    folder = root / "sparse-bomb"
    folder.mkdir(exist_ok=True)
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"],
              "base_model_name_or_path": "x"}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    size = 2 << 30
    header = json.dumps({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
                         {"dtype": "F32", "shape": [8, size // 32], "data_offsets": [0, size]}}).encode()
    with (folder / "adapter_model.safetensors").open("wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        f.truncate(8 + len(header) + size)
    return "/v1/load_lora_adapter", {"lora_name": "sparse-bomb", "lora_path": str(folder)}


ATTACKS: dict[str, Attack | None] = {
    "none": None, "4,000-token prompt": long_prompt, "n=128, no max_tokens": many_choices,
    "prompt_logprobs, n=16": prompt_logprobs, "30,000-value enum": huge_enum,
    "512 patterned properties (slow compile)": slow_schema,
    "catastrophic target_modules regex": catastrophic_regex, "2 GiB sparse weights": sparse_weights,
}


async def victim(http: httpx.AsyncClient, i: int, tokens: int, arrivals: list[float]) -> None:
    body = {"model": "base", "messages": [{"role": "user", "content": f"Victim {i}: tell a story."}],
            "max_tokens": tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {") and '"content"' in line:
                arrivals.append(time.perf_counter())


async def run_phase(url: str, attack: Attack | None, root: Path, victims: int, tokens: int) -> dict:
    """Victims stream; once each has 4 chunks the attack goes (if any); their gaps during it (or, with
    no attacker, after that point) and the attack's answer."""
    arrivals: list[list[float]] = [[] for _ in range(victims)]
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        tasks = [asyncio.ensure_future(victim(http, i, tokens, arrivals[i])) for i in range(victims)]
        while min(len(a) for a in arrivals) < 4:
            await asyncio.sleep(0.01)
        begin, status, answer = time.perf_counter(), None, None
        if attack is not None:
            path, body = attack(root)
            try:
                response = await http.post(path, json=body, timeout=ATTACK_TIMEOUT_S)
                status, answer = response.status_code, response.text[:300]
            except httpx.TimeoutException:
                status = "timeout"
        end = time.perf_counter() if attack is not None else float("inf")
        await asyncio.gather(*tasks)
    gaps = [b - a for times in arrivals for a, b in zip(times, times[1:], strict=False) if begin <= b <= end]
    gaps = gaps or [b - a for times in arrivals for a, b in zip(times, times[1:], strict=False) if b >= begin]
    quantiles = statistics.quantiles(gaps, n=100) if len(gaps) > 1 else gaps * 99
    return {"status": status, "answer": answer, "attack_s": None if attack is None else end - begin,
            "tpot_p50_ms": statistics.median(gaps) * 1e3, "tpot_p99_ms": quantiles[98] * 1e3,
            "tpot_max_ms": max(gaps) * 1e3, "gaps": len(gaps)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def print_table(results: dict[str, dict]) -> None:
    quiet = results["none"]
    print(f"{'attack':36} {'status':>6} {'attack s':>9} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'p99/quiet':>9}")
    for name, r in results.items():
        attack_s = "-" if r["attack_s"] is None else f"{r['attack_s']:.2f}"
        print(f"{name:36} {r['status'] or '-':>6} {attack_s:>9} {r['tpot_p50_ms']:8.1f} {r['tpot_p99_ms']:8.1f} "
              f"{r['tpot_max_ms']:8.1f} {r['tpot_p99_ms'] / quiet['tpot_p99_ms']:9.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--victims", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--model", default=None, help="a checkpoint folder (default: the embedded SmolLM2)")
    parser.add_argument("--out", default="benchmarks/results/isolation.json")
    parser.add_argument("--attacks", default=None, help="names of ATTACKS to run, separated by \";\" (default: all)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="the server's per-step budget")
    args = parser.parse_args()
    attacks = ATTACKS if args.attacks is None else {
        name: ATTACKS[name] for name in ["none", *(a.strip() for a in args.attacks.split(";"))]}
    root = Path(tempfile.mkdtemp(prefix="loraplex-isolation-"))
    port = free_port()
    cmd = [sys.executable, "-m", "loraplex.cli", "serve", "--port", str(port), "--served-model-name", "base",
           "--threads", "1", "--allow-runtime-adapters", "--adapter-root", str(root), "--log-level", "WARNING"]
    if args.model:
        cmd += ["--model", args.model]
    if args.max_num_batched_tokens:
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    url = f"http://127.0.0.1:{port}"
    proc = start(cmd, {}, root / "serve.log", url)
    try:
        results = {}
        for name, attack in tqdm(attacks.items(), desc="attacks"):
            results[name] = asyncio.run(run_phase(url, attack, root, args.victims, args.tokens))
    finally:
        stop(proc)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"# {machine_line()} (load {load}); {args.victims} victims x {args.tokens} tokens; "
          f"--max-num-batched-tokens {args.max_num_batched_tokens or 'default'}")
    print_table(results)
    write_json(args.out, {"machine": machine_line(), "load": os.getloadavg(), "victims": args.victims,
                          "tokens": args.tokens, "max_num_batched_tokens": args.max_num_batched_tokens,
                          "results": results})


if __name__ == "__main__":
    main()
