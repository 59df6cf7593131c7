"""A whole decode step of a Llama-shaped model (random weights) through ``ModelRunner.execute``, at a
number of adapters mixed in the batch, with the torch LoRA ops and with the Triton kernels."""

from __future__ import annotations

from collections.abc import Callable

import torch

from benchmarks.gpu.layers import decode_batch
from loraplex.config import ModelConfig
from loraplex.engine.kv_cache import KVCache
from loraplex.engine.runner import ModelRunner, StepEntry
from loraplex.engine.scheduler.block_manager import BlockManager
from loraplex.layers.lora_linear import LoRALinear, use_lora_kernels
from loraplex.models.families.llama import LlamaForCausalLM
from loraplex.models.registry import model_config


def llama_config(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int) -> ModelConfig:
    return model_config({
        "architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "max_position_embeddings": 8192, "tie_word_embeddings": False})


def random_model(cfg: ModelConfig, max_loras: int, rank: int, adapters: int, dtype: torch.dtype,
                 device: torch.device) -> LlamaForCausalLM:
    """Random base weights; ``adapters`` rank-``rank`` adapters on all seven projections in slots 0.."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg, max_loras, rank, dtype, device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
        for m in model.modules():
            if isinstance(m, LoRALinear):
                for s in range(adapters):
                    m.set_slot(s, {n: (torch.randn(rank, m.in_features, device=device, dtype=dtype) * 0.02,
                                       torch.randn(o, rank, device=device, dtype=dtype) * 0.02)
                                   for n, o in zip(m.names, m.out_features, strict=True)})
    return model


def decode_steps(cfg: ModelConfig, adapter_counts: list[int], batch: int, context: int, rank: int,
                 dtype: torch.dtype, device: torch.device, reps: int,
                 timer: Callable[[dict[str, Callable[[], None]], int], dict[str, float]]) -> list[dict]:
    """Median ms of one decode step of ``batch`` sequences at ``context`` tokens, per adapter count (the
    first count must be 0: the base model's step, which the others are compared with)."""
    if adapter_counts[0] != 0:
        raise ValueError("adapter_counts must start with 0 (the base step)")
    max_loras = max(max(adapter_counts), 1)
    model = random_model(cfg, max_loras, rank, max(adapter_counts), dtype, device)
    block_size = 16
    blocks_per_seq = -(-(context + 1) // block_size)
    kv = KVCache(cfg, batch * blocks_per_seq, block_size, dtype, device)
    allocator = BlockManager(kv.num_blocks, kv.block_size, enable_caching=False)
    entries = [StepEntry((7 + i,), context, tuple(allocator.allocate(blocks_per_seq, None))) for i in range(batch)]
    runner = ModelRunner(model, kv, block_size)
    linears = [m for m in model.modules() if isinstance(m, LoRALinear)]
    use_lora_kernels(model, "triton", batch)
    kernels = {"torch": None, "triton": linears[0].step_buffers}  # what each layer's step_buffers is set to
    rows = []
    for n in adapter_counts:
        lora = decode_batch(batch, n, 0.0, seed=n) if n else None

        def step(kind: str, lora=lora) -> Callable[[], None]:
            def run() -> None:
                for m in linears:  # interleaved variants: point every layer at its path
                    m.step_buffers = kernels[kind]
                runner.execute(entries, lora)
            return run

        ms = {k: v / 1e3 for k, v in timer({"torch": step("torch"), "triton": step("triton")}, reps).items()}
        rows.append({"adapters": n, "batch": batch, "context": context, **{f"{k}_ms": v for k, v in ms.items()},
                     **{f"{k}_tok_s": batch / v * 1e3 for k, v in ms.items()}})
    base = (rows[0]["torch_ms"] + rows[0]["triton_ms"]) / 2  # 0 adapters: the base model's step, both paths idle
    for row in rows:
        row["torch_vs_base"], row["triton_vs_base"] = row["torch_ms"] / base, row["triton_ms"] / base
    return rows
