"""Speculative decoding (n-gram prompt lookup) on and off, SmolLM2-135M with a LoRA adapter, in one run.

Two workloads, greedy, EOS ignored, ``--tokens`` new tokens per request:
- extraction: the answer copies spans of the prompt (a passage of ``benchmarks/data/python_topics.txt`` and
  "Repeat the passage above exactly."), the case prompt lookup is for;
- free chat: the chat questions of ``benchmarks/common.py``, little to copy.
At batch 1, 4 and 32 (the same prompts on both engines), interleaved ``--repeats`` rounds, median decode
tokens per CPU second (prefill left out; CPU time, as this host is shared: ``decode_rate``),
the on/off ratio, and the acceptance rate (accepted / draft tokens) of the speculating engine. Goals (issue 37):
batch-1 extraction >= 1.8x; batch 32 >= 0.97x (speculation switches itself off past
``disable_by_batch_size``); free chat >= 0.97x. Outputs of both engines are compared (greedy: identical).

    python -m benchmarks.speculative [--tokens 64] [--repeats 2] [--threads 1] [--batches 1 4 32] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import chat_prompts, machine_line, write_json, write_random_adapter
from loraplex import LLM, SamplingParams

TEXT = Path(__file__).parent / "data" / "python_topics.txt"
BATCHES = (1, 4, 32)
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def extraction_prompts(tokenizer, n: int, passage_tokens: int = 120) -> list[list[int]]:  # noqa: ANN001
    """``n`` chat prompts, each a different passage of the text, an instruction to repeat it, and the answer's
    first 8 tokens (the passage's: a 135M model paraphrases an instruction alone; once quoting, it copies)."""
    ids = tokenizer.encode(TEXT.read_text())
    prompts = []
    for i in range(n):
        span = ids[i * passage_tokens : (i + 1) * passage_tokens]
        message = f"{tokenizer.decode(span)}\n\nRepeat the passage above exactly, word for word."
        chat = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]
        prompts.append(list(chat) + span[:8])  # the answer has begun quoting: it goes on copying
    return prompts


def run(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]], tuple[int, int]]:
    """(CPU seconds of this process, outputs, (draft tokens, accepted tokens)) of one ``generate``."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    before = llm.stats()
    start = time.process_time()
    outs = llm.generate(prompts, params, adapters="a", use_tqdm=False)
    seconds = time.process_time() - start
    after = llm.stats()
    drafts = (after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
              after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens)
    return seconds, [o.token_ids for o in outs], drafts


def decode_rate(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]], tuple[int, int]]:
    """(decode tokens per CPU second, outputs, drafts): the run's CPU time less that of the same prompts'
    prefill and first token (a ``max_tokens=1`` run; prefix caching is off, so both prefill alike), over the
    tokens after each request's first. CPU time, not wall: this host is shared, and with ``--threads 1``
    every kernel runs in this thread."""
    prefill, _, _ = run(llm, prompts, 1)
    seconds, outs, drafts = run(llm, prompts, tokens)
    return sum(len(o) - 1 for o in outs) / max(seconds - prefill, 1e-9), outs, drafts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="1: CPU time is the kernels' time (see decode_rate)")
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--workloads", nargs="+", choices=("extraction", "chat"), default=["extraction", "chat"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = dict(max_loras=1, kv_cache_blocks=2048, enable_prefix_caching=False)
    engines = {"off": LLM(**config), "on": LLM(speculative_config=SPEC, **config)}
    with tempfile.TemporaryDirectory() as tmp:
        adapter = write_random_adapter(Path(tmp) / "a", engines["off"].engine.model_config, rank=16, seed=1,
                                       b_std=0.02)
        for llm in engines.values():
            llm.load_adapter("a", adapter)
    tokenizer = engines["off"].tokenizer
    makers = {"extraction": extraction_prompts, "chat": chat_prompts}
    workloads = {name: makers[name](tokenizer, max(args.batches)) for name in args.workloads}
    for llm in engines.values():  # warm-up
        run(llm, chat_prompts(tokenizer, 2), 4)
    results: dict = {"machine": machine_line(), "load_average_start": os.getloadavg()[0], "tokens": args.tokens,
                     "speculative_config": SPEC, "cases": {}}
    for workload, prompts in workloads.items():
        for batch in args.batches:
            case = {"tok_per_cpu_s": {"on": [], "off": []}, "identical": True, "draft_tokens": 0,
                    "accepted_tokens": 0}
            for _ in range(args.repeats):
                outs = {}
                for name, llm in engines.items():
                    rate, outs[name], (drafted, accepted) = decode_rate(llm, prompts[:batch], args.tokens)
                    case["tok_per_cpu_s"][name].append(rate)
                    case["draft_tokens"] += drafted
                    case["accepted_tokens"] += accepted
                case["identical"] &= outs["on"] == outs["off"]
            on, off = (statistics.median(case["tok_per_cpu_s"][k]) for k in ("on", "off"))
            case.update(median_on=on, median_off=off, ratio=on / off,
                        acceptance=case["accepted_tokens"] / case["draft_tokens"] if case["draft_tokens"] else None)
            results["cases"][f"{workload}_batch{batch}"] = case
            print(f"{workload:>10} batch {batch:>2}: decode off {off:7.1f}, on {on:7.1f} tokens per CPU second, ratio "
                  f"{on / off:5.2f}x, acceptance {case['acceptance'] or 0:.2f} ({case['draft_tokens']} drafted), "
                  f"identical {case['identical']}", flush=True)
    results["load_average_end"] = os.getloadavg()[0]
    print(f"\n# {results['machine']}; load average {results['load_average_start']:.1f} -> "
          f"{results['load_average_end']:.1f}; {args.tokens} tokens per request, greedy, adapter rank 16, "
          f"{args.repeats} interleaved rounds, median")
    print("| workload | batch | decode off tok/CPU-s | decode on tok/CPU-s | on/off | acceptance | identical |")
    print("|---|---|---|---|---|---|---|")
    for key, case in results["cases"].items():
        workload, batch = key.rsplit("_batch", 1)
        acceptance = f"{case['acceptance']:.2f}" if case["acceptance"] is not None else "-"
        print(f"| {workload} | {batch} | {case['median_off']:.1f} | {case['median_on']:.1f} | {case['ratio']:.2f}x "
              f"| {acceptance} | {case['identical']} |")
    write_json(str(args.out) if args.out else None, results)


if __name__ == "__main__":
    main()
