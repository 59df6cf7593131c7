"""Mixture-of-experts specifics: routing and the grouped experts op against float64 loops, engines where
every expert serves tokens of several adapters in one step and others leave experts idle (against HF +
PEFT, token for token), and the adapter layouts PEFT 0.21 writes for experts (served) or does not (refused
precisely)."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from loraplex import LLM, SamplingParams
from loraplex.adapters.reading.peft_format import read_peft_adapter
from loraplex.config import ExpertConfig
from loraplex.errors import AdapterRankTooLarge, AdapterShapeMismatch, InvalidAdapter, ModelError, UnsupportedAdapter
from loraplex.layers.moe import MoEExperts, route
from loraplex.models.registry import model_config
from loraplex.ops.moe_groups import group_by_expert, lora_batch_from_slots
from tests.fixtures import ATTENTION_PROJECTIONS, EXPERT_PARAMETERS, MOE_EXPERTS, MOE_FAMILIES, write_peft_adapter
from tests.reference import greedy_with_adapter
from tests.test_families import architecture

# routing ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("routing", "normalize"), [("softmax_topk", True), ("softmax_topk", False),
                                                    ("topk_softmax", False)])
def test_route_matches_float64(routing: str, normalize: bool) -> None:
    cfg = ExpertConfig(num_experts=7, top_k=3, intermediate_size=4, routing=routing, normalize_top_k=normalize)
    logits = torch.randn(50, 7, generator=torch.Generator().manual_seed(1)) * 3
    weights, experts = route(logits, cfg, torch.float32)
    z = logits.double()
    for t in range(50):
        order = sorted(range(7), key=lambda e: -float(z[t, e]))[:3]  # the 3 largest, descending
        assert experts[t].tolist() == order
        if routing == "softmax_topk":
            p = torch.softmax(z[t], 0)[order]
            expect = p / p.sum() if normalize else p
        else:
            expect = torch.softmax(z[t, order], 0)
        torch.testing.assert_close(weights[t].double(), expect, rtol=1e-6, atol=1e-7)


# the grouped experts op --------------------------------------------------------------------------------------

E, K, H, INTER, SLOTS, RANK = 6, 2, 32, 24, 4, 8
IDLE_EXPERT = 5  # no token is routed to it: its weights are NaN and must never be read
UNUSED_SLOT = 3  # a written slot no token reads: NaN, never read


def expert_case(seed: int) -> tuple[MoEExperts, dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]]]:
    """Experts with random weights and three adapters on slots 0-2 (gate_up only rank 3; both, ranks 8 and 5;
    down only rank 2), slot 3 holding NaNs; expert 5's weights NaN."""
    gen = torch.Generator().manual_seed(seed)
    cfg = ExpertConfig(num_experts=E, top_k=K, intermediate_size=INTER, routing="softmax_topk")
    moe = MoEExperts(cfg, H, "silu", SLOTS, RANK, torch.float32, "cpu")
    with torch.no_grad():
        moe.gate_up.copy_(torch.randn(E, 2 * INTER, H, generator=gen) / H**0.5)
        moe.down.copy_(torch.randn(E, H, INTER, generator=gen) / INTER**0.5)
        moe.gate_up[IDLE_EXPERT] = float("nan")
        moe.down[IDLE_EXPERT] = float("nan")

    def pair(rank: int, i: int, o: int, poison: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        if poison:
            return torch.full((E, rank, i), float("nan")), torch.full((E, o, rank), float("nan"))
        return torch.randn(E, rank, i, generator=gen) / i**0.5, torch.randn(E, o, rank, generator=gen) * 0.5

    adapters = {0: {"gate_up_proj": pair(3, H, 2 * INTER)},
                1: {"gate_up_proj": pair(8, H, 2 * INTER), "down_proj": pair(5, INTER, H)},
                2: {"down_proj": pair(2, INTER, H)},
                UNUSED_SLOT: {"gate_up_proj": pair(4, H, 2 * INTER, True), "down_proj": pair(4, INTER, H, True)}}
    for slot, pairs in adapters.items():
        moe.set_slot(slot, pairs)
    return moe, adapters


def loop_reference(moe_weights: tuple[torch.Tensor, torch.Tensor], adapters: dict, x: torch.Tensor,
                   experts: torch.Tensor, weights: torch.Tensor, slots: list[int]) -> torch.Tensor:
    """The module docstring's math, one (token, choice) at a time, in float64."""
    gate_up, down = (w.double() for w in moe_weights)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(K):
            e, xt = int(experts[t, j]), x[t].double()
            pairs = adapters.get(slots[t], {}) if slots[t] >= 0 else {}
            gu = gate_up[e] @ xt
            if "gate_up_proj" in pairs:
                a, b = pairs["gate_up_proj"]
                gu = gu + b[e].double() @ (a[e].double() @ xt)
            h = F.silu(gu[:INTER]) * gu[INTER:]
            d = down[e] @ h
            if "down_proj" in pairs:
                a, b = pairs["down_proj"]
                d = d + b[e].double() @ (a[e].double() @ h)
            out[t] += weights[t, j].double() * d
    return out


@pytest.mark.parametrize("weights_as", ["float", "packed", "int8"])
@pytest.mark.parametrize("kernels", ["sgmv", "torch"])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_grouped_experts_match_float64_loop(tokens: int, kernels: str, weights_as: str) -> None:
    """Tokens of three adapters and base tokens routed over five of six experts: each expert's pairs share its
    base matmul, the LoRA deltas run per (slot, expert) group; an idle expert and an unread slot (both NaN) are
    never touched. int8: against the loop on the dequantized weights."""
    moe, adapters = expert_case(tokens)
    if weights_as == "int8":
        moe.gate_up[IDLE_EXPERT] = 0.0  # int8 quantizes every expert (a NaN row has no scale)
        moe.down[IDLE_EXPERT] = 0.0
        moe.quantize_int8()
    elif weights_as == "packed":
        moe.pack_dense()
        assert moe.packed is not None or not torch.backends.mkldnn.is_available()
    moe.lora_kernels = kernels
    gen = torch.Generator().manual_seed(100 + tokens)
    x = torch.randn(tokens, H, generator=gen)
    experts = torch.stack([torch.randperm(IDLE_EXPERT, generator=gen)[:K] for _ in range(tokens)])  # [T, K]
    weights = torch.rand(tokens, K, generator=gen)
    rng = random.Random(tokens)
    slots = [rng.choice([-1, 0, 1, 2]) for _ in range(tokens)]
    slots[0] = 1  # every case has an adapter with both projections
    lora = lora_batch_from_slots(torch.tensor(slots), 0)
    calls: list[tuple[str, int]] = []
    matmul = moe._matmul
    moe._matmul = lambda which, e, rows: calls.append((which, e)) or matmul(which, e, rows)
    got = moe(x, group_by_expert(experts, weights, E), lora)
    hit = sorted(set(experts.flatten().tolist()))  # each expert hit: one matmul per projection; the idle one none
    assert sorted(calls) == [(w, e) for w in ("down", "gate_up") for e in hit]
    expect = loop_reference(moe.dense_weights(), adapters, x, experts, weights, slots)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), expect, rtol=0, atol=2e-5 * float(expect.abs().max()))
    base = moe(x, group_by_expert(experts, weights, E), None)  # no adapter: exactly the base experts
    expect = loop_reference(moe.dense_weights(), {}, x, experts, weights, [-1] * tokens)
    torch.testing.assert_close(base.double(), expect, rtol=0, atol=2e-5 * float(expect.abs().max()))


def test_expert_slots_are_allocated_by_the_first_expert_adapter() -> None:
    """Attention-only adapters (no expert pairs) leave the expert slot buffers unallocated, and their tokens get
    exactly the base experts; the first adapter with expert LoRA allocates them."""
    cfg = ExpertConfig(num_experts=E, top_k=K, intermediate_size=INTER, routing="softmax_topk")
    moe = MoEExperts(cfg, H, "silu", SLOTS, RANK, torch.float32, "cpu")
    with torch.no_grad():
        moe.gate_up.normal_()
        moe.down.normal_()
    moe.set_slot(0, {})
    moe.clear_slot(1)
    assert moe.gate_up_lora.lora_a is None and moe.down_lora.lora_b is None
    x, experts = torch.randn(4, H), torch.tensor([[0, 1], [2, 3], [1, 4], [0, 2]])
    groups = group_by_expert(experts, torch.rand(4, K), E)
    assert torch.equal(moe(x, groups, lora_batch_from_slots(torch.tensor([0, 0, 1, -1]), 0)), moe(x, groups, None))
    moe.set_slot(2, {"down_proj": (torch.randn(E, 3, INTER), torch.randn(E, H, 3))})
    assert moe.down_lora.lora_a.shape == (SLOTS * E, RANK, INTER) and moe.gate_up_lora.lora_a is None


def test_expert_groups_are_expert_sorted_and_stable() -> None:
    experts = torch.tensor([[2, 0], [0, 3], [2, 3], [1, 0]])
    groups = group_by_expert(experts, torch.arange(8.0).view(4, 2), 5)
    assert groups.bounds == (0, 3, 4, 6, 8, 8)
    assert groups.tokens.tolist() == [0, 1, 3, 3, 0, 2, 1, 2]
    assert groups.weights.tolist() == [1.0, 2.0, 7.0, 6.0, 0.0, 4.0, 3.0, 5.0]
    assert groups.runs() == [(0, 0, 3), (1, 3, 4), (2, 4, 6), (3, 6, 8)]


# engines -----------------------------------------------------------------------------------------------------


class RoutingRecorder:
    """Per step, which adapter slots sent tokens to each expert of block 0 (wraps its experts' forward)."""

    def __init__(self, llm: LLM) -> None:
        moe = llm.engine.model.layers[0].mlp.moe
        self.steps: list[dict[int, set[int]]] = []
        forward = moe.forward

        def recording(x: torch.Tensor, groups, lora):  # noqa: ANN001, ANN202
            slots = (torch.full_like(groups.tokens, -1) if lora is None
                     else lora.token_slots.index_select(0, groups.tokens))
            step: dict[int, set[int]] = {e: set() for e in range(MOE_EXPERTS)}
            for e, s in zip(groups.experts.tolist(), slots.tolist(), strict=True):
                step[e].add(s)
            self.steps.append(step)
            return forward(x, groups, lora)

        moe.forward = recording


@pytest.fixture(scope="module")
def moe_setup(tiny_checkpoint: Callable[[str], Path],
              tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, dict[str, Path]]]:
    made: dict[str, tuple[Path, dict[str, Path]]] = {}

    def get(arch: str) -> tuple[Path, dict[str, Path]]:
        if arch not in made:
            base = tiny_checkpoint(arch)
            root = tmp_path_factory.mktemp(f"{arch}-moe-adapters")
            experts = EXPERT_PARAMETERS[architecture(base)]
            made[arch] = base, {
                "experts": write_peft_adapter(base, root / "experts", rank=8, seed=11, b_std=0.3, target_modules=[],
                                              target_parameters=experts),
                "both": write_peft_adapter(base, root / "both", rank=4, alpha=4, seed=12, b_std=0.3,
                                           target_modules=ATTENTION_PROJECTIONS, target_parameters=experts,
                                           rank_pattern={"down_proj": 2}),
                "attn": write_peft_adapter(base, root / "attn", rank=6, seed=13, b_std=0.3,
                                           target_modules=ATTENTION_PROJECTIONS),
            }
        return made[arch]

    return get


@pytest.mark.parametrize("arch", MOE_FAMILIES)
def test_every_expert_serving_several_adapters_and_idle_experts_equal_hf_peft(arch: str, moe_setup: Callable) -> None:
    """One prefill step of 8 prompts (3 adapters + base) sends tokens of several adapters to every expert;
    decode steps of 8 tokens x 2 choices leave experts without a token. 48 greedy tokens equal HF + PEFT."""
    base, adapters = moe_setup(arch)
    rng = random.Random(3)
    names = [*adapters, None]
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(20, 30))] for _ in range(8)]
    chosen = [names[i % 4] for i in range(8)]
    llm = LLM(model=str(base), max_loras=3, max_lora_rank=8, kv_cache_blocks=128, max_num_batched_tokens=512,
              debug_checks=True)
    for name, folder in adapters.items():
        llm.load_adapter(name, folder)
    recorder = RoutingRecorder(llm)
    outs = llm.generate(prompts, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True), adapters=chosen)
    assert all(len(s - {-1}) >= 2 for s in recorder.steps[0].values()), "the prefill step: several adapters each"
    assert any(any(not s for s in step.values()) for step in recorder.steps[1:]), "no step left an expert idle"
    for name in names:
        idx = [i for i, c in enumerate(chosen) if c == name]
        refs = greedy_with_adapter(base, adapters.get(name), [prompts[i] for i in idx], 48)
        for i, (tokens, _) in zip(idx, refs, strict=True):
            assert outs[i].token_ids == tokens, f"prompt {i} adapter {name}"


# adapter layouts ---------------------------------------------------------------------------------------------


def test_peft_conversion_of_expert_target_modules_is_served(moe_setup: Callable, tmp_path: Path) -> None:
    """``target_modules`` gate_proj/up_proj/down_proj on Qwen3-MoE: PEFT writes target_parameters, gate_up at
    rank 2r with alpha 2a (scale unchanged); read as one pair per expert of that rank."""
    base, _ = moe_setup("qwen3moe")
    folder = write_peft_adapter(base, tmp_path / "conv", rank=4, alpha=8, seed=1,
                                target_modules=["gate_proj", "up_proj", "down_proj"])
    config = json.loads((folder / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == ["down_proj", "gate_up_proj"] and not config["target_modules"]
    weights = read_peft_adapter(folder, model_config(base), 8)
    a, b = weights.modules[(1, "gate_up_proj")]
    assert a.shape == (MOE_EXPERTS, 8, 64) and b.shape == (MOE_EXPERTS, 96, 8)
    tensors = load_file(folder / "adapter_model.safetensors")
    raw_a = tensors["base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight"]  # [E * r, in]
    raw_b = tensors["base_model.model.model.layers.1.mlp.experts.base_layer.lora_B.weight"]  # [out, r * E]
    expert = 5
    expect = raw_b.view(96, 8, MOE_EXPERTS)[:, :, expert] @ raw_a.view(MOE_EXPERTS, 8, 64)[expert] * (16 / 8)
    torch.testing.assert_close(b[expert] @ a[expert], expect)  # PEFT's delta of that expert
    assert weights.modules[(0, "down_proj")][0].shape == (MOE_EXPERTS, 4, 48)


def edited(folder: Path, out: Path, config: dict | None = None,
           tensors: Callable[[dict], dict] | None = None) -> Path:
    """A copy of an adapter folder with its config updated and its tensors rewritten."""
    shutil.copytree(folder, out)
    if config is not None:
        raw = json.loads((out / "adapter_config.json").read_text())
        (out / "adapter_config.json").write_text(json.dumps({**raw, **config}))
    if tensors is not None:
        save_file(tensors(load_file(out / "adapter_model.safetensors")), out / "adapter_model.safetensors")
    return out


def per_expert_modules(tensors: dict) -> dict:
    """transformers 4's layout: LoRA per expert module (``mlp.experts.3.gate_proj``)."""
    out = {k: v for k, v in tensors.items() if ".experts." not in k}
    for layer in range(2):
        for e in range(MOE_EXPERTS):
            for proj, (i, o) in {"gate_proj": (64, 48), "down_proj": (48, 64)}.items():
                key = f"base_model.model.model.layers.{layer}.mlp.experts.{e}.{proj}"
                out[f"{key}.lora_A.weight"], out[f"{key}.lora_B.weight"] = torch.zeros(4, i), torch.zeros(o, 4)
    return out


@pytest.mark.parametrize(("arch", "change", "error", "message"), [
    ("qwen3moe", dict(config={"target_parameters": None, "target_modules": ["gate_proj", "down_proj"]},
                      tensors=per_expert_modules), UnsupportedAdapter,
     r"module 'model\.layers\.0\.mlp\.experts\.0\.down_proj': LoRA on per-expert modules \(the transformers 4 "
     r"layout\) is not served; PEFT on transformers 5 saves LoRA on experts as target_parameters .*"
     r"layers\.N\.mlp\.experts\.gate_up_proj"),
    ("granitemoe", dict(config={"target_parameters": ["router.weight"]}), UnsupportedAdapter,
     r"target_parameters entry 'router\.weight' names no parameter loraplex adapts in GraniteMoeForCausalLM "
     r"\(adaptable through target_parameters: layers\.N\.block_sparse_moe\.experts\.gate_up_proj, "
     r"layers\.N\.block_sparse_moe\.experts\.down_proj\)"),
    ("qwen3moe", dict(config={"target_parameters": ["mlp.experts.down_proj"]}), InvalidAdapter,
     r"module 'model\.layers\.0\.mlp\.experts\.base_layer', but target_parameters=\['mlp\.experts\.down_proj'\] "
     r"select 1 of its parameters \(PEFT nests one wrapper per selected parameter; this one is 2 deep\)"),
    ("qwen3moe", dict(config={"target_parameters": []}), InvalidAdapter,
     r"module 'model\.layers\.0\.mlp\.experts', but target_parameters=\[\] select 0 of its parameters"),
    ("granitemoe", dict(config={"r": 8, "rank_pattern": {}}), AdapterShapeMismatch,
     r"block_sparse_moe\.experts\.lora_A has shape \[16, 48\], expected \[64, 48\] \(rank 8 x 8 experts; each "
     r"expert is 48 -> 64\)"),
    ("qwen3moe", dict(config={"rank_pattern": {"down_proj": 2, "gate_up_proj": 12}}), AdapterRankTooLarge,
     r"module 'model\.layers\.0\.mlp\.experts\.base_layer' has rank 12, over max_lora_rank=8"),
])
def test_expert_layouts_peft_does_not_write_are_refused(arch: str, change: dict, error: type, message: str,
                                                        moe_setup: Callable, tmp_path: Path) -> None:
    base, adapters = moe_setup(arch)
    folder = edited(adapters["both"], tmp_path / "edited", **change)
    with pytest.raises(error, match=message) as caught:
        read_peft_adapter(folder, model_config(base), 8)
    assert str(folder) in str(caught.value)


def test_target_parameters_on_a_dense_family_are_refused(tiny_checkpoint: Callable[[str], Path],
                                                         tmp_path: Path) -> None:
    base = tiny_checkpoint("qwen3")
    folder = write_peft_adapter(base, tmp_path / "param", rank=4, target_modules=["k_proj"],
                                target_parameters=["self_attn.q_proj.weight"])
    with pytest.raises(UnsupportedAdapter, match=r"target_parameters entry 'self_attn\.q_proj\.weight' names no "
                       r"parameter loraplex adapts in Qwen3ForCausalLM \(adaptable through target_parameters: none\)"):
        read_peft_adapter(folder, model_config(base), 8)


def test_dense_layers_between_sparse_ones_are_refused(tiny_checkpoint: Callable[[str], Path]) -> None:
    raw = json.loads((tiny_checkpoint("qwen3moe") / "config.json").read_text())
    with pytest.raises(ModelError, match=r"Qwen3MoeForCausalLM with dense MLP layers \(mlp_only_layers=\[1\]"):
        model_config({**raw, "mlp_only_layers": [1]})
    with pytest.raises(ModelError, match="decoder_sparse_step=2"):
        model_config({**raw, "decoder_sparse_step": 2})
