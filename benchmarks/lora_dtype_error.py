"""What bfloat16 adapter weights (``EngineConfig.lora_dtype="bfloat16"``) change in SmolLM2's logits.

Eight random rank-16 adapters on all seven projections (A ~ N(0, 1/in), B ~ N(0, 0.09^2): clearly
different from the base, still coherent), each serving one prompt of real text in one prefill step with
every token's logits, once from float32 slots and once from the same adapters rounded to bfloat16 slots
(scale folded before rounding, as the engine does). Reports the largest and mean absolute logit
difference, the size of what the adapters change (float32 adapter logits - base logits) for scale, and
how many positions' greedy token differ. Prints a table; ``--out PATH`` writes JSON.

    python -m benchmarks.lora_dtype_error [--adapters 8] [--tokens 96] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from transformers import AutoTokenizer

from benchmarks.decode_step import RANK, bfloat16_slots, with_slots, write_adapters
from loraplex.engine.kv_cache import KVCache
from loraplex.engine.runner import ModelRunner, StepEntry
from loraplex.layers.lora_linear import LoRALinear, use_lora_kernels
from loraplex.models.embedded import embedded_checkpoint
from loraplex.models.loader import load_model
from loraplex.ops.lora import resolve_lora_kernels
from loraplex.ops.lora_batch import BatchMapping, build_lora_batch

TEXT = Path(__file__).with_name("data") / "python_topics.txt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=96, help="prompt tokens per adapter")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    folder = embedded_checkpoint()
    model = load_model(folder, None, args.adapters, RANK, torch.float32, "cpu")
    use_lora_kernels(model, resolve_lora_kernels("auto", torch.device("cpu")), 0)  # sgmv where it builds
    write_adapters(model, args.adapters)
    ids = AutoTokenizer.from_pretrained(folder)(TEXT.read_text())["input_ids"]
    n, block = args.tokens, 16
    blocks_per_seq = (n + block - 1) // block
    kv = KVCache(model.config, args.adapters * blocks_per_seq, block, torch.float32, "cpu")
    runner = ModelRunner(model, kv, block)
    entries = [StepEntry(tuple(ids[i * n : (i + 1) * n]), 0, tuple(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
                         all_logits=True) for i in range(args.adapters)]
    mapping = BatchMapping.from_sequences([(i, n) for i in range(args.adapters)])
    lora = build_lora_batch(mapping, {i: i for i in range(args.adapters)}, 0)
    linears = [m for m in model.modules() if isinstance(m, LoRALinear)]
    with torch.inference_mode():
        base = runner.execute(entries, None)
        f32 = runner.execute(entries, lora)
        bf16 = torch.empty(0)

        def run_bf16() -> None:
            nonlocal bf16
            bf16 = runner.execute(entries, lora)

        with_slots(bfloat16_slots(linears), run_bf16)
    diff = (bf16 - f32).abs()
    result = {"adapters": args.adapters, "positions": f32.shape[0], "max_abs_logit_diff": diff.max().item(),
              "mean_abs_logit_diff": diff.mean().item(), "max_abs_logit": f32.abs().max().item(),
              "max_abs_adapter_effect": (f32 - base).abs().max().item(),
              "mean_abs_adapter_effect": (f32 - base).abs().mean().item(),
              "greedy_differs": int((bf16.argmax(-1) != f32.argmax(-1)).sum()),
              "load_average": os.getloadavg()[0]}
    print(f"{'positions':>9} {'max|dlogit|':>11} {'mean|dlogit|':>12} {'max|logit|':>10} {'max|adapter effect|':>19} "
          f"{'mean|adapter effect|':>20} {'greedy differs':>14}")
    print(f"{result['positions']:>9} {result['max_abs_logit_diff']:>11.4f} {result['mean_abs_logit_diff']:>12.5f} "
          f"{result['max_abs_logit']:>10.2f} {result['max_abs_adapter_effect']:>19.3f} "
          f"{result['mean_abs_adapter_effect']:>20.4f} {result['greedy_differs']:>14}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
