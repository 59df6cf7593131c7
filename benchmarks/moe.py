"""Mixture-of-experts decode throughput, LoRA on the experts, int8 base weights, against the dense model of
equal active parameters and HF transformers ``generate``, all in one run.

The model: ``Qwen3MoeForCausalLM`` with OLMoE-1B-7B's per-layer shapes (hidden 2048, 16 heads of 128, 64
experts of width 1024, top 8, vocabulary 50304; OLMoE's own attention normalises q/k over the whole
projection where Qwen3-MoE's does per head, the same FLOPs) and random weights, ``--layers`` of OLMoE's 16
(default 1: HF's float32 copy, loraplex's int8 engines and 32 adapters then take ~6 GiB of this shared 23 GiB
machine, ~10 GiB at 2 layers; ``--float`` adds loraplex's float32 engine, another ~2.5 GiB a layer). Its
dense equivalent: ``Qwen3ForCausalLM`` with the same attention and an MLP of width 8 x 1024 (the active
expert parameters per token), same layers.

Workloads (greedy, EOS ignored, ``--tokens`` new tokens from 16-token prompts), every engine built first, then
``--repeats`` interleaved rounds; the table gives the median tok/s [range] and the median pure-decode step:

- MoE int8: batch 1 (base; one adapter), batch 32 (base; 8 adapters; 32 adapters, max_loras 32); adapters are
  rank-``--rank`` LoRA on every expert's gate_up and down (PEFT's ``target_parameters`` layout);
- MoE float32 (loraplex), batch 1 and 32, base, with ``--float``: the same precision as HF's;
- dense equivalent int8, batch 1 and 32, base;
- HF ``generate`` float32 on the MoE checkpoint, batch 1 and 32.

Expert-grouping overhead, at batch 1 and 32 on block 0 of the int8 MoE engine, base and with 32 adapters: the
MoE block (router, grouping, every expert's matmuls, LoRA, weighting and the scatter) over the sum of the same
routing's expert matmuls alone; and the decode step over every layer's expert matmuls.

``--threads 1 --clock thread`` times everything in this thread's CPU seconds (tok/s per CPU second): on a
shared, loaded host that is the comparison that holds (wall time there counts other jobs' time).

    python -m benchmarks.moe [--layers 1] [--tokens 32] [--repeats 3] [--rank 8] [--threads 2]
        [--clock wall|thread] [--no-hf] [--float] [--out results.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3MoeConfig

from benchmarks.common import machine_line, peak_rss_mib, step_clock, write_json
from loraplex import LLM, SamplingParams
from loraplex.layers.moe import SparseMoE, route
from loraplex.models.embedded import embedded_checkpoint
from loraplex.models.registry import model_config
from loraplex.ops.moe_groups import group_by_expert, lora_batch_from_slots

CLOCK: list[Callable[[], float]] = [time.perf_counter]  # the clock every timing reads (``--clock``)
OLMOE_SHAPES = dict(vocab_size=50304, hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, head_dim=128,
                    max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False, rope_theta=10000.0,
                    bos_token_id=1, eos_token_id=2)
EXPERTS = dict(num_experts=64, num_experts_per_tok=8, moe_intermediate_size=1024, norm_topk_prob=False)


def write_checkpoint(folder: Path, config: Qwen3Config | Qwen3MoeConfig) -> None:
    """A random-weight checkpoint of ``config`` in ``folder`` (SmolLM2's tokenizer beside it)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(embedded_checkpoint()).save_pretrained(folder)
    del model
    gc.collect()


def write_expert_adapter(folder: Path, base: Path, rank: int, seed: int, b_std: float = 0.05) -> Path:
    """A PEFT adapter as PEFT 0.21 saves LoRA on the stacked experts (``target_parameters``): per layer
    ``mlp.experts.base_layer.lora_{A,B}`` (gate_up) and ``mlp.experts.lora_{A,B}`` (down)."""
    cfg = model_config(base)
    e, h, i = cfg.experts.num_experts, cfg.hidden_size, cfg.experts.intermediate_size
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        prefix = f"base_model.model.model.layers.{layer}.mlp.experts"
        for key, fan_in, fan_out in ((f"{prefix}.base_layer", h, 2 * i), (prefix, i, h)):
            tensors[f"{key}.lora_A.weight"] = torch.randn(e * rank, fan_in, generator=gen) / fan_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank * e, generator=gen) * b_std
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank, "target_modules": [],
              "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], "bias": "none",
              "lora_dropout": 0.0, "base_model_name_or_path": str(base)}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return folder


def timed_generate(llm: LLM, prompts: list[list[int]], adapters: list[str | None], tokens: int) -> dict:
    """tok/s of the whole run, and the median step time of pure decode steps of the full batch."""
    engine, batch = llm.engine, len(prompts)
    schedule, step = engine.scheduler.schedule, engine.step
    shape: list[tuple[int, int]] = []
    decode_ms: list[float] = []

    def schedule_hook():  # noqa: ANN202
        scheduled = schedule()
        shape.append((len(scheduled), sum(s.num_tokens for s in scheduled)))
        return scheduled

    def step_hook():  # noqa: ANN202
        start = CLOCK[0]()
        out = step()
        if shape and shape[-1][0] == shape[-1][1] == batch:
            decode_ms.append((CLOCK[0]() - start) * 1e3)
        shape.clear()
        return out

    engine.scheduler.schedule, engine.step = schedule_hook, step_hook
    start = CLOCK[0]()
    outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True),
                        adapters=adapters, use_tqdm=False)
    elapsed = CLOCK[0]() - start
    engine.scheduler.schedule, engine.step = schedule, step
    return {"tok_s": sum(len(o.token_ids) for o in outs) / elapsed,
            "decode_step_ms": statistics.median(decode_ms) if decode_ms else None}


def hf_generate(model: torch.nn.Module, prompts: list[list[int]], tokens: int) -> dict:
    """HF ``generate`` (greedy, fixed length) on equal-length prompts."""
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        start = CLOCK[0]()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                             do_sample=False, pad_token_id=0)
        elapsed = CLOCK[0]() - start
    return {"tok_s": (out.shape[1] - ids.shape[1]) * len(prompts) / elapsed, "decode_step_ms": None}


def median_ms(fn: Callable[[], object], repeats: int = 20) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = CLOCK[0]()
        fn()
        times.append((CLOCK[0]() - start) * 1e3)
    return statistics.median(times)


@torch.inference_mode()
def grouping_overhead(llm: LLM, batch: int, adapters: bool) -> dict:
    """Block 0's MoE forward over the same routing's expert matmuls alone (and the ms of each)."""
    block: SparseMoE = llm.engine.model.layers[0].mlp
    moe, h = block.moe, llm.engine.model_config.hidden_size
    x = torch.randn(batch, h, generator=torch.Generator().manual_seed(batch))
    lora = lora_batch_from_slots(torch.arange(batch) % 32, llm.engine.adapters.slot_table.version) if adapters else None
    weights, experts = route(block.gate(x, lora), block.config, x.dtype)
    groups = group_by_expert(experts, weights, block.config.num_experts)
    runs = groups.runs()
    rows = x.index_select(0, groups.tokens)
    hidden = torch.randn(rows.shape[0], moe.intermediate)

    def matmuls() -> None:
        for e, lo, hi in runs:
            moe._matmul("gate_up", e, rows[lo:hi])
            moe._matmul("down", e, hidden[lo:hi])

    block_ms, matmul_ms = median_ms(lambda: block(x, lora)), median_ms(matmuls)
    return {"block_ms": block_ms, "expert_matmuls_ms": matmul_ms, "ratio": block_ms / matmul_ms,
            "experts_hit": len(runs)}


def build(root: Path, args: argparse.Namespace) -> tuple[dict, torch.nn.Module | None, list[str]]:
    """The checkpoints, adapters and engines (name -> LLM), and the HF model (loaded last: each engine's float
    weights are gone by then, so only one float copy of the model is ever resident at a time)."""
    moe_dir, dense_dir = root / "moe", root / "dense"
    write_checkpoint(moe_dir, Qwen3MoeConfig(**OLMOE_SHAPES, **EXPERTS, num_hidden_layers=args.layers,
                                             intermediate_size=8 * 1024))
    write_checkpoint(dense_dir, Qwen3Config(**OLMOE_SHAPES, num_hidden_layers=args.layers,
                                            intermediate_size=EXPERTS["num_experts_per_tok"] * 1024))
    names = [f"a{i}" for i in range(32)]
    folders = {name: write_expert_adapter(root / name, moe_dir, args.rank, seed=i) for i, name in enumerate(names)}
    common = dict(max_lora_rank=args.rank, kv_cache_blocks=256, enable_prefix_caching=False,
                  num_threads=args.threads)
    engines = {"moe_int8": LLM(model=str(moe_dir), max_loras=32, max_cpu_loras=32, quantization="int8", **common),
               "dense_int8": LLM(model=str(dense_dir), max_loras=1, quantization="int8", **common)}
    if args.float:
        engines["moe_f32"] = LLM(model=str(moe_dir), max_loras=1, **common)
    for name, folder in folders.items():
        engines["moe_int8"].load_adapter(name, folder)
    gc.collect()
    hf = None if args.no_hf else AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    return engines, hf, names


def workloads(engines: dict, hf: torch.nn.Module | None, names: list[str], tokens: int) -> dict[str, Callable]:
    gen = torch.Generator().manual_seed(1)
    prompts = {b: torch.randint(3, 49152, (b, 16), generator=gen).tolist() for b in (1, 32)}
    moe = engines["moe_int8"]
    runs = {
        "MoE int8, batch 1, base": lambda: timed_generate(moe, prompts[1], [None], tokens),
        "MoE int8, batch 1, 1 adapter": lambda: timed_generate(moe, prompts[1], names[:1], tokens),
        "MoE int8, batch 32, base": lambda: timed_generate(moe, prompts[32], [None] * 32, tokens),
        "MoE int8, batch 32, 8 adapters": lambda: timed_generate(moe, prompts[32], [names[i % 8] for i in range(32)],
                                                                 tokens),
        "MoE int8, batch 32, 32 adapters": lambda: timed_generate(moe, prompts[32], names, tokens),
        "dense equivalent int8, batch 1": lambda: timed_generate(engines["dense_int8"], prompts[1], [None], tokens),
        "dense equivalent int8, batch 32": lambda: timed_generate(engines["dense_int8"], prompts[32], [None] * 32,
                                                                  tokens),
    }
    if "moe_f32" in engines:
        runs["MoE float32 (loraplex), batch 1"] = lambda: timed_generate(engines["moe_f32"], prompts[1], [None], tokens)
        runs["MoE float32 (loraplex), batch 32"] = lambda: timed_generate(engines["moe_f32"], prompts[32], [None] * 32,
                                                                          tokens)
    if hf is not None:
        runs["HF generate float32, batch 1"] = lambda: hf_generate(hf, prompts[1], tokens)
        runs["HF generate float32, batch 32"] = lambda: hf_generate(hf, prompts[32], tokens)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall",
                        help="thread: this thread's CPU time (needs --threads 1)")
    parser.add_argument("--no-hf", action="store_true", help="skip HF generate (its float32 copy of the model)")
    parser.add_argument("--float", action="store_true", help="also loraplex's float32 MoE engine")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    CLOCK[0] = step_clock(parser, args)
    with tempfile.TemporaryDirectory() as tmp:
        engines, hf, names = build(Path(tmp), args)
        gc.collect()
        runs = workloads(engines, hf, names, args.tokens)
        for run in runs.values():  # warm-up (kernel builds, first slot writes)
            run()
        results: dict[str, list[dict]] = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, run in runs.items():
                results[name].append(run())
        overhead = {f"batch {b}, {'32 adapters' if a else 'base'}": grouping_overhead(engines["moe_int8"], b, a)
                    for b in (1, 32) for a in (False, True)}
    report(args, results, overhead)


def report(args: argparse.Namespace, results: dict[str, list[dict]], overhead: dict[str, dict]) -> None:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"# {machine_line()} (load {load}); Qwen3-MoE with OLMoE-1B-7B's shapes, {args.layers} of 16 layers, "
          f"{args.tokens} new tokens, {args.repeats} interleaved rounds, {args.clock} clock; adapters rank "
          f"{args.rank} on every expert")
    print("| workload | tok/s median [range] | decode step ms |\n|---|---|---|")
    summary = {}
    for name, runs in results.items():
        tok = [r["tok_s"] for r in runs]
        steps = [r["decode_step_ms"] for r in runs if r["decode_step_ms"] is not None]
        summary[name] = {"tok_s": statistics.median(tok), "tok_s_range": [min(tok), max(tok)],
                         "decode_step_ms": statistics.median(steps) if steps else None}
        step = f"{summary[name]['decode_step_ms']:.1f}" if steps else "-"
        print(f"| {name} | {statistics.median(tok):.1f} [{min(tok):.1f}-{max(tok):.1f}] | {step} |")
    print("\n| expert grouping (block 0, int8) | MoE block ms | its expert matmuls ms | ratio | experts hit |")
    print("|---|---|---|---|---|")
    for name, o in overhead.items():
        print(f"| {name} | {o['block_ms']:.2f} | {o['expert_matmuls_ms']:.2f} | {o['ratio']:.2f} | "
              f"{o['experts_hit']} |")
    for key in ("MoE int8, batch 32, base", "MoE int8, batch 32, 32 adapters"):
        step = summary[key]["decode_step_ms"]
        if step is not None:
            matmuls = overhead["batch 32, " + ("32 adapters" if "adapters" in key else "base")]["expert_matmuls_ms"]
            ratio = step / (matmuls * args.layers)
            print(f"{key}: decode step / all {args.layers} layers' expert matmuls = {ratio:.2f}")
    print(f"peak RSS {peak_rss_mib():.0f} MiB")
    write_json(args.out, {"machine": machine_line(), "args": vars(args), "workloads": summary,
                          "runs": results, "grouping_overhead": overhead, "peak_rss_mib": peak_rss_mib()})


if __name__ == "__main__":
    main()
