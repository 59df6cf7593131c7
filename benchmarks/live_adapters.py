"""Live adapter updates (issue 31): how long from handing the engine a new version's tensors to the first token
that version serves, in process and over HTTP, and what updates cost a loop of streams.

- In process: ``LLM.load_adapter(name, tensors=..., config=..., new_version=True)`` then ``generate`` of one
  token, against the same ``generate`` with no update before it (the first token's own cost).
- Over HTTP (``loraplex serve``'s shape: the engine in its own process): ``PUT /v1/adapters/{name}`` then a
  streamed completion, from the PUT's first byte to the first token's chunk; against the completion alone.
- RL loop: ``--streams`` clients stream completions of the adapter for ``--seconds``, with a PUT every
  ``--update-every`` seconds and without; generated tokens per second of each.

A rank-``--rank`` adapter on all seven projections of the embedded SmolLM2 (19 MB at rank 16). Goals: in
process <= 30 ms, over HTTP <= 120 ms, throughput with updates every second >= 0.9x. Prints a table and
writes JSON (``--out``).

    .venv/bin/python -m benchmarks.live_adapters [--rounds 10] [--streams 16] [--seconds 15] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import safetensors.torch
import torch
import uvicorn

from benchmarks.common import machine_line, write_json, write_random_adapter
from loraplex import LLM, SamplingParams
from loraplex.client.process import EngineProcess
from loraplex.config import EngineConfig, ModelConfig
from loraplex.models.embedded import embedded_checkpoint
from loraplex.server.app import create_app

PROMPT = [1, 504, 3458, 314, 260, 1345, 28]  # a short prompt: the first token's prefill is small
NAME = "live"


def versions(rank: int, count: int) -> tuple[list[dict[str, torch.Tensor]], str]:
    """``count`` random rank-``rank`` state dicts of one adapter and its config's JSON text."""
    config = ModelConfig.from_hf(embedded_checkpoint())
    with tempfile.TemporaryDirectory() as tmp:
        out = []
        for seed in range(count):
            folder = write_random_adapter(Path(tmp) / str(seed), config, rank, seed)
            out.append(safetensors.torch.load_file(folder / "adapter_model.safetensors"))
        text = (folder / "adapter_config.json").read_text()
    return out, text


def in_process(args: argparse.Namespace, steps: list[dict[str, torch.Tensor]], config: str) -> dict[str, list[float]]:
    llm = LLM(max_loras=2, max_lora_rank=args.rank, num_threads=args.threads)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    llm.load_adapter(NAME, tensors=steps[0], config=config)
    llm.generate(PROMPT, params, adapters=NAME, use_tqdm=False)  # warm-up
    times: dict[str, list[float]] = {"load_ms": [], "first_token_ms": [], "no_update_first_token_ms": []}
    for i in range(args.rounds):
        start = time.perf_counter()
        llm.generate(PROMPT, params, adapters=NAME, use_tqdm=False)
        times["no_update_first_token_ms"].append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        llm.load_adapter(NAME, tensors=steps[1 + i % (len(steps) - 1)], config=config, new_version=True)
        loaded = time.perf_counter()
        out = llm.generate(PROMPT, params, adapters=NAME, use_tqdm=False)
        assert len(out[0].token_ids) == 1
        times["load_ms"].append((loaded - start) * 1e3)
        times["first_token_ms"].append((time.perf_counter() - start) * 1e3)
    llm.engine.adapters.close()
    return times


class Served:
    """``create_app`` over an ``EngineProcess`` on a free port, in a thread (what ``loraplex serve`` runs)."""

    def __init__(self, args: argparse.Namespace) -> None:
        config = EngineConfig(max_loras=2, max_lora_rank=args.rank, num_threads=args.threads,
                              max_num_seqs=max(args.streams, 1))
        self.client = EngineProcess(config, [])
        self.client.start()
        app = create_app(self.client, allow_runtime_adapters=True, max_request_bytes=64 << 20, prepare_processes=0)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.client.shutdown()


def first_chunk(client: httpx.Client, url: str, max_tokens: int = 1) -> int:
    """Stream one completion of the adapter; returns its generated tokens (timing is the caller's)."""
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    tokens = 0
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                tokens += bool(json.loads(line[6:])["choices"])
    return tokens


def over_http(served: Served, args: argparse.Namespace, steps: list[dict[str, torch.Tensor]],
              config: str) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"put_ms": [], "first_token_ms": [], "no_update_first_token_ms": []}
    bodies = [safetensors.torch.save(t, {"adapter_config": config}) for t in steps]
    with httpx.Client(timeout=120) as client:
        client.put(f"{served.url}/v1/adapters/{NAME}", content=bodies[0],
                   headers={"Content-Type": "application/octet-stream"}).raise_for_status()
        first_chunk(client, served.url)  # warm-up
        for i in range(args.rounds):
            start = time.perf_counter()
            first_chunk(client, served.url)
            times["no_update_first_token_ms"].append((time.perf_counter() - start) * 1e3)
            start = time.perf_counter()
            client.put(f"{served.url}/v1/adapters/{NAME}", content=bodies[1 + i % (len(steps) - 1)],
                       headers={"Content-Type": "application/octet-stream"}).raise_for_status()
            put_done = time.perf_counter()
            first_chunk(client, served.url)
            times["put_ms"].append((put_done - start) * 1e3)
            times["first_token_ms"].append((time.perf_counter() - start) * 1e3)
    return times


async def rl_loop(served: Served, args: argparse.Namespace, bodies: list[bytes], update_every: float | None) -> float:
    """Generated tokens per second of ``--streams`` streaming clients over ``--seconds``, PUTting a new version
    every ``update_every`` seconds (None: never)."""
    deadline = time.perf_counter() + args.seconds
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=args.streams + 4)) as client:
        async def stream() -> int:
            tokens = 0
            while time.perf_counter() < deadline:
                async with client.stream("POST", f"{served.url}/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        tokens += line.startswith("data: {") and bool(json.loads(line[6:])["choices"])
            return tokens

        async def trainer() -> None:
            i = 0
            while update_every is not None and time.perf_counter() + update_every < deadline:
                await asyncio.sleep(update_every)
                r = await client.put(f"{served.url}/v1/adapters/{NAME}", content=bodies[i % len(bodies)],
                                     headers={"Content-Type": "application/octet-stream"})
                r.raise_for_status()
                i += 1

        start = time.perf_counter()
        counts = await asyncio.gather(*(stream() for _ in range(args.streams)), trainer())
        return sum(counts[:-1]) / (time.perf_counter() - start)


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} (min {min(values):.1f}, max {max(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=10, help="timed updates in process and over HTTP")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=15.0, help="each RL-loop run (with, then without updates)")
    parser.add_argument("--update-every", type=float, default=1.0, help="seconds between updates in the RL loop")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--skip-rl", action="store_true")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    steps, config = versions(args.rank, 4)
    result: dict = {"machine": machine_line(), "rank": args.rank, "in_process": in_process(args, steps, config)}
    served = Served(args)
    try:
        result["http"] = over_http(served, args, steps, config)
        if not args.skip_rl:
            bodies = [safetensors.torch.save(t, {"adapter_config": config}) for t in steps]
            with_updates = asyncio.run(rl_loop(served, args, bodies, args.update_every))
            without = asyncio.run(rl_loop(served, args, bodies, None))
            result["rl_loop"] = {"streams": args.streams, "update_every_s": args.update_every,
                                 "tok_s_with_updates": with_updates, "tok_s_without": without,
                                 "ratio": with_updates / without}
    finally:
        served.close()
    print(result["machine"])
    for where in ("in_process", "http"):
        for key, values in result[where].items():
            print(f"{where:10s} {key:26s} {summary(values)} ms")
    if "rl_loop" in result:
        rl = result["rl_loop"]
        print(f"RL loop, {rl['streams']} streams: {rl['tok_s_with_updates']:.1f} tok/s with an update every "
              f"{rl['update_every_s']:g} s, {rl['tok_s_without']:.1f} without: {rl['ratio']:.3f}x")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
