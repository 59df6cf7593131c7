"""Embeddings (issue 38): embeddings/s of 512 short texts on the embedded SmolLM2, with the base model and over
8 adapters, loraplex (``LLM.embed``: every text a prefill-only pooling row, all adapters mixed in each batch) vs
an HF sentence-transformers-style loop in the same run (``AutoModel`` + PEFT; texts sorted by length, padded
batches of ``--hf-batch``, one adapter per forward: grouped by adapter, ``set_adapter`` between groups;
last-token pooling, normalized); and the TPOT of running generations while a pooling burst arrives.

Burst: 8 greedy generations (one per adapter, EOS ignored) decode; after ``--warm-steps`` steps, ``--burst``
embedding requests (the short texts, round-robin over the adapters) arrive at once. TPOT is the time of each
step that gives the generations a token, split by whether pooling rows were in flight; the gap between two
tokens of a stream while the burst is prefilled is bounded by the step budget (``max_num_batched_tokens``).

    .venv/bin/python -m benchmarks.pooling [--texts 512] [--adapters 8] [--hf-batch 32] [--out FILE]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.common import QUESTIONS, machine_line, write_json, write_random_adapter
from loraplex import LLM, PoolingParams, SamplingParams
from loraplex.models.embedded import embedded_checkpoint
from loraplex.models.registry import model_config


def short_texts(n: int, seed: int = 0) -> list[str]:
    """``n`` texts of one or two questions with a varying tail (~10-40 tokens)."""
    rng = random.Random(seed)
    tails = ["", " Briefly.", " In detail, please.", " For a child.", " As a list."]
    return [rng.choice(QUESTIONS) + rng.choice(tails) + (" " + rng.choice(QUESTIONS) if rng.random() < 0.3 else "")
            for _ in range(n)]


class HFEncoder:
    """The peer: sentence-transformers' loop over HF ``AutoModel`` (the decoder of ``AutoModelForCausalLM``),
    with PEFT holding every adapter (``set_adapter`` picks one per forward)."""

    def __init__(self, folder: Path, adapters: dict[str, Path]) -> None:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.peft = None
        if adapters:
            names = list(adapters)
            self.peft = PeftModel.from_pretrained(model, str(adapters[names[0]]), adapter_name=names[0])
            for name in names[1:]:
                self.peft.load_adapter(str(adapters[name]), adapter_name=name)
            model = self.peft.get_base_model()
        self.decoder = model.model

    @torch.inference_mode()
    def encode(self, prompts: list[list[int]], adapters: list[str | None], batch: int) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(prompts)
        for adapter in dict.fromkeys(adapters):
            if self.peft is not None and adapter is not None:
                self.peft.set_adapter(adapter)
            group = sorted((i for i, a in enumerate(adapters) if a == adapter), key=lambda i: -len(prompts[i]))
            for at in range(0, len(group), batch):
                rows = group[at:at + batch]
                width = len(prompts[rows[0]])
                ids = torch.zeros((len(rows), width), dtype=torch.int64)
                mask = torch.zeros((len(rows), width), dtype=torch.int64)
                for j, i in enumerate(rows):
                    ids[j, :len(prompts[i])], mask[j, :len(prompts[i])] = torch.tensor(prompts[i]), 1
                hidden = self.decoder(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, W, hidden]
                last = hidden[torch.arange(len(rows)), mask.sum(1) - 1]  # [B, hidden]
                for j, i in enumerate(rows):
                    out[i] = torch.nn.functional.normalize(last[j], dim=0)
        return [v for v in out if v is not None]


def timed(fn, repeats: int) -> tuple[float, object]:  # noqa: ANN001
    """The best wall time of ``repeats`` calls of ``fn`` (after one warm-up) and its last result."""
    result = fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def throughput(args: argparse.Namespace, folder: Path, adapters: dict[str, Path]) -> list[dict]:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    texts = short_texts(args.texts)
    prompts = [tokenizer.encode(t) for t in texts]
    llm = LLM(model=str(folder), max_loras=len(adapters), max_cpu_loras=len(adapters), max_lora_rank=16,
              max_num_seqs=256, max_num_batched_tokens=2048)
    for name, path in adapters.items():
        llm.load_adapter(name, path)
    rows = []
    for label, names in (("base", [None] * len(prompts)),
                         (f"{len(adapters)} adapters", [f"a{i % len(adapters)}" for i in range(len(prompts))])):
        peer = HFEncoder(folder, adapters if names[0] else {})
        ours_s, ours = timed(lambda names=names: llm.embed(prompts, PoolingParams("last"), adapters=names,
                                                           use_tqdm=False), args.repeats)
        hf_s, refs = timed(lambda names=names, peer=peer: peer.encode(prompts, names, args.hf_batch), args.repeats)
        error = max(float((torch.tensor(o.embedding) - r).abs().max()) for o, r in zip(ours, refs, strict=True))
        rows.append({"case": label, "texts": len(prompts), "tokens": sum(map(len, prompts)),
                     "loraplex_per_s": len(prompts) / ours_s, "hf_per_s": len(prompts) / hf_s,
                     "ratio": hf_s / ours_s, "max_abs_diff": error})
    return rows


def burst(args: argparse.Namespace, folder: Path, adapters: dict[str, Path]) -> dict:
    """Step an engine by hand: generations decode, a pooling burst arrives, step times are split by phase."""
    llm = LLM(model=str(folder), max_loras=len(adapters), max_cpu_loras=len(adapters), max_lora_rank=16,
              max_num_seqs=256, max_num_batched_tokens=512)
    for name, path in adapters.items():
        llm.load_adapter(name, path)
    engine, tokenizer = llm.engine, AutoTokenizer.from_pretrained(folder)
    gen = SamplingParams(max_tokens=args.warm_steps * 3 + 64, temperature=0.0, ignore_eos=True)
    gen_ids = {engine.add_request(f"gen-{i}", tokenizer.encode(QUESTIONS[i]), gen, engine.adapters.resolve(name))
               for i, name in enumerate(adapters)}
    pooled = SamplingParams(max_tokens=0, pooling=PoolingParams("last"))
    steps: list[tuple[float, bool]] = []  # (seconds, pooling rows in flight) of steps giving the generations a token
    pending: set[str] = set()
    burst_start = burst_end = 0.0
    step = 0
    while pending or step <= args.warm_steps or (burst_end == 0.0):
        if step == args.warm_steps:
            texts = short_texts(args.burst, seed=1)
            names = [f"a{i % len(adapters)}" for i in range(len(texts))]
            pending = {engine.add_request(f"emb-{i}", tokenizer.encode(t), pooled, engine.adapters.resolve(n))
                       for i, (t, n) in enumerate(zip(texts, names, strict=True))}
            burst_start = time.perf_counter()
        in_flight = bool(pending)
        start = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - start
        if any(o.request_id in gen_ids and o.new_token_ids for o in outputs):
            steps.append((seconds, in_flight))
        pending -= {o.request_id for o in outputs if o.finished}
        if in_flight and not pending:
            burst_end = time.perf_counter()
        step += 1
    for request_id in gen_ids:
        engine.abort_request(request_id)
    engine.step()
    quiet = statistics.median(s for s, f in steps if not f)
    loaded = [s for s, f in steps if f]
    return {"burst": args.burst, "generations": len(gen_ids), "burst_seconds": burst_end - burst_start,
            "burst_embeddings_per_s": args.burst / (burst_end - burst_start), "tpot_quiet_ms_p50": 1e3 * quiet,
            "tpot_burst_ms_p50": 1e3 * statistics.median(loaded), "tpot_burst_ms_max": 1e3 * max(loaded),
            "tpot_ratio_p50": statistics.median(loaded) / quiet, "steps_burst": len(loaded)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--texts", type=int, default=512)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--hf-batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--burst", type=int, default=256)
    parser.add_argument("--warm-steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = embedded_checkpoint()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = model_config(folder)
        adapters = {f"a{i}": write_random_adapter(Path(tmp) / f"a{i}", cfg, rank=8 + 8 * (i % 2), seed=i)
                    for i in range(args.adapters)}
        rows = throughput(args, folder, adapters)
        print(f"# {machine_line()}; {args.texts} texts, HF batch {args.hf_batch}, best of {args.repeats}")
        print(f"{'case':>12} {'tokens':>7} {'loraplex emb/s':>15} {'HF emb/s':>9} {'ratio':>6} {'max |diff|':>11}")
        for r in rows:
            print(f"{r['case']:>12} {r['tokens']:>7} {r['loraplex_per_s']:>15.1f} {r['hf_per_s']:>9.1f} "
                  f"{r['ratio']:>5.2f}x {r['max_abs_diff']:>11.2e}")
        b = burst(args, folder, adapters)
    print(f"burst of {b['burst']} embeddings beside {b['generations']} generations: {b['burst_seconds']:.2f} s "
          f"({b['burst_embeddings_per_s']:.1f} emb/s); TPOT p50 {b['tpot_quiet_ms_p50']:.1f} ms quiet, "
          f"{b['tpot_burst_ms_p50']:.1f} ms during the burst ({b['tpot_ratio_p50']:.2f}x), "
          f"max {b['tpot_burst_ms_max']:.1f}")
    write_json(args.out, {"machine": machine_line(), "args": vars(args), "throughput": rows, "burst": b})


if __name__ == "__main__":
    main()
