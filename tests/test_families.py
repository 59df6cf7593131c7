"""Qwen3, Gemma 3 (also with logit soft-capping), Phi-3 and issue 34's families (Gemma 2, Granite, SmolLM3,
Phi-4-mini, Qwen3-MoE, GraniteMoE) end to end against HF transformers + PEFT (float32): mixed batches of
rank-heterogeneous adapters on every projection of the family (``rank_pattern``, ``alpha_pattern``, rsLoRA;
for MoE: attention only, experts only, both, and Qwen3-MoE's router through "all-linear") and base-only rows,
under slot pressure (3 adapters, 2 slots), chunked prefill and prefix caching, 48 greedy tokens from prompts
longer than Gemma's window (Phi-3's sequences cross LongRoPE's switch to the long factors while decoding);
issue 34's families also on int8 base weights against HF + PEFT on the dequantized weights; and adapters of
another family refused with precise errors. MoE specifics (routing, the grouped experts op, adapter
layouts): ``tests/test_families_moe.py``."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from loraplex import LLM, SamplingParams
from loraplex.adapters.reading.peft_format import read_peft_adapter
from loraplex.engine.checks.invariants import keys_hold_all_kv_inputs
from loraplex.errors import AdapterShapeMismatch, InvalidAdapter
from loraplex.models.registry import model_config
from tests.conftest import family_targets
from tests.fixtures import (
    ALL_PROJECTIONS,
    ATTENTION_PROJECTIONS,
    EXPERT_PARAMETERS,
    FAMILIES_34,
    GEMMA3_SLIDING_WINDOW,
    MOE_FAMILIES,
    NEW_FAMILIES,
    PHI3_ORIGINAL_MAX_POSITIONS,
    projections_of,
    write_peft_adapter,
)
from tests.model_harness import assert_logits_close, hf_logits
from tests.reference import greedy_with_adapter, hf_model
from tests.test_int8 import reference_quantize

NEW_TOKENS = 48
CHUNK_TOKENS = 16  # max_num_batched_tokens: prompts longer than this are prefilled in chunks
SHARED_PREFIX = 18  # the second prompt of each adapter starts with the first's 18 tokens (one full KV block)


def architecture(base: Path) -> str:
    return json.loads((base / "config.json").read_text())["architectures"][0]


def dense_adapters(base: Path, root: Path) -> dict[str, Path]:
    """Three adapters covering every projection of the family between them, ranks 2 to 16."""
    projections = projections_of(base)
    first_attn, down = projections[0], projections[-1]  # q_proj / qkv_proj; down_proj
    attn = family_targets(base, ("q_proj", "k_proj", "v_proj", "o_proj"))
    mlp = family_targets(base, ("gate_proj", "up_proj", "down_proj"))
    return {
        "all": write_peft_adapter(base, root / "all", rank=8, alpha=16, seed=1, b_std=0.3,
                                  rank_pattern={first_attn: 4, f"layers.1.mlp.{down}": 12},
                                  alpha_pattern={"o_proj": 5.0}),
        "attn": write_peft_adapter(base, root / "attn", rank=4, alpha=8, seed=2, b_std=0.3, target_modules=attn,
                                   use_rslora=True),
        "mlp": write_peft_adapter(base, root / "mlp", rank=16, alpha=8, seed=3, b_std=0.3, target_modules=mlp,
                                  rank_pattern={mlp[0]: 2}),
    }


def moe_adapters(base: Path, root: Path) -> dict[str, Path]:
    """Attention only, experts only, and both, as PEFT 0.21 writes them on transformers 5: experts through
    ``target_parameters`` (and, for Qwen3-MoE, "all-linear", which PEFT turns into target_parameters on the
    experts and the router, gate_up at twice the rank)."""
    experts = EXPERT_PARAMETERS[architecture(base)]
    container = experts[1].rsplit(".", 1)[0]
    both = (dict(target_modules="all-linear", rank_pattern={"q_proj": 4, "layers.1.mlp.experts.down_proj": 2})
            if architecture(base) == "Qwen3MoeForCausalLM" else
            dict(target_modules=ATTENTION_PROJECTIONS, target_parameters=experts,
                 rank_pattern={"q_proj": 4, f"layers.1.{container}.down_proj": 12}))
    return {
        "all": write_peft_adapter(base, root / "all", rank=8, alpha=16, seed=1, b_std=0.3,
                                  alpha_pattern={"o_proj": 5.0}, **both),
        "attn": write_peft_adapter(base, root / "attn", rank=4, alpha=8, seed=2, b_std=0.3,
                                   target_modules=ATTENTION_PROJECTIONS, use_rslora=True),
        "experts": write_peft_adapter(base, root / "experts", rank=16, alpha=8, seed=3, b_std=0.3, target_modules=[],
                                      target_parameters=experts, rank_pattern={"gate_up_proj": 6}),
    }


@pytest.fixture(scope="module")
def adapters_of(tiny_checkpoint: Callable[[str], Path],
                tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, dict[str, Path]]]:
    """``adapters_of(arch)``: the tiny checkpoint and its three adapters, written once per module."""
    made: dict[str, tuple[Path, dict[str, Path]]] = {}

    def get(arch: str) -> tuple[Path, dict[str, Path]]:
        if arch not in made:
            base = tiny_checkpoint(arch)
            write = moe_adapters if arch in MOE_FAMILIES else dense_adapters
            made[arch] = base, write(base, tmp_path_factory.mktemp(f"{arch}-adapters"))
        return made[arch]

    return get


def family_prompts(seed: int, n: int) -> list[list[int]]:
    """``2 n`` prompts longer than Gemma's window, at most Phi-3's 32 positions; prompt ``n + i`` shares the
    first ``SHARED_PREFIX`` tokens of prompt i."""
    rng = random.Random(seed)
    first = [[rng.randrange(3, 49152) for _ in range(rng.randint(SHARED_PREFIX, 30))] for _ in range(n)]
    second = [p[:SHARED_PREFIX] + [rng.randrange(3, 49152) for _ in range(rng.randint(4, 12))] for p in first]
    prompts = first + second
    assert all(GEMMA3_SLIDING_WINDOW < len(p) <= PHI3_ORIGINAL_MAX_POSITIONS < len(p) + NEW_TOKENS for p in prompts)
    return prompts


def run_mixed_batch(base: Path, adapters: dict[str, Path], reference: Path, quantization: str | None) -> None:
    """The module docstring's mixed run on ``base``, compared with HF + PEFT on ``reference`` (``base`` itself,
    or its dequantized weights for int8)."""
    names = [*adapters, None]
    prompts = family_prompts(5, len(names))
    chosen = [names[i % len(names)] for i in range(len(prompts))]
    llm = LLM(model=str(base), max_loras=2, max_cpu_loras=4, max_lora_rank=16, kv_cache_blocks=256,
              max_num_batched_tokens=CHUNK_TOKENS, debug_checks=True, quantization=quantization)
    for name, folder in adapters.items():
        llm.load_adapter(name, folder)
    steps: list[tuple[list, torch.Tensor]] = []
    execute = llm.engine.runner.execute
    llm.engine.runner.execute = lambda entries, lora: steps.append((entries, execute(entries, lora))) or steps[-1][1]
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
                        adapters=chosen)
    stats = llm.engine.stats()
    assert stats.adapter_counters.device_evictions > 0, "3 adapters over 2 slots must rotate them"
    assert any(e.start_pos > 0 and len(e.token_ids) > 1 for entries, _ in steps for e in entries), "no chunk ran"
    if keys_hold_all_kv_inputs(llm.engine.model, llm.engine.max_model_len):  # off where LongRoPE switches
        assert stats.prefix_cache_hit_tokens > 0, "the shared prefixes were not served from the cache"

    def first_logits(prompt: list[int]) -> torch.Tensor:
        """Our logits after the prompt's last token (the step whose entry completes the prompt)."""
        for entries, logits in steps:
            for row, e in enumerate(entries):
                end = e.start_pos + len(e.token_ids)
                if end == len(prompt) and list(e.token_ids) == prompt[e.start_pos:]:
                    return logits[row]
        raise AssertionError("the prompt's last chunk never ran")

    base_hf = hf_model(reference, None)
    for name in names:
        idx = [i for i, c in enumerate(chosen) if c == name]
        refs = greedy_with_adapter(reference, adapters.get(name), [prompts[i] for i in idx], NEW_TOKENS)
        for i, (tokens, ref_logits) in zip(idx, refs, strict=True):
            ours = first_logits(prompts[i])
            assert_logits_close(ours, ref_logits[0])
            assert outs[i].token_ids == tokens, f"prompt {i} adapter {name}"
            if name is not None:  # the adapter matters: the base model's logits are far off
                assert (ours - hf_logits(base_hf, prompts[i])[-1]).abs().max() > 1e-2 * ours.abs().max()


@pytest.mark.parametrize("arch", [*NEW_FAMILIES, "gemma3capped", *FAMILIES_34])
def test_mixed_batch_under_pressure_equals_hf_peft(arch: str, adapters_of: Callable) -> None:
    base, adapters = adapters_of(arch)
    run_mixed_batch(base, adapters, base, None)


def dequantized_checkpoint(base: Path, folder: Path) -> Path:
    """``base`` with every weight loraplex stores in int8 replaced by its int8 value: each block's linear
    projections, the stacked experts (per expert, per output row), Qwen3-MoE's router, and the lm_head (the
    tied embedding)."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".layers." not in f".{name}" or "norm" in name:
                continue
            if param.dim() == 3:  # stacked experts [E, out, in]
                param.copy_(torch.stack([reference_quantize(w) for w in param]))
            elif name.endswith("weight") and not name.endswith("router.weight"):  # GraniteMoE's router stays float
                param.copy_(reference_quantize(param))
        head = model.get_output_embeddings()
        head.weight.copy_(reference_quantize(head.weight))
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("arch", FAMILIES_34)
def test_int8_base_equals_hf_peft_on_dequantized_weights(arch: str, adapters_of: Callable,
                                                         tmp_path_factory: pytest.TempPathFactory) -> None:
    base, adapters = adapters_of(arch)
    reference = dequantized_checkpoint(base, tmp_path_factory.mktemp(f"{arch}-dequantized"))
    run_mixed_batch(base, adapters, reference, "int8")


@pytest.fixture(scope="module")
def cross_adapters(tiny_checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One all-projection adapter per new family."""
    root = tmp_path_factory.mktemp("cross-adapters")
    return {arch: write_peft_adapter(tiny_checkpoint(arch), root / arch, rank=4, seed=9) for arch in NEW_FAMILIES}


# Module names are checked in sorted order, so the first offending one is an MLP projection's.
@pytest.mark.parametrize(("base_arch", "adapter_arch", "error", "message"), [
    ("phi3", "qwen3", InvalidAdapter, r"module 'model\.layers\.0\.mlp\.gate_proj', which the base "
     r"model \(Phi3ForCausalLM\) does not have.*adaptable: layers\.N\.self_attn\.qkv_proj, layers\.N\.self_attn"
     r"\.o_proj, layers\.N\.mlp\.gate_up_proj, layers\.N\.mlp\.down_proj, embed_tokens, lm_head\)"),
    ("qwen3", "phi3", InvalidAdapter, r"mlp\.gate_up_proj', which the base model \(Qwen3ForCausalLM\) does not have"
     r".*adaptable: layers\.N\.self_attn\.q_proj"),
    ("gemma3", "phi3", InvalidAdapter, r"mlp\.gate_up_proj', which the base model \(Gemma3ForCausalLM\)"),
    ("gemma3", "qwen3", AdapterShapeMismatch, r"layers\.0\.self_attn\.k_proj\.lora_B has shape \[64, 4\], "
     r"expected \[32, 4\] \(rank 4; base k_proj is 64 -> 32\)"),
    ("qwen3", "gemma3", AdapterShapeMismatch, r"layers\.0\.self_attn\.k_proj\.lora_B has shape \[32, 4\], "
     r"expected \[64, 4\]"),
    ("qwen3moe", "qwen3", InvalidAdapter, r"module 'model\.layers\.0\.mlp\.down_proj', which the base model "
     r"\(Qwen3MoeForCausalLM\) does not have.*adaptable: .*layers\.N\.mlp\.gate, layers\.N\.mlp\.experts\.gate_up_proj"
     r", layers\.N\.mlp\.experts\.down_proj"),
])
def test_adapter_of_another_family_is_refused(base_arch: str, adapter_arch: str, error: type, message: str,
                                              tiny_checkpoint: Callable[[str], Path],
                                              cross_adapters: dict[str, Path]) -> None:
    cfg = model_config(tiny_checkpoint(base_arch))
    with pytest.raises(error, match=message) as caught:
        read_peft_adapter(cross_adapters[adapter_arch], cfg, 16)
    assert str(cross_adapters[adapter_arch]) in str(caught.value)


def test_phi3_unfused_target_names_are_unknown_modules(tiny_checkpoint: Callable[[str], Path]) -> None:
    """Phi-3 has no q_proj or gate_proj: the projections it adapts are the fused ones."""
    cfg = model_config(tiny_checkpoint("phi3"))
    assert tuple(cfg.projections()) == projections_of(tiny_checkpoint("phi3"))
    assert not set(ALL_PROJECTIONS[:3]) & set(cfg.projections())
